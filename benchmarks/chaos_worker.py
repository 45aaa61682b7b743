"""The workload of benchmarks/chaos.py: rounds of exact sums, checked every round.

    python -m tracker.local -n 3 -s 2 python benchmarks/chaos_worker.py --mode sync

Each worker pushes values that are exact in float32 and checks what it pulls: in
sync mode the sum of every worker's push of the round, in async mode (SGD with
learning rate 1 on the servers) a value that only ever decreases by whole
pushes. A wrong value prints ``WRONG ...`` and exits with status 3. Every round
prints ``round N ok``. With CHAOS_FAULT=exit|raise and CHAOS_RANK=r, worker r
exits with status 1 or raises an uncaught exception after CHAOS_AFTER rounds
(the runner's in-process faults); signals come from the runner.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import kvstore
from kvstore import optimizer as opt

SHAPES = [(1000,), (300, 7), (20_000,)]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["sync", "async"], default="sync")
    p.add_argument("--rounds", type=int, default=100_000)
    args = p.parse_args()
    fault, fault_rank = os.environ.get("CHAOS_FAULT"), int(os.environ.get("CHAOS_RANK", "-1"))
    after = int(os.environ.get("CHAOS_AFTER", "0"))
    kv = kvstore.create("dist_sync" if args.mode == "sync" else "dist_async")
    keys = list(range(len(SHAPES)))
    kv.init(keys, [np.zeros(s, np.float32) for s in SHAPES])
    if args.mode == "async":
        kv.set_optimizer(opt.SGD(learning_rate=1.0))
    outs = [np.empty(s, np.float32) for s in SHAPES]
    last = [np.zeros(s, np.float32) for s in SHAPES]
    print(f"ready rank {kv.rank}", flush=True)
    for step in range(args.rounds):
        if kv.rank == fault_rank and step == after:
            if fault == "exit":
                print("chaos: exiting with status 1", flush=True)
                sys.exit(1)
            if fault == "raise":
                raise RuntimeError("chaos: an uncaught exception in the training loop")
        mine = float((kv.rank + 1) * (step % 97 + 1))
        kv.pushpull(keys, [np.full(s, mine, np.float32) for s in SHAPES], out=outs)
        if args.mode == "sync":
            want = float(sum((r + 1) * (step % 97 + 1) for r in range(kv.num_workers)))
            bad = [k for k, o in zip(keys, outs) if not (o == want).all()]
        else:   # each applied push subtracts a positive whole number: down, integral, uniform
            bad = [k for k, o, prev in zip(keys, outs, last)
                   if not ((o <= prev - mine).all() and (o == np.round(o)).all() and (o == o.flat[0]).all())]
            for prev, o in zip(last, outs):
                np.copyto(prev, o)
        if bad:
            print(f"WRONG round {step} keys {bad}: {[o.flat[:3].tolist() for o in outs]}", flush=True)
            return 3
        print(f"round {step} ok", flush=True)
    kv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
