"""Child processes: spawn argv lists (never shell strings), prefix their output
per rank, and tear them down gracefully, then by force, with every process they
started: in their sessions, below them, or orphaned and re-parented to the
launcher (:class:`Strays`)."""

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
from typing import IO, Callable, Iterable

# shared with the node wrapper, which runs alone on remote hosts (stdlib only)
from .wrapper import Exceptions, descendants, processes, session_members, subreaper

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
    restart: int = 0     # > 0: the n-th process in place of this role and rank: of a worker that left an
    #                      elastic job, or a server started again before a replicated job formed
    replaces: int | None = None   # a replacement server (--restart-servers): the rank of the dead one

    @property
    def label(self) -> str:
        return f"{self.role} {self.rank}" + (f" #{self.restart}" if self.restart else "")


class Child:
    """A started process in its own session (so teardown reaches its children too).

    The session outlives its leader while a grandchild is in it: :meth:`running`
    is true and :meth:`signal` reaches it until every member has ended.
    :attr:`exception`: the last line of the last Python traceback in its output
    (``kvstore.errors.ConfigError: unknown store type ...``), or None."""

    _out_lock = threading.Lock()

    def __init__(self, spec: ProcSpec, out: IO[str] | None = None):
        self.spec = spec
        self._out = out if out is not None else sys.stdout
        self._exceptions = Exceptions()
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

    @property
    def exception(self) -> str | None:
        return self._exceptions.last

    def running(self) -> bool:
        """True while the process or anything left in its session is alive."""
        return self.popen.poll() is None or bool(session_members(self.popen.pid))

    def _copy_output(self) -> None:
        prefix = f"[{self.spec.role}:{self.spec.rank}] "
        # keep reading to the end even when our output is gone (``| head``):
        # a child blocked on a full pipe would hang the job
        stdout = self.popen.stdout
        assert stdout is not None   # a pipe (stdout=PIPE)
        for raw in iter(stdout.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            self._exceptions.feed(line)
            with self._out_lock:
                write_out(self._out, prefix + line + "\n")
        stdout.close()

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child's session: its process group (which may
        outlive the child) and any member that moved to another group; while the
        child runs, also to every process below it (one may have left the
        session: setsid()). Once it ended, such orphans are :class:`Strays`."""
        signal_session(self.popen.pid, sig)
        if self.popen.poll() is None:   # not reaped: its pid still names it
            for pid in descendants(self.popen.pid):
                _kill(pid, sig)

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


def signal_session(sid: int, sig: int) -> None:
    """``sig`` to process group ``sid`` and to every member of session ``sid``
    (without /proc: the process group only)."""
    try:
        os.killpg(sid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in session_members(sid):
        _kill(pid, sig)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Strays:
    """The processes below this one that no started child accounts for: orphans
    re-parented to this process, a child subreaper from :meth:`__init__` to
    :meth:`close` (a grandchild that called setsid() and outlived its worker; a
    process a killed mpirun left), and everything below them. For
    :func:`terminate_all` it is one more child: :meth:`signal` reaches them all,
    :meth:`running` is true while one lives.

    ``owned()``: the pids of the children the launcher started (each tears its
    own tree down). The children this process had before are never touched; a
    process started by other means while the job runs counts as a stray. Without
    prctl or /proc (not Linux) there are none: teardown reaches the children's
    sessions and process groups only.

    Example::

        strays = Strays(lambda: [c.popen.pid for c in children])
        ...   # start and run the children
        terminate_all(children + [strays], grace=3.0)
        strays.close()
    """

    def __init__(self, owned: Callable[[], Iterable[int]]):
        self._owned = owned
        self._pid = os.getpid()
        self._before = {pid for pid, _, ppid, _ in processes() if ppid == self._pid}
        self._was = subreaper(True)

    def pids(self) -> list[int]:
        """The live strays, the orphans first, then what is below them."""
        table = {pid: ppid for pid, state, ppid, _ in processes() if state != "Z"}
        skip = self._before | set(self._owned())
        tops = [pid for pid, ppid in table.items() if ppid == self._pid and pid not in skip]
        return tops + [pid for top in tops for pid in descendants(top, table)]

    def running(self) -> bool:
        self.reap()
        return bool(self.pids())

    def signal(self, sig: int) -> None:
        for pid in self.pids():
            _kill(pid, sig)

    def reap(self) -> None:
        """Collect the exit status of strays that ended: they are this process's
        children now, zombies until then. Only those: waiting for any child would
        take the status of a child a Popen waits for."""
        skip = self._before | set(self._owned())
        for pid, state, ppid, _ in processes():
            if state == "Z" and ppid == self._pid and pid not in skip:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass

    def finish_output(self) -> None:
        self.reap()

    def close(self) -> None:
        """Reap what ended and stop being a subreaper (unless this process was one before)."""
        self.reap()
        if self._was is False:
            subreaper(False)


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
