"""The workload of chaos's phase faults (benchmarks/chaos/phases.py): deterministic
training with an optimizer on the servers, checkpoints, and a digest of the final
weights that an uninterrupted run reproduces bit for bit.

    KVSTORE_CHECKPOINT_DIR=/tmp/ckpt KVSTORE_CHUNK_BYTES=33554432 python -m tracker.local -n 2 -s 2 \\
        python benchmarks/chaos/train.py --servers 2 --big-rank 1 --steps 30 --save-every 5
    ... the same command plus --resume (after a crash)

The workers train six keys (``w0``..``w5``) with SGD with momentum and weight decay
on the servers (dist_sync). Every gradient element is a multiple of 1/4 between -1
and 1, so sums of up to 16 workers are exact in float32 and do not depend on the
order the pushes arrive in: the final weights are a function of the number of
workers and steps only (not of the servers, the placement or any checkpoint).
``--save-every K`` saves a checkpoint (``kv.save_checkpoint({"step": s})``) after
every K steps; with 0 the job relies on KVSTORE_CHECKPOINT_INTERVAL. Either way a
resumed job continues from ``kv.resume_meta.get("step", 0)``, as
docs/reliability.md tells users to.

Besides the trained keys, every server holds a pad key and server ``--big-rank``
a ballast of ``--ballast-mb`` MB (never pushed): that server's checkpoint is the
big one, slow to write (the runner's kill lands mid-write) and the one a small
disk cannot take (the others' still fit). Placement is by size (kvstore/sharding.py),
so the pads, of distinct sizes with the big rank's the smallest, steer the ballast
there; KVSTORE_CHUNK_BYTES must be above the ballast's size, or it would be split.

Printed, for the runner: ``resumed R at step N``; ``step N ok``; ``saving K`` and
``saved K`` around the K-th save; ``digest HEX`` (sha256 of the trained keys'
final values) after the last step; ``closed`` once ``kv.close()`` returned. A pad
or ballast value that differs from its initial one after the last step prints
``WRONG ...`` and exits with status 3. With CHAOS_FAULT=exit|raise, CHAOS_RANK=r
and CHAOS_AT=create|init|teardown, worker r exits with status 1 or raises before
``kvstore.create``, before ``init``, or after its digest (before ``close``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import numpy as np

import kvstore
from kvstore import optimizer as opt

TRAINED, TRAINED_SIZE = 6, 32 * 1024      # float32 elements: 128 KB a key
PAD_SIZE = 1024


def gradient(rank: int, step: int, key: int) -> np.ndarray:
    """Multiples of 1/4 in [-1, 1]: exact in float32, and so are their sums."""
    i = np.arange(TRAINED_SIZE, dtype=np.int64)
    return (((i * (rank + 1) + step * 7 + key * 13) % 9 - 4) * 0.25).astype(np.float32)


def layout(servers: int, big_rank: int, ballast_mb: float) -> tuple[list, list]:
    """The keys and initial values, in the order that steers the ballast to
    ``big_rank``: a pad per server first (each lands on the next empty server, the
    big rank's the smallest), then the trained keys (one at a time on the lightest
    server), then the ballast, on the lightest: the big rank."""
    keys, values = [], []
    for r in range(servers):
        keys.append(f"pad{r}")
        values.append(np.full(PAD_SIZE + (0 if r == big_rank else 64 * (r + 1)), r + 1, np.float32))
    for k in range(TRAINED):
        keys.append(f"w{k}")
        values.append(np.zeros(TRAINED_SIZE, np.float32))
    keys.append("ballast")
    values.append((np.arange(int(ballast_mb * (1 << 20)) // 4) % 251).astype(np.float32))
    return keys, values


def maybe_fault(kv_rank: int | None, at: str) -> None:
    """The in-process fault of CHAOS_FAULT/CHAOS_RANK/CHAOS_AT, if it is due here
    (before create the rank comes from the environment the launcher set)."""
    if os.environ.get("CHAOS_AT") != at:
        return
    rank = kv_rank if kv_rank is not None else int(os.environ.get("KVSTORE_RANK", "-1"))
    if rank != int(os.environ.get("CHAOS_RANK", "-1")):
        return
    fault = os.environ.get("CHAOS_FAULT")
    if fault == "exit":
        print(f"chaos: exiting with status 1 at {at}", flush=True)
        sys.exit(1)
    if fault == "raise":
        raise RuntimeError(f"chaos: an uncaught exception at {at}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", type=int, required=True, help="the job's number of servers")
    p.add_argument("--big-rank", type=int, default=0, help="the server that holds the ballast")
    p.add_argument("--ballast-mb", type=float, default=16.0)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=5, help="steps between saves [0: automatic only]")
    args = p.parse_args()
    maybe_fault(None, "create")
    kv = kvstore.create("dist_sync")
    from kvstore.worker.dist import DistStore   # imported by create already (a server never gets here)
    assert isinstance(kv, DistStore)   # what dist_sync builds
    maybe_fault(kv.rank, "init")
    start = int(kv.resume_meta.get("step", 0))
    print(f"resumed {kv.resumed} at step {start}", flush=True)
    keys, initial = layout(args.servers, args.big_rank, args.ballast_mb)
    kv.init(keys, initial)                   # resumed: the checkpoint's values win
    kv.set_optimizer(opt.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3))
    trained = [f"w{k}" for k in range(TRAINED)]
    outs = [np.empty(TRAINED_SIZE, np.float32) for _ in trained]
    for step in range(start, args.steps):
        kv.pushpull(trained, [gradient(kv.rank, step, k) for k in range(TRAINED)], out=outs)
        print(f"step {step} ok", flush=True)
        done = step + 1
        if args.save_every and done % args.save_every == 0 and done < args.steps:
            print(f"saving {done // args.save_every}", flush=True)
            kv.save_checkpoint({"step": done})
            print(f"saved {done // args.save_every}", flush=True)
    kv.pull(trained, out=outs)
    fixed = {k: v for k, v in zip(keys, initial, strict=True) if k not in trained}   # never pushed
    got = {k: np.empty_like(v) for k, v in fixed.items()}
    kv.pull(list(got), out=list(got.values()))
    changed = [k for k, v in fixed.items() if not np.array_equal(got[k], v)]
    if changed:
        print(f"WRONG keys {changed} differ from their initial values (never pushed)", flush=True)
        return 3
    print("digest", hashlib.sha256(b"".join(o.tobytes() for o in outs)).hexdigest(), flush=True)
    maybe_fault(kv.rank, "teardown")
    kv.close()
    print("closed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
