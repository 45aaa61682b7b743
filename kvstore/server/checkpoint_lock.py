"""One live job per checkpoint directory: the lock each server holds on its rank's
files there while it lives.

Two jobs that share ``KVSTORE_CHECKPOINT_DIR`` would both write
``server-R.ckpt`` (the ids even agree: each continues from the ids on disk), and a
resume could then combine their files. So a server with a checkpoint directory
takes an exclusive ``flock`` on ``<dir>/server-<rank>.lock`` once it knows its
rank, and keeps it until it ends. The file names the holder (job id, server rank,
host, pid, since when) as one JSON line, so that a server of a second job, which
finds the lock taken, fails the job at start naming the first.

Why ``flock``: the kernel drops it when its process dies, however it dies (a
resume after a SIGKILL finds the directory free), and it belongs to one open
file, so two servers in one process (the in-process test clusters) exclude each
other too, unlike POSIX record locks. On NFS, Linux emulates it with a byte-range
lock that other hosts see.

A holder deletes its lock file before it lets go, so a job that ended leaves
only its checkpoint files; a server that locked a file that was deleted meanwhile
(its holder ended between our open and our lock) opens the new one and locks
again.

Example::

    lock = DirLock("/ckpt", rank=0)
    lock.acquire({"job": "6f1c0a9e", "server": 0, "host": "h", "pid": 7}, wait=10.0)
    ...                      # CheckpointError above when another live job holds it
    lock.release()
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time

from ..errors import CheckpointError

POLL = 0.05          # seconds between two tries while the holder may be ending
MAX_HOLDER_BYTES = 4096


def lock_path(directory: str, rank: int) -> str:
    """Server ``rank``'s lock file in ``directory``."""
    return os.path.join(directory, f"server-{rank}.lock")


class DirLock:
    """Server ``rank``'s hold on its checkpoint files in ``directory``."""

    def __init__(self, directory: str, rank: int):
        self.directory, self.rank = directory, rank
        self.path = lock_path(directory, rank)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, holder: dict, wait: float, stop: threading.Event | None = None) -> None:
        """Take the lock and write ``holder`` (a JSON-able map naming this process)
        into its file. While another process holds it, try again for up to ``wait``
        seconds (a job that just ended lets go within moments) or until ``stop`` is
        set; then CheckpointError naming the holder. CheckpointError too when the
        directory or the file cannot be opened."""
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"cannot create the checkpoint directory {self.directory}: {e}") from e
        deadline = time.monotonic() + wait
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() >= deadline or (stop is not None and stop.is_set()):
                    raise CheckpointError(self._refusal(wait)) from None
                if stop is not None:
                    stop.wait(POLL)
                else:
                    time.sleep(POLL)
                continue
            except OSError as e:
                os.close(fd)
                raise CheckpointError(f"cannot lock {self.path}: {e}") from e
            if self._still_at_path(fd):
                self._fd = fd
                break
            os.close(fd)       # its holder deleted it as it let go: lock the new one
        self.describe(holder)

    def describe(self, holder: dict) -> None:
        """Rewrite the holder this file names (e.g. the job id a resume adopted)."""
        assert self._fd is not None, "describe() needs the lock"
        line = (json.dumps(holder, sort_keys=True) + "\n").encode()
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, line, 0)
        except OSError:          # only a description: the lock holds without it
            pass

    def release(self) -> None:
        """Delete the file and let go (idempotent)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if self._still_at_path(fd):
                os.unlink(self.path)
        except OSError:
            pass
        finally:
            os.close(fd)       # closing the last descriptor drops the flock

    def holder(self) -> dict | None:
        """What the lock file names (None when it names nothing readable)."""
        try:     # never through a link, never blocking on a FIFO in its place
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                data = os.read(fd, MAX_HOLDER_BYTES)
            finally:
                os.close(fd)
            named = json.loads(data.decode("utf-8", "replace") or "null")
        except (OSError, ValueError, RecursionError):     # RecursionError: "[[[[..." nested too deep
            return None
        return named if isinstance(named, dict) else None

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as e:   # a link where the file should be, permissions
            raise CheckpointError(f"cannot open the checkpoint lock {self.path}: {e}") from e

    def _still_at_path(self, fd: int) -> bool:
        mine = os.fstat(fd)
        with contextlib.suppress(OSError):
            there = os.stat(self.path, follow_symlinks=False)
            return (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino)
        return False

    def _refusal(self, waited: float) -> str:
        named = self.holder()
        if named is None:
            who = "another process (its lock file names no holder yet)"
        else:
            def field(name):
                value = named.get(name)
                return "?" if value is None else str(value)[:100]
            who = (f"job {field('job')} (server {field('server')}, pid {field('pid')} on "
                   f"{field('host')}, since {field('since')})")
        return (f"the checkpoint directory {self.directory} is in use by {who}: it holds {self.path}. "
                "Two live jobs cannot share a checkpoint directory (their checkpoints would mix): give "
                "this job its own KVSTORE_CHECKPOINT_DIR, or end that job first "
                f"(waited {waited:g}s for it to let go, KVSTORE_HEARTBEAT_TIMEOUT)")
