"""torch.distributed with the gloo backend: W spawned processes, rendezvous at
``tcp://127.0.0.1:<port>``; see gloo_worker.py for the three modes."""

from __future__ import annotations

import os
import sys

from .base import Failed, RunConfig, Skip, read_result, rows_from
from ..procs import GroupFailed, free_port, run_group
from ..resnet50_shapes import model_nbytes

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gloo_worker.py")
VARIANTS = {"per_tensor": "all_reduce per tensor", "flat": "one flat all_reduce",
            "buckets": "25 MB buckets (DDP)"}


def version() -> str:
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        raise Skip(f"torch is not installed ({e}); pip install torch==2.13.0") from None
    if not dist.is_available() or not dist.is_gloo_available():
        raise Skip("this torch build has no gloo backend")
    return f"torch {torch.__version__}"


def run(cfg: RunConfig, launch_no: int) -> list[dict]:
    version()
    out = cfg.path(f"gloo-{launch_no}.json")
    if os.path.exists(out):
        os.remove(out)
    init = f"tcp://127.0.0.1:{free_port()}"
    argv = [sys.executable, WORKER, *cfg.worker_args(), "--out", out]
    procs = [(f"gloo rank {r}", argv, {"RANK": str(r), "WORLD_SIZE": str(cfg.workers),
                                       "BENCH_INIT_METHOD": init, **cfg.env})
             for r in range(cfg.workers)]
    try:
        run_group(procs, cfg.path(f"gloo-{launch_no}.log"), cfg.timeout)
    except GroupFailed as e:
        raise Failed(f"gloo: {e}") from None
    res = read_result(out, "gloo")
    return rows_from(res, "gloo", launch_no, VARIANTS, model_nbytes(cfg.model))
