"""The Ray actor parameter server (peers/ray_bench.py) in benchmarks/.venv-ray."""

from __future__ import annotations

import os
import shutil
import tempfile

from ..contenders.base import Failed, RunConfig, Skip, read_result, rows_from
from ..procs import GroupFailed, run_group
from ..resnet50_shapes import model_nbytes
from .venvs import PEERS, probe

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ray_bench.py")


def version() -> str:
    ok, line = probe(PEERS["ray"])
    if not ok:
        raise Skip(line)
    return line


def run(cfg: RunConfig, launch_no: int) -> list[dict]:
    version()
    out = cfg.path(f"ray-{launch_no}.json")
    if os.path.exists(out):
        os.remove(out)
    argv = [PEERS["ray"].python, DRIVER, "--workers", str(cfg.workers), *cfg.worker_args(),
            "--out", out]
    # a short temp dir: Ray's unix socket paths must stay under 108 bytes
    tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    env = {"BENCH_RAY_TMP": tmp, "RAY_USAGE_STATS_ENABLED": "0", **cfg.env}
    try:
        run_group([("ray driver", argv, env)], cfg.path(f"ray-{launch_no}.log"), cfg.timeout)
    except GroupFailed as e:
        raise Failed(f"ray: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows_from(read_result(out, "ray"), "ray", launch_no,
                     {"actor_ps": "actor PS (1 server actor)"}, model_nbytes(cfg.model), {"servers": 1})
