"""Child processes: spawn argv lists (never shell strings), prefix their output
per rank, and tear them down gracefully, then by force."""

from __future__ import annotations

import io
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Callable

log = logging.getLogger(__name__)

TICK = 0.05


@dataclass(frozen=True)
class ProcSpec:
    """One process to start: its role and rank, argv and extra environment."""
    role: str
    rank: int
    argv: tuple[str, ...]
    env: dict = field(default_factory=dict)
    cwd: str | None = None
    restart: int = 0     # > 0: the n-th replacement of a worker that left an elastic job

    @property
    def label(self) -> str:
        return f"{self.role} {self.rank}" + (f" #{self.restart}" if self.restart else "")


class Child:
    """A started process in its own session (so teardown reaches its children too).

    The session outlives its leader while a grandchild is in it: :meth:`running`
    is true and :meth:`signal` reaches it until every member has ended."""

    _out_lock = threading.Lock()

    def __init__(self, spec: ProcSpec, out: IO[str] | None = None):
        self.spec = spec
        self._out = out if out is not None else sys.stdout
        self.popen = subprocess.Popen(
            list(spec.argv), env={**os.environ, **spec.env}, cwd=spec.cwd,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True)
        self._pump = threading.Thread(target=self._copy_output, daemon=True,
                                      name=f"output-{spec.role}-{spec.rank}")
        self._pump.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def running(self) -> bool:
        """True while the process or anything left in its session is alive."""
        return self.popen.poll() is None or bool(session_members(self.popen.pid))

    def _copy_output(self) -> None:
        prefix = f"[{self.spec.role}:{self.spec.rank}] "
        # keep reading to the end even when our output is gone (``| head``):
        # a child blocked on a full pipe would hang the job
        for raw in iter(self.popen.stdout.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            with self._out_lock:
                write_out(self._out, prefix + line + "\n")
        self.popen.stdout.close()

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child's session: its process group (which may
        outlive the child) and any member that moved to another group."""
        signal_session(self.popen.pid, sig)

    def finish_output(self, timeout: float = 2.0) -> None:
        self._pump.join(timeout)


def write_out(out: IO[str], text: str) -> bool:
    """Write and flush ``text``. When the reader is gone (``... | head -1``, a
    closed terminal), the output is dropped from then on: the stream's file
    descriptor is pointed at /dev/null, so neither the copying threads nor the
    interpreter's final flush fail (which would change the exit status).
    Returns False when ``text`` was dropped."""
    try:
        out.write(text)
        out.flush()
        return True
    except (OSError, ValueError):
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, out.fileno())
            finally:
                os.close(devnull)
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
            pass
        return False


def session_members(sid: int) -> list[int]:
    """Live (not zombie) processes whose session id is ``sid`` (Linux /proc;
    elsewhere an empty list: teardown then reaches the process group only).
    A session id is not reused while the session has members."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # fields: state ppid pgrp session ...
        if len(fields) > 3 and fields[0] != b"Z" and int(fields[3]) == sid:
            found.append(int(entry))
    return found


def signal_session(sid: int, sig: int) -> None:
    """``sig`` to process group ``sid`` and to every member of session ``sid``."""
    try:
        os.killpg(sid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in session_members(sid):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def needs_stopping(child) -> bool:
    """True while anything of a child-like object runs: its ``running()`` where it
    has one, else while ``poll()`` is None."""
    running = getattr(child, "running", None)
    return running() if running is not None else child.poll() is None


def terminate_all(children: list, grace: float, escalate: Callable[[], bool] | None = None) -> bool:
    """SIGTERM every child (its whole session), wait up to ``grace`` seconds for
    them to end, then SIGKILL whatever remains (grandchildren included) and wait
    for that too. ``escalate()`` becoming true (a second Ctrl-C) ends the grace
    period at once. Returns True if it was cut short that way."""
    escalate = escalate or (lambda: False)
    for child in children:
        child.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while (not escalate() and time.monotonic() < deadline
           and any(needs_stopping(c) for c in children)):
        time.sleep(TICK)  # a poll interval, not synchronisation
    escalated = escalate()
    if escalated:
        log.warning("a signal during the teardown: killing every process now (SIGKILL)")
    # members may fork while being killed: a short second and third round then
    for wait in (max(grace, 2.0), 0.5, 0.5):
        for child in children:
            # only what still runs (a group may outlive its leader: a grandchild); a
            # command that already reported every process's end (srun, mpirun) is left
            # to finish by itself: killing it could leave its allocation behind
            if needs_stopping(child):
                child.signal(signal.SIGKILL)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(needs_stopping(c) for c in children):
            time.sleep(TICK)
        if not any(needs_stopping(c) for c in children):
            break
    for child in children:
        child.finish_output()
    return escalated
