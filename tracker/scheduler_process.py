"""The launcher's scheduler: a child process (``python -m tracker.scheduler
--launcher``) that is restarted when it dies.

:class:`SchedulerProcess` is what :func:`tracker.launcher.launch` holds of the
job's scheduler. It starts the scheduler where the launcher runs, on the
launcher's address, with the job's settings and secret in its environment (never
on a command line), and talks to it over its stdin and stdout (JSON lines:
:mod:`tracker.scheduler`). When the process dies before the job ended (killed,
crashed), it is started again on the same address and port with the same secret
and job id, told that it was restarted, and handed every exit the launcher had
reported: it rebuilds the job from its members, which register again
(:mod:`tracker.control.recovery`, docs/architecture.md §8.2). Up to
``MAX_RESTARTS`` restarts within any ``RESTART_WINDOW`` seconds: a crash loop ends
the job, while a week-long job may lose its scheduler any number of times, only
not that often (systemd's start limit counts the same way); a scheduler that
cannot be started again ends the job,
naming it. A scheduler that hangs (stopped, a deadlock) is killed (SIGKILL) and so
restarted: every KVSTORE_HEARTBEAT_INTERVAL it is pinged through its serving
loop, and one that answered none for KVSTORE_HEARTBEAT_TIMEOUT is taken for
hung, in time for the nodes, which wait KVSTORE_SCHEDULER_RESTART_TIMEOUT more
for a restart (with that 0 nothing waits, and a hung one is left to the nodes).

Example::

    scheduler = SchedulerProcess(settings, 2, 1, host="127.0.0.1", secret=secret).start()
    ... start the processes with KVSTORE_SCHEDULER_PORT=scheduler.port ...
    scheduler.node_exited("worker", 0, 0)      # what the launcher saw: the exit's number (1, 2, ...)
    scheduler.failure, scheduler.failed_over, scheduler.start_again, scheduler.done
    scheduler.heard           # (exits handled, workers that called close(), exits before the failure)
    scheduler.wait_heard(3, 2.0)    # until it handled exit 3 (and told the failure, if one came first)
    scheduler.close()
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Mapping, NamedTuple

from .control.env import Settings
from .control.records import describe_exit
from .scheduler import LAUNCHER_FLAG

log = logging.getLogger(__name__)

MAX_RESTARTS = 10      # restarts of one job's scheduler within RESTART_WINDOW before its death ends the job
RESTART_WINDOW = 600.0  # seconds: restarts longer ago than this no longer count
STOP_GRACE = 5.0       # seconds the scheduler gets to end after ``stop``, before SIGKILL
START_TIMEOUT = 60.0   # seconds a scheduler process gets to listen (a Python start, a bind)


class Heard(NamedTuple):
    """What the scheduler said of the exits the launcher told it: it handled the first
    ``exits``; the workers of ``closed`` had called close() by then; the job had failed
    after it had heard ``failed_after`` exits (None: it has not failed), so that an exit
    numbered above that is a consequence of the failure, not its cause."""
    exits: int
    closed: frozenset
    failed_after: int | None


class SchedulerProcess:
    """The scheduler of one job as a child of this process, restarted when it dies
    (the same interface as :class:`tracker.control.rendezvous.Scheduler` offers a
    launcher: ``port``, ``node_exited``, ``abort``, ``failure``, ``failed_over``,
    ``start_again``, ``done``, ``close``). ``host``: the address it binds; ``secret``: the job's."""

    def __init__(self, settings: Settings, num_workers: int, num_servers: int, *, host: str,
                 secret: str, environ: Mapping[str, str] = os.environ):
        self.host = host
        self.job = secrets.token_hex(8)   # the job's id (servers' checkpoint files), kept across restarts
        self.restarts = 0
        self._restarted_at: list[float] = []   # when each restart within RESTART_WINDOW happened
        self.pids: list[int] = []       # of every scheduler process started (the launcher's own children)
        elastic = settings.elastic
        self._env = {**environ, "KVSTORE_ROLE": "scheduler", "DMLC_ROLE": "scheduler",
                     "KVSTORE_SCHEDULER_HOST": host, "DMLC_PS_ROOT_URI": host,
                     "KVSTORE_SCHEDULER_PORT": "", "DMLC_PS_ROOT_PORT": "",
                     "KVSTORE_NUM_WORKERS": str(num_workers), "DMLC_NUM_WORKER": str(num_workers),
                     "KVSTORE_NUM_SERVERS": str(num_servers), "DMLC_NUM_SERVER": str(num_servers),
                     "KVSTORE_TIMEOUT": repr(settings.timeout),
                     "KVSTORE_HEARTBEAT_INTERVAL": repr(settings.heartbeat_interval),
                     "KVSTORE_HEARTBEAT_TIMEOUT": repr(settings.heartbeat_timeout),
                     "KVSTORE_SCHEDULER_RESTART_TIMEOUT": repr(settings.scheduler_restart_timeout),
                     "KVSTORE_ELASTIC": f"{elastic[0]}:{elastic[1]}" if elastic else "",
                     "KVSTORE_REPLICAS": str(settings.replicas), "KVSTORE_SECURE": "1" if settings.secure else "0",
                     "KVSTORE_SECRET": secret, "KVSTORE_SECRET_FILE": ""}
        self._lock = threading.Lock()     # the child's stdin, the history, a restart
        self._history: list[dict] = []    # every event told, in order: a restarted scheduler gets them all
        self._popen: subprocess.Popen | None = None
        self._port = 0
        self._failure: str | None = None
        self._failed_over: frozenset[int] = frozenset()
        self._start_again: dict[int, int] = {}
        self._exits_told = 0
        # from one report; the closed ranks are kept across restarts (once closed, always)
        self._heard = Heard(0, frozenset(), None)
        self._heard_changed = threading.Condition()
        self._done = threading.Event()
        self._closing = False
        # the watch for a hung scheduler: pings sent, when the last answer (or start) came
        self._ping_every, self._hung_after = settings.heartbeat_interval, settings.heartbeat_timeout
        self._watch = settings.scheduler_restart_timeout > 0    # 0: no node waits for a restart
        self._pings = 0
        self._answered_at = 0.0

    # -- what a launcher asks ------------------------------------------------------------
    @property
    def port(self) -> int:
        """The port it listens on (the same after every restart)."""
        assert self._port, "the scheduler has not started"
        return self._port

    @property
    def failure(self) -> str | None:
        """Why the job was aborted (names the culprit), or None."""
        return self._failure

    @property
    def failed_over(self) -> frozenset[int]:
        """Replicated servers: the ranks of the servers whose chunks their backups serve now."""
        return self._failed_over

    @property
    def start_again(self) -> dict[int, int]:
        """Replicated servers: server rank -> how many times the scheduler asked for that
        server to be started again in place (lost before the job formed)."""
        return self._start_again

    @property
    def done(self) -> bool:
        """The job ended (every node finished, or it was aborted)."""
        return self._done.is_set()

    @property
    def heard(self) -> Heard:
        """What the scheduler said of the exits :meth:`node_exited` told it (a restarted
        one hears them all again): :class:`Heard`."""
        return self._heard

    def wait_heard(self, told: int, timeout: float) -> bool:
        """Wait until the scheduler handled exit number ``told`` (and, if the job had
        failed before it, said why: :attr:`failure`), the job ended, or ``timeout``
        seconds passed; whether it did."""
        def said() -> bool:
            heard = self._heard
            return self._done.is_set() or (heard.exits >= told and (heard.failed_after is None
                                                                   or self._failure is not None))
        with self._heard_changed:
            return self._heard_changed.wait_for(said, timeout)

    def start(self) -> "SchedulerProcess":
        """Start the scheduler; OSError if it cannot start (its log says why)."""
        with self._lock:
            self._spawn(restarted=False)
        if self._watch:
            threading.Thread(target=self._watch_for_a_hang, daemon=True,
                             name=f"kvstore-scheduler-watch-{self.job}").start()
        return self

    def node_exited(self, role: str, rank: int, returncode: int) -> int:
        """The launcher saw the process of ``role`` ``rank`` end with ``returncode``;
        returns the exit's number (1 for the first told), which :attr:`heard` counts."""
        with self._lock:
            self._exits_told += 1
            told = self._exits_told
        self._tell({"exited": [role, rank, returncode]})
        return told

    def abort(self, reason: str) -> None:
        """Abort the job: every node is told ``reason``."""
        self._tell({"abort": reason})

    def close(self) -> None:
        """Stop the scheduler (``stop``, then SIGKILL after STOP_GRACE seconds)."""
        with self._lock:
            self._closing = True
            popen = self._popen
            if popen is None:
                return
            self._write({"stop": True})
            try:
                assert popen.stdin is not None
                popen.stdin.close()
            except OSError:
                pass
        try:
            popen.send_signal(signal.SIGCONT)   # a stopped one (SIGSTOP) hears `stop` too
            popen.wait(STOP_GRACE)
        except subprocess.TimeoutExpired:
            log.warning("the scheduler (pid %d) did not stop within %gs: killing it", popen.pid, STOP_GRACE)
            popen.send_signal(signal.SIGKILL)
            popen.wait()

    # -- the child ------------------------------------------------------------------------
    def _tell(self, event: dict) -> None:
        with self._lock:
            self._history.append(event)
            self._write(event)

    def _write(self, event: dict) -> None:
        """One line to the scheduler (the lock held); lost if it died: a restart replays it."""
        popen = self._popen
        if popen is None or popen.stdin is None:
            return
        try:
            popen.stdin.write(json.dumps(event) + "\n")
            popen.stdin.flush()
        except (OSError, ValueError):   # a broken pipe, or closed: it died
            pass

    def _spawn(self, restarted: bool) -> None:
        """Start a scheduler process (the lock held), wait until it listens, replay the
        history to a restarted one. Raises OSError when it cannot start."""
        popen = subprocess.Popen([sys.executable, "-m", "tracker.scheduler", LAUNCHER_FLAG], env=self._env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 start_new_session=True)   # a terminal's Ctrl-C is the launcher's to handle
        self.pids.append(popen.pid)
        assert popen.stdin is not None and popen.stdout is not None
        try:
            popen.stdin.write(json.dumps({"job": self.job, "restarted": restarted, "port": self._port}) + "\n")
            popen.stdin.flush()
        except OSError:
            pass
        # a deadline on the first line (the buffer is empty: the pipe itself is polled)
        ready = select.select([popen.stdout], [], [], START_TIMEOUT)[0]
        first = popen.stdout.readline() if ready else ""
        try:
            port = json.loads(first)["port"] if first else None
        except (ValueError, KeyError, TypeError):
            port = None
        if type(port) is not int:
            popen.kill()
            code = popen.wait()
            raise OSError(f"the scheduler could not start on {self.host}:{self._port or 'a free port'} "
                          f"within {START_TIMEOUT:g}s ({describe_exit(code)}; its log above says why)")
        self._port, self._popen = port, popen
        self._answered_at = time.monotonic()
        for event in self._history if restarted else ():
            self._write(event)
        threading.Thread(target=self._read, args=(popen, popen.stdout), daemon=True,
                         name=f"kvstore-scheduler-{popen.pid}").start()

    def _read(self, popen: subprocess.Popen, out: IO[str]) -> None:
        """What the scheduler ``popen`` says, until it ends; restart it if it died."""
        for line in out:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if not isinstance(msg, dict):
                continue
            if isinstance(msg.get("failure"), str) and self._failure is None:
                self._failure = msg["failure"]
            if isinstance(msg.get("failed_over"), list):
                self._failed_over = frozenset(r for r in msg["failed_over"] if type(r) is int)
            if isinstance(msg.get("start_again"), list):
                self._start_again = {p[0]: p[1] for p in msg["start_again"]
                                     if isinstance(p, list) and len(p) == 2 and all(type(v) is int for v in p)}
            exits, closed, after = msg.get("exits"), msg.get("closed"), msg.get("failed_after")
            if type(exits) is int and isinstance(closed, list) and (after is None or type(after) is int) \
                    and popen is self._popen:
                self._heard = Heard(exits, self._heard.closed | {r for r in closed if type(r) is int}, after)
            if type(msg.get("pong")) is int and popen is self._popen:
                self._answered_at = time.monotonic()
            if msg.get("done") is True:
                self._done.set()
            self._tell_waiters()
        code = popen.wait()
        with self._lock:
            if self._done.is_set() or self._closing or popen is not self._popen:
                return
            why = f"the scheduler (pid {popen.pid}) {describe_exit(code)}"
            now = time.monotonic()
            self._restarted_at = [t for t in self._restarted_at if now - t < RESTART_WINDOW]
            if len(self._restarted_at) >= MAX_RESTARTS:
                self._end(f"{why}, after {MAX_RESTARTS} restart{'' if MAX_RESTARTS == 1 else 's'} within "
                          f"{RESTART_WINDOW:g}s: the job ends")
                return
            self._restarted_at.append(now)
            self.restarts += 1
            log.warning("%s: restarting it on %s:%d (restart %d); the job pauses at its next control-plane "
                        "call until every process registered again", why, self.host, self._port, self.restarts)
            try:
                self._spawn(restarted=True)
            except OSError as e:
                self._end(f"{why} and could not be restarted: {e}")

    def _watch_for_a_hang(self) -> None:
        """Ping the scheduler every heartbeat interval until the job ends; kill one that
        answered nothing for the heartbeat timeout (its reader then restarts it)."""
        killed = None
        while not self._done.wait(self._ping_every):
            with self._lock:
                if self._closing:
                    return
                popen, self._pings = self._popen, self._pings + 1
                self._write({"ping": self._pings})
                silent = time.monotonic() - self._answered_at
            if popen is None or popen is killed or silent <= self._hung_after or popen.poll() is not None:
                continue
            log.warning("the scheduler (pid %d) answered no ping for %.1fs (KVSTORE_HEARTBEAT_TIMEOUT): "
                        "stopped or stuck; killing it to start it again", popen.pid, silent)
            killed = popen
            popen.send_signal(signal.SIGKILL)

    def _end(self, failure: str) -> None:
        """The job ends for ``failure`` with no scheduler left to say so: waiters hear it now."""
        self._failure = failure
        self._done.set()
        self._tell_waiters()

    def _tell_waiters(self) -> None:
        """Wake :meth:`wait_heard`'s waiters to look again."""
        with self._heard_changed:
            self._heard_changed.notify_all()
