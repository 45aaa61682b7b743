"""A worker of an elastic job, for tests/scheduler/test_elastic.py.

    python elastic_worker.py sums  --steps N --die RANK --die-at STEP
    python elastic_worker.py train --steps N --every M [--die RANK --die-at STEP]
    python elastic_worker.py async --steps N --die RANK --die-at STEP

sums (dist_sync, no optimizer): keys 'a' and 'b' (each split over the servers);
at every step worker r pushes r + 1 into each with one pushpull per key and
prints what it got: the sum of the round. Worker RANK kills itself (SIGKILL) at
step STEP after its pushpull of 'a' and before 'b', so that round of 'a' holds its
push and that of 'b' does not. With --close-then-fail, worker RANK instead
calls kv.close() at that step, after both pushpulls, and exits with status 3.

train (dist_sync, sgd on the servers): every M steps the members record the
step (kv.save_progress), every worker passes a barrier and prints a digest
of the weights it pulls after it; a worker that joined the running job meets
the others at such a barrier, takes their step and prints its first pull.
Worker RANK, unless it is a replacement, kills itself at step STEP. With
--members K, the workers wait at the barrier of step M (and later ones) until K
workers are members, so that a joiner meets them there. With --kill-server R:S
(replicated servers), worker 0 sends server R SIGKILL right after its pushpull of
step S.

async (dist_async, sgd lr 1: each push of ones subtracts 1): worker RANK kills
itself after STEP pushpulls; the others pass a final barrier (which completes
once the dead worker has left) and print the value they pull.
"""

import argparse
import hashlib
import os
import signal
import time

import numpy as np

import kvstore
from kvstore import optimizer as kvopt

SIZE = 3000     # floats per key: with KVSTORE_CHUNK_BYTES=4096 split over the servers

p = argparse.ArgumentParser()
p.add_argument("mode", choices=("sums", "train", "async"))
p.add_argument("--steps", type=int, default=8)
p.add_argument("--every", type=int, default=4)
p.add_argument("--die", type=int, default=-1)
p.add_argument("--die-at", type=int, default=-1)
p.add_argument("--close-then-fail", action="store_true",
               help="sums: worker --die closes its store at --die-at and exits with status 3")
p.add_argument("--members", type=int, default=0,
               help="train: from step --every on, pass barriers until this many workers are members")
p.add_argument("--kill-server", default="", help="train: R:S, worker 0 kills server R after its step S")
args = p.parse_args()


def die_now(step: int) -> bool:
    return kv.rank == args.die and step == args.die_at and not kv.joined


def digest(value: np.ndarray) -> str:
    return hashlib.sha1(value.tobytes()).hexdigest()[:16]


kv = kvstore.create("dist_async" if args.mode == "async" else "dist_sync")
print(f"worker {kv.rank} started, joined={kv.joined}, members={list(kv.members)}", flush=True)
out = np.empty(SIZE, np.float32)

if args.mode == "sums":
    kv.init(["a", "b"], [np.zeros(SIZE, np.float32)] * 2)
    for step in range(args.steps):
        for key in ("a", "b"):
            kv.pushpull(key, np.full(SIZE, kv.rank + 1, np.float32), out=out)
            assert (out == out[0]).all(), out
            print(f"worker {kv.rank} step {step} {key} {out[0]:g}", flush=True)
            if key == "a" and die_now(step) and not args.close_then_fail:
                os.kill(os.getpid(), signal.SIGKILL)
        if die_now(step) and args.close_then_fail:
            kv.close()
            print(f"worker {kv.rank} closed at step {step}; exiting with status 3", flush=True)
            raise SystemExit(3)

elif args.mode == "async":
    kv.init("w", np.zeros(SIZE, np.float32))
    kv.set_optimizer(kvopt.create("sgd", learning_rate=1.0, wd=0.0))
    for step in range(args.steps):
        if die_now(step):
            os.kill(os.getpid(), signal.SIGKILL)
        kv.pushpull("w", np.ones(SIZE, np.float32), out=out)
    kv.barrier()
    kv.pull("w", out=out)
    print(f"worker {kv.rank} final {out[0]:g} members {list(kv.members)}", flush=True)

else:
    rng = np.random.default_rng(0)
    kv.init("w", rng.standard_normal(SIZE).astype(np.float32))
    kv.set_optimizer(kvopt.create("sgd", learning_rate=0.1, momentum=0.9, wd=0.0))
    kv.pull("w", out=out)
    step, joining = 0, kv.joined
    while step < args.steps:
        if step % args.every == 0 or joining:
            if not joining:
                kv.save_progress({"step": step})
            kv.barrier()
            deadline = time.monotonic() + 90
            while step >= args.every and len(kv.members) < args.members and not joining:
                if time.monotonic() > deadline:
                    raise SystemExit(f"worker {kv.rank}: nobody joined within 90 s")
                kv.barrier()      # a worker is about to join: it meets us at one of these
            if joining:
                step = kv.progress["step"]
            kv.pull("w", out=out)
            print(f"worker {kv.rank} {'joined' if joining else 'barrier'} step {step} "
                  f"members {list(kv.members)} weights {digest(out)}", flush=True)
            joining = False
        if die_now(step):
            os.kill(os.getpid(), signal.SIGKILL)
        grad = np.sin(out * (kv.rank + 1) + step).astype(np.float32)
        kv.pushpull("w", grad, out=out)
        if args.kill_server and kv.rank == 0 and not kv.joined and step == int(args.kill_server.split(":")[1]):
            from job_processes import server_pid     # tests/scripts/, this script's folder
            os.kill(server_pid(int(args.kill_server.split(":")[0])), signal.SIGKILL)
            print(f"worker 0 killed server {args.kill_server.split(':')[0]} at step {step}", flush=True)
        step += 1
    kv.save_progress({"step": args.steps})
    print(f"worker {kv.rank} done members {list(kv.members)} weights {digest(out)}", flush=True)
kv.close()
