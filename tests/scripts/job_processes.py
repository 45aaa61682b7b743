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


def scheduler_pid() -> int:
    """The pid of the process listening on this job's scheduler port
    (KVSTORE_SCHEDULER_PORT; after a restart, the new scheduler), from
    /proc/net/tcp and the processes' socket descriptors: found wherever its
    launcher started it (tracker.local, tracker.ssh) on this machine."""
    port = int(os.environ["KVSTORE_SCHEDULER_PORT"])
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except OSError:
            continue
        inodes |= {row[9] for row in rows if int(row[1].rsplit(":", 1)[1], 16) == port and row[3] == "0A"}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                return int(pid)
    raise RuntimeError(f"no process listens on the scheduler's port {port}")
