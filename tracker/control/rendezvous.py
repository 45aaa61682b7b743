"""The scheduler: the socket loop around :class:`~.scheduler_state.SchedulerState`.

One :class:`Scheduler` serves one job. It runs a ZeroMQ ROUTER socket in its own
thread; nodes talk to it through :class:`tracker.control.membership.Membership`.
Everything the scheduler decides (ranks, address book, barriers, liveness,
abort) is in the pure state machine; this loop only receives frames, hands them
and the launcher's events in with the time, and sends what comes back.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import zmq

from . import env, wire
from .scheduler_state import SchedulerState
from .security import Authenticator, Security

log = logging.getLogger(__name__)

TICK = 0.05  # seconds between checks of deadlines and launcher events
DEFAULT_HOST = "127.0.0.1"   # where a scheduler binds unless told: this machine only


class Scheduler:
    """Rendezvous point of one job.

    Example::

        sched = Scheduler(num_workers=2, num_servers=1).start()
        ... start processes with KVSTORE_SCHEDULER_PORT=sched.port ...
        ok = sched.wait(timeout=600)   # True: every node finished; else see sched.failure
        sched.close()
    """

    def __init__(self, num_workers: int, num_servers: int, *, host: str = DEFAULT_HOST,
                 port: int = 0, timeout: float = env.default("KVSTORE_TIMEOUT"),
                 heartbeat_interval: float = env.default("KVSTORE_HEARTBEAT_INTERVAL"),
                 heartbeat_timeout: float = env.default("KVSTORE_HEARTBEAT_TIMEOUT"),
                 security: Security = Security(), elastic: tuple[int, int] | None = None,
                 replicas: int = env.default("KVSTORE_REPLICAS"), job: str | None = None,
                 restarted: bool = False,
                 restart_timeout: float = env.default("KVSTORE_SCHEDULER_RESTART_TIMEOUT"),
                 restartable: bool = False):
        self.num_workers = num_workers
        self.num_servers = num_servers
        self.host = host
        self.elastic = elastic
        # the registration deadline counts from here (raises ValueError for an empty job,
        # or for num_workers outside elastic's MIN:MAX)
        self._state = SchedulerState(num_workers, num_servers, now=time.monotonic(), timeout=timeout,
                                     heartbeat_interval=heartbeat_interval,
                                     heartbeat_timeout=heartbeat_timeout, elastic=elastic,
                                     replicas=replicas, job=job, restarted=restarted,
                                     restart_timeout=restart_timeout, restartable=restartable)
        self._crash: str | None = None
        self._requested_port = port
        self._port: int | None = None   # start() binds it
        self._events: queue.Queue = queue.Queue()
        self._pinged = 0
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._security = security
        self._auth: Authenticator | None = None

    @classmethod
    def for_job(cls, settings: env.Settings, num_workers: int, num_servers: int, **kwargs) -> "Scheduler":
        """A scheduler with the timeout, heartbeat, elastic, replica and restart settings of
        ``settings`` (:class:`tracker.control.env.Settings`); ``kwargs``: host, port, security,
        job, restarted, restartable (a launcher restarts it if it dies)."""
        return cls(num_workers, num_servers, timeout=settings.timeout,
                   heartbeat_interval=settings.heartbeat_interval,
                   heartbeat_timeout=settings.heartbeat_timeout, elastic=settings.elastic,
                   replicas=settings.replicas, restart_timeout=settings.scheduler_restart_timeout, **kwargs)

    # -- public, thread-safe -------------------------------------------------
    @property
    def port(self) -> int:
        """The port it listens on (once started)."""
        assert self._port is not None, "the scheduler has not started"
        return self._port

    @property
    def _socket(self) -> zmq.Socket:
        """Its ROUTER socket, which :meth:`start` makes before the loop runs."""
        assert self._sock is not None, "the scheduler has not started"
        return self._sock

    @property
    def failure(self) -> str | None:
        """Why the job was aborted (names the culprit), or None."""
        return self._state.failure or self._crash

    def start(self) -> "Scheduler":
        self._auth = self._security.authenticator(self._ctx, "scheduler")
        self._sock = sock = self._ctx.socket(zmq.ROUTER)
        self._security.serve(sock)
        if self._auth is not None:
            self._auth.watch(sock)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_BYTES)
        if self._requested_port:
            sock.bind(f"tcp://{self.host}:{self._requested_port}")
            self._port = self._requested_port
        else:
            self._port = sock.bind_to_random_port(f"tcp://{self.host}")
        self._thread = threading.Thread(target=self._run, name="kvstore-scheduler", daemon=True)
        self._thread.start()
        log.info("scheduler listening on %s:%d for %d worker%s and %d server%s%s",
                 self.host, self.port, self.num_workers, "" if self.num_workers == 1 else "s",
                 self.num_servers, "" if self.num_servers == 1 else "s",
                 f" (elastic: {self.elastic[0]} to {self.elastic[1]} workers)" if self.elastic else "")
        return self

    def node_exited(self, role: str, rank: int, returncode: int) -> None:
        """A launcher reports that the process of ``role`` ``rank`` ended."""
        self._events.put(("exited", role, rank, returncode))

    def abort(self, reason: str) -> None:
        """Abort the job: every node is told ``reason``."""
        self._events.put(("abort", reason))

    def ping(self, number: int) -> None:
        """A launcher's liveness probe: :attr:`pinged` becomes ``number`` once the
        serving loop handled it (a loop that hangs never answers)."""
        self._events.put(("ping", number))

    @property
    def pinged(self) -> int:
        """The last :meth:`ping` the serving loop handled (0: none)."""
        return self._pinged

    @property
    def failed_over(self) -> frozenset[int]:
        """Replicated servers: the ranks of the servers whose chunks their backups serve
        now (dead, or silent: a launcher ends those still running)."""
        book = self._state.servers_book
        return frozenset(book.dead) if book is not None else frozenset()

    @property
    def start_again(self) -> dict[int, int]:
        """Replicated servers a launcher runs: server rank -> how many times the
        scheduler asked for that server to be started again in place (it died or hung
        before the job formed: tracker.control.start_again)."""
        return self._state.start_again

    @property
    def exits_heard(self) -> int:
        """How many of a launcher's ``node_exited`` reports the scheduler has handled."""
        return self._state.exits_heard

    @property
    def closed_workers(self) -> frozenset[int]:
        """The ranks of the workers that called close() (said ``finish``)."""
        return self._state.closed_workers

    @property
    def failed_after(self) -> int | None:
        """How many of the launcher's exits the scheduler had heard when the job
        failed (None: it has not failed)."""
        return self._state.failed_after

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the job finished or failed. True when every node finished."""
        self._done.wait(timeout)
        return self._done.is_set() and self.failure is None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._events.put(("stop",))
            self._thread.join(5)
        if self._auth is not None:
            self._auth.stop()
        if self._sock is not None:
            self._sock.close(linger=0)
        self._ctx.term()

    # -- the loop (scheduler thread only) -----------------------------------
    def _run(self) -> None:
        state = self._state
        sock = self._socket
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while True:
                if dict(poller.poll(int(TICK * 1000))):
                    while True:
                        try:
                            ident, frame = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        except ValueError:  # a message with other than two frames
                            continue
                        self._send(state.receive(ident, frame, time.monotonic()))
                if self._drain_events(state):
                    break
                self._send(state.tick(time.monotonic()))
                if state.over:
                    break
        except Exception:  # report, don't die silently: the job must not hang
            log.exception("scheduler crashed")
            self._crash = "the scheduler crashed (see its log)"
        finally:
            self._done.set()

    def _drain_events(self, state: SchedulerState) -> bool:
        """Hand the launcher's events to the state; True on ``stop`` (close())."""
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return False
            if event[0] == "stop":
                return True
            if event[0] == "abort":
                self._send(state.abort(event[1], time.monotonic()))
            elif event[0] == "exited":
                _, role, rank, code = event
                self._send(state.node_exited(role, rank, code, now=time.monotonic()))
            elif event[0] == "ping":
                self._pinged = event[1]

    def _send(self, sends) -> None:
        for send in sends:
            try:
                self._socket.send_multipart([send.ident, wire.encode(send.op, **send.fields)], zmq.NOBLOCK)
            except zmq.Again:
                log.warning("dropped %s to an unresponsive node", send.op)
