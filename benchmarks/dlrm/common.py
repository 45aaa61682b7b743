"""What both DLRM workers share: their arguments, the timed loop and what it
measures (standard library + numpy: the TorchRec venv imports it too).

Measured per process: the loss of every step; the wall time of the timed steps
(after the warm-up ones and a barrier); the TCP payload bytes this process sent
plus received over them (``ss``, every socket of the pid: the same count for our
store's sockets and gloo's); its peak RSS (``VmHWM`` in /proc/self/status) and its
RSS before the model was built.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from benchmarks.harness.common import tcp_bytes
from benchmarks.dlrm.data import Config, parse_tables

def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--tables", required=True, help="e.g. 8x100000: rows of each table")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=512, help="per worker")
    p.add_argument("--pooling", type=int, default=8, help="ids per bag")
    p.add_argument("--n-dense", type=int, default=13)
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bottom", default="64", help="hidden sizes of the bottom MLP (its last is --dim)")
    p.add_argument("--top", default="64,32", help="hidden sizes of the top MLP (its last is 1)")
    p.add_argument("--lr", type=float, default=0.1, help="plain SGD, tables and MLPs")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (their losses count)")
    p.add_argument("--out-dir", required=True, help="each rank writes rank<r>.json here")
    return p


def config(args) -> Config:
    return Config(tables=parse_tables(args.tables), dim=args.dim, batch=args.batch, pooling=args.pooling,
                  n_dense=args.n_dense, zipf=args.zipf, seed=args.seed)


def sizes(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def status_kb(field: str, pid: int | str = "self") -> int:
    """A field of /proc/<pid>/status in kB (VmRSS, VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def train(args, step, sync) -> dict:
    """``step(i)`` -> the loss (a float) for ``warmup + steps`` steps; ``sync()`` is
    a barrier of the job. Returns what this process measured."""
    losses = [step(i) for i in range(args.warmup)]
    sync()
    pid = os.getpid()
    moved, t0 = tcp_bytes(pid), time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        losses.append(step(i))
    elapsed = time.perf_counter() - t0
    moved = tcp_bytes(pid) - moved
    return {"losses": losses, "elapsed_s": elapsed, "steps_per_s": args.steps / elapsed,
            "tcp_bytes_per_step": moved / args.steps}


def write(args, rank: int, result: dict) -> None:
    result = {"rank": rank, "args": vars(args), "peak_rss_mb": status_kb("VmHWM") / 1024, **result}
    path = os.path.join(args.out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)
