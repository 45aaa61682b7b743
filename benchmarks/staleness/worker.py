"""One worker of the staleness benchmark (started by benchmarks/staleness/run.py under
``tracker.local``).

A step: "compute" (a sleep of ``--compute`` seconds; the slowed worker, rank
``--slow-rank``, sleeps ``--delay`` more on every ``--every``-th step; with
``--rotate`` the workers take turns: on the n-th delayed step, worker n mod W), then one
``pushpull`` of a ``--size`` float32 key of ones, with SGD at learning rate 1 on
the servers, so a value read is minus the number of pushes applied. Every read is
checked against the store's bound: all of this worker's own t pushes and at least
t - s of every other worker's (dist_sync: s = 0, and exactly W t; dist_async: no
bound); a wrong value fails the run (exit status 1). Writes
``<out>/worker-<rank>.json``: the timed steps' seconds, and per read how many
pushes of the others it missed (their t each, minus what it held; may be negative
for a slow worker's read, which can hold others' later pushes).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import kvstore  # noqa: E402
from benchmarks.harness import common  # noqa: E402

KEY = "w"


def staleness(text: str) -> float:
    return math.inf if text == "inf" else int(text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", choices=["dist_sync", "dist_ssp", "dist_async"], required=True)
    p.add_argument("--staleness", type=staleness, default=None, help="dist_ssp's bound (int or inf)")
    p.add_argument("--steps", type=int, required=True, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--size", type=int, default=1 << 18, help="float32 values of the key")
    p.add_argument("--compute", type=float, default=0.02, help="seconds of 'compute' a step")
    p.add_argument("--delay", type=float, default=0.06, help="extra seconds of the slowed worker")
    p.add_argument("--every", type=int, default=1, help="the slowed worker is delayed every N-th step")
    p.add_argument("--slow-rank", type=int, default=-1, help="the slowed worker (-1: the last)")
    p.add_argument("--rotate", action="store_true", help="the workers take turns being slowed")
    p.add_argument("--out", required=True, help="directory of the per-worker JSON files")
    a = p.parse_args()
    extra = {"staleness": a.staleness} if a.store == "dist_ssp" else {}
    bound = {"dist_sync": 0, "dist_async": math.inf}.get(a.store, a.staleness)
    kv = kvstore.create(a.store, **extra)
    assert isinstance(kv, kvstore.KVStore)   # a built-in store type
    with kv:
        slow = a.slow_rank % kv.num_workers
        kv.init(KEY, np.zeros(a.size, np.float32))
        kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=1.0))
        grad, out = np.ones(a.size, np.float32), np.empty(a.size, np.float32)
        kv.barrier()
        times, behind = [], []
        others = kv.num_workers - 1
        for t in range(1, a.warmup + a.steps + 1):
            started = time.perf_counter()
            delayed = t % a.every == 0 and kv.rank == ((t // a.every) % kv.num_workers if a.rotate else slow)
            time.sleep(a.compute + (a.delay if delayed else 0.0))
            kv.pushpull(KEY, grad, out=out)
            seen = -float(out[0])
            if not (out == out[0]).all() or seen < t + others * max(0.0, t - bound) \
                    or (bound == 0 and seen != kv.num_workers * t):
                print(f"worker {kv.rank}: step {t} read {seen!r} pushes: outside the bound "
                      f"(staleness {bound}, {kv.num_workers} workers)", file=sys.stderr)
                return 1
            if t > a.warmup:
                times.append(time.perf_counter() - started)
                behind.append(others * t - (seen - t))
        common.write_json(os.path.join(a.out, f"worker-{kv.rank}.json"),
                          {"rank": kv.rank, "slow": kv.rank == slow and not a.rotate, "times": times,
                           "behind": behind})
    return 0


if __name__ == "__main__":
    sys.exit(main())
