"""The processes of the job a script runs in, found in /proc (for the scripts of
tests/scripts/ that kill a server of their own job at a chosen step)."""

import os


def server_pid(rank: int) -> int:
    """The pid of this job's server `rank` (same scheduler port), from /proc."""
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
