"""The worker of benchmarks.failover: STEPS dist_sync pushpulls of KEYS fp32 keys of
SIZE values (cut over every server), SGD with momentum on the servers; prints one
line per completed step with its wall-clock time (``step I T``). With KILL=R:S,
worker 0 sends server R SIGKILL (KILL_SIGNAL: another signal) at the start of step
S, prints ``kill T``, and goes on; the step's pushpull then waits for the failover.

    python -m tracker.local -n 2 -s 3 python benchmarks/failover/worker.py
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np

import kvstore
from kvstore import optimizer as opt


def server_pid(rank: int) -> int:
    """The pid of this job's server ``rank`` (same scheduler port), from /proc."""
    port = os.environ["KVSTORE_SCHEDULER_PORT"].encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        except OSError:
            continue
        if env.get(b"KVSTORE_ROLE") == b"server" and env.get(b"KVSTORE_RANK") == str(rank).encode() \
                and env.get(b"KVSTORE_SCHEDULER_PORT") == port:
            return int(pid)
    raise RuntimeError(f"server {rank} not found")


def main() -> None:
    steps, keys, size = int(os.environ["STEPS"]), int(os.environ["KEYS"]), int(os.environ["SIZE"])
    kill = os.environ.get("KILL")
    victim, at = (int(x) for x in kill.split(":")) if kill else (-1, -1)
    kv = kvstore.create("dist_sync")
    from kvstore.worker.dist import DistStore   # imported by create already
    assert isinstance(kv, DistStore)            # what dist_sync builds
    names = [f"k{i}" for i in range(keys)]
    kv.init(names, [np.zeros(size, np.float32) for _ in names])
    kv.set_optimizer(opt.SGD(learning_rate=0.01, momentum=0.9))
    grads = [np.full(size, kv.rank + 1, np.float32) for _ in names]
    outs = [np.empty(size, np.float32) for _ in names]
    for step in range(steps):
        if step == at and kv.rank == 0:
            os.kill(server_pid(victim), getattr(signal, os.environ.get("KILL_SIGNAL", "SIGKILL")))
            print(f"kill {time.time():.6f}", flush=True)
        kv.pushpull(names, grads, out=outs)
        print(f"step {step} {time.time():.6f}", flush=True)
    kv.close()


if __name__ == "__main__":
    main()
