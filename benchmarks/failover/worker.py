"""The worker of benchmarks.failover: STEPS dist_sync pushpulls of KEYS fp32 keys of
SIZE values (cut over every server), SGD with momentum on the servers; worker 0
prints one line per completed step with its wall-clock time (``step I T``) and, at
the end, a digest of the final weights (``digest HEX``) and its CPU seconds
(``cpu S``, the whole process) (the others print nothing:
a job without a launcher, benchmarks/failover/link.py, has one log for all). With KILL=R:S, worker 0 sends
server R SIGKILL (KILL_SIGNAL: another signal) KILL_DELAY seconds (default 0) after
the start of step S, from a thread, so that the signal falls anywhere in the
step's exchange; it prints ``kill T`` and goes on.

    python -m tracker.local -n 2 -s 3 python benchmarks/failover/worker.py
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
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
    base = np.sin(np.arange(size, dtype=np.float32) * 0.01 * (kv.rank + 1)).astype(np.float32)
    outs = [np.empty(size, np.float32) for _ in names]
    pid = server_pid(victim) if kv.rank == 0 and victim >= 0 else None
    sig = getattr(signal, os.environ.get("KILL_SIGNAL", "SIGKILL"))

    def signal_victim() -> None:
        assert pid is not None
        os.kill(pid, sig)
        print(f"kill {time.time():.6f}", flush=True)
    for step in range(steps):
        if step == at and pid is not None:
            threading.Timer(float(os.environ.get("KILL_DELAY", "0")), signal_victim).start()
        kv.pushpull(names, [base * (k + 1) + step for k in range(keys)], out=outs)
        if kv.rank == 0:
            print(f"step {step} {time.time():.6f}", flush=True)
    kv.pull(names, out=outs)
    if kv.rank == 0:
        print("digest", hashlib.sha256(b"".join(o.tobytes() for o in outs)).hexdigest(), flush=True)
        print(f"cpu {time.process_time():.3f}", flush=True)
    kv.close()


if __name__ == "__main__":
    main()
