"""MXNet 1.9.1's dist kvstore: a scheduler, S servers and W workers started as
processes with the DMLC_* environment that MXNet's tools/launch.py (local mode)
sets, all running peers/mxnet_worker.py in benchmarks/.venv-mxnet."""

from __future__ import annotations

import os

from ..contenders.base import Failed, RunConfig, Skip, read_result, rows_from
from ..procs import GroupFailed, free_port, run_group
from ..resnet50_shapes import model_nbytes
from .venvs import PEERS, probe

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mxnet_worker.py")
VARIANTS = {"push_pull": "push, then pull", "pushpull": "pushpull"}


def version() -> str:
    ok, line = probe(PEERS["mxnet"])
    if not ok:
        raise Skip(line)
    return line


def _job(cfg: RunConfig, args: list[str], tag: str) -> dict:
    py = PEERS["mxnet"].python
    out = cfg.path(f"{tag}.json")
    if os.path.exists(out):
        os.remove(out)
    base = {"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(free_port()),
            "DMLC_NUM_WORKER": str(cfg.workers), "DMLC_NUM_SERVER": str(cfg.servers),
            "DMLC_NODE_HOST": "127.0.0.1", "DMLC_INTERFACE": "lo", "PS_VERBOSE": "0", **cfg.env}
    argv = [py, WORKER, *args, "--out", out]
    procs = [("scheduler", argv, {**base, "DMLC_ROLE": "scheduler"})]
    procs += [(f"server {i}", argv, {**base, "DMLC_ROLE": "server"}) for i in range(cfg.servers)]
    procs += [(f"worker {i}", argv, {**base, "DMLC_ROLE": "worker"}) for i in range(cfg.workers)]
    try:
        # servers and the scheduler leave once the workers are done; wait for the workers
        run_group(procs, cfg.path(f"{tag}.log"), cfg.timeout,
                  wait_for={f"worker {i}" for i in range(cfg.workers)})
    except GroupFailed as e:
        raise Failed(f"mxnet ({tag}): {e}") from None
    return read_result(out, f"mxnet ({tag})")


def run(cfg: RunConfig, launch_no: int) -> list[dict]:
    version()
    nbytes = model_nbytes(cfg.model)
    rows = rows_from(_job(cfg, cfg.worker_args(), f"mxnet-{launch_no}"), "mxnet", launch_no,
                     VARIANTS, nbytes, {"servers": cfg.servers})
    if not cfg.async_pushes:
        return rows
    res = _job(cfg, cfg.async_args(), f"mxnet-async-{launch_no}")
    for r in rows_from(res, "mxnet", launch_no, {}, nbytes):
        r["variant"] = f"dist_async, {r['variant']}"
        rows.append(r)
    return rows
