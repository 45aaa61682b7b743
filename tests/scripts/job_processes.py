"""The processes of the job a script runs in, found in /proc (for the scripts of
tests/scripts/ that kill a server, or the scheduler, of their own job at a chosen step)."""

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


def _environ(pid: str) -> dict:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)


def scheduler_pid() -> int:
    """The pid of this job's scheduler: the live child of this process's launcher (its
    parent) with KVSTORE_ROLE=scheduler (after a restart, the new one)."""
    launcher = os.getppid()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[1]) == launcher and _environ(pid).get(b"KVSTORE_ROLE") == b"scheduler":
                return int(pid)
        except (OSError, IndexError, ValueError):
            continue
    raise RuntimeError(f"no scheduler below the launcher (pid {launcher})")
