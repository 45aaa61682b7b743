"""The workload of chaos's replicated mode (benchmarks/chaos/replicated.py): a job that
must survive a server's death (``KVSTORE_REPLICAS=1``) and show that no round and no
push was lost or applied twice.

    KVSTORE_REPLICAS=1 KVSTORE_DETERMINISTIC=1 KVSTORE_CHUNK_BYTES=4096 \\
        python -m tracker.local -n 3 -s 3 python benchmarks/chaos/replicated_worker.py --mode sync

``--mode sync`` (dist_sync): three keys cut into chunks over every server, SGD
with momentum and weight decay on the servers, gradients that are no exact
multiples of anything (``sin``: with 3 or more workers their float32 sum depends on
the order it is taken in), one ``pushpull`` a round. With deterministic sums the
final weights are a function of W and the rounds only: ``digest HEX`` (sha256 of
them) must equal an uninterrupted run's, bit for bit, whatever server died when.

``--mode async`` (dist_async): every worker pushes integers under SGD with
learning rate 1 (float32 sums of these small integers are exact), ``pushpull`` a
round; a pulled value must be integral and at least this worker's push below its
previous pull, else ``WRONG ...`` (status 3). After a barrier every worker pulls
and prints ``exact`` when the values are the initial ones minus every push each
counted once (every acknowledged push applied exactly once), else ``WRONG``.

``--mode ssp`` (dist_ssp, staleness :data:`STALENESS`): as async, and each value a
``pushpull`` returns at this worker's clock c (its c-th round) must also hold the
bound: at least this worker's c pushes and every other worker's first c - s
(``WRONG ... bound``), a check a server that lost the clocks in a failover fails.

Printed, for the runner: ``initialised`` after ``init`` (before ``set_optimizer``);
``round N T`` after each round (T: ``time.time()`` when its ``pushpull`` returned);
with ``--save-every K``: ``saving K`` / ``saved K`` around the K-th
``save_checkpoint`` (KVSTORE_CHECKPOINT_DIR), or ``save K failed: ...`` (a server
that dies during a save may fail it: the previous set stays, and the job goes on,
as docs/reliability.md says a user's may; every worker raises CheckpointError); at the end ``digest HEX`` or ``exact``.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time

import numpy as np

import kvstore
from kvstore import optimizer as opt

SIZES = {"w": 3000, "b": 7, "v": 1500}
STALENESS = 2          # --mode ssp


def gradient(rank: int, step: int, size: int) -> np.ndarray:
    """Inexact values: their sums over 3+ workers depend on the order of the adds."""
    return np.sin(np.arange(size, dtype=np.float32) * (rank + 1) * 0.37 + step).astype(np.float32)


def pushed(rank: int, step: int) -> float:
    """dist_async: the integer a worker pushes in a round (every element)."""
    return float((rank + 1) * (step % 5 + 1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["sync", "async", "ssp"], default="sync")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--save-every", type=int, default=0, help="rounds between saves [0: none]")
    args = p.parse_args()
    kv = kvstore.create("dist_ssp", staleness=STALENESS) if args.mode == "ssp" else kvstore.create(f"dist_{args.mode}")
    from kvstore.worker.dist import DistStore   # imported by create already (a server never gets here)
    assert isinstance(kv, DistStore)   # what dist_sync, dist_async and dist_ssp build
    keys = list(SIZES)
    if args.mode == "sync":
        kv.init(keys, [np.linspace(-1, 1, n, dtype=np.float32) for n in SIZES.values()])
    else:
        kv.init(keys, [np.zeros(n, np.float32) for n in SIZES.values()])
    print(f"host group {list(kv.host_group)}", flush=True)   # (KVSTORE_HOST_REDUCE=1, dist_sync)
    print("initialised", flush=True)
    if args.mode == "sync":
        kv.set_optimizer(opt.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3))
    else:
        kv.set_optimizer(opt.SGD(learning_rate=1.0))
    outs = [np.empty(n, np.float32) for n in SIZES.values()]
    last = [np.zeros(n, np.float32) for n in SIZES.values()]
    for step in range(args.rounds):
        if args.mode == "sync":
            grads = [gradient(kv.rank, step, n) for n in SIZES.values()]
        else:
            grads = [np.full(n, pushed(kv.rank, step), np.float32) for n in SIZES.values()]
        kv.pushpull(keys, grads, out=outs)
        done = time.time()
        if args.mode != "sync":
            mine = pushed(kv.rank, step)
            bad = [k for k, o, prev in zip(keys, outs, last)
                   if not ((o <= prev - mine).all() and (o == np.round(o)).all())]
            if bad:
                print(f"WRONG round {step} keys {bad}: {[o.flat[:3].tolist() for o in outs]}", flush=True)
                return 3
            if args.mode == "ssp":       # at clock step + 1: every worker's first step + 1 - s pushes, all of its own
                least = sum(pushed(kv.rank, t) for t in range(step + 1)) + sum(
                    pushed(r, t) for r in range(kv.num_workers) if r != kv.rank for t in range(step + 1 - STALENESS))
                bad = [k for k, o in zip(keys, outs) if not (o <= -least).all()]
                if bad:
                    print(f"WRONG round {step} keys {bad} bound: {[float(o.max()) for o in outs]} read, at most "
                          f"{-least} (staleness {STALENESS})", flush=True)
                    return 3
            for prev, o in zip(last, outs):
                np.copyto(prev, o)
        print(f"round {step} {done:.6f}", flush=True)
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.rounds:
            k = (step + 1) // args.save_every
            print(f"saving {k}", flush=True)
            try:
                kv.save_checkpoint({"step": step + 1})
            except kvstore.CheckpointError as e:
                print(f"save {k} failed: {e}", flush=True)
            else:
                print(f"saved {k}", flush=True)
    if args.mode == "sync":
        kv.pull(keys, out=outs)
        print("digest", hashlib.sha256(b"".join(o.tobytes() for o in outs)).hexdigest(), flush=True)
    else:
        kv.barrier()       # every worker's pushes acknowledged
        kv.pull(keys, out=outs)
        want = -sum(pushed(r, s) for r in range(kv.num_workers) for s in range(args.rounds))
        wrong = [float(o.flat[0]) - want for o in outs if not np.all(o == want)]
        print("exact" if not wrong else f"WRONG: differs by {wrong} pushes' worth", flush=True)
    kv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
