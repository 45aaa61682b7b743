"""The scheduler: registration, deterministic ranks, address book, barrier, liveness.

One :class:`Scheduler` serves one job. It runs a ZeroMQ ROUTER socket in its own
thread; nodes talk to it through :class:`tracker.control.membership.Membership`.

Life of a job::

    register (every node)  -> when W workers + S servers are in: reply ranks + address book
    barrier (workers)      -> when every worker arrived with the same token: release all;
                              a waiter's deadline passing fails it naming the absent workers
    heartbeat (every node) -> acknowledged; silence for heartbeat_timeout aborts the job
    finish (every node)    -> servers hear which workers finished; when all workers
                              finished, servers are told to shut down (and stay watched
                              until they finish); when everyone finished, the job succeeded

Any failure (a node silent too long, a launcher reporting a dead process, a
registration that cannot complete in time) aborts the job: every node is told
why, and :attr:`Scheduler.failure` names the culprit.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from dataclasses import dataclass, field

import zmq

from . import wire
from .errors import RendezvousError
from .security import Security

log = logging.getLogger(__name__)

TICK = 0.05  # seconds between checks of deadlines and launcher events
# seconds between a worker's `finish` and the servers failing the rounds it left
# waiting (uneven shards): time for its launcher to report a failing exit first
FINISH_GRACE = 1.0


@dataclass
class _Node:
    node_id: str
    role: str
    rank: int | None
    host: str
    addr: str
    pid: int
    ident: bytes
    last_seen: float
    hb_ident: bytes | None = None
    finished: bool = False
    finished_at: float | None = None   # when a worker said `finish` (monotonic)

    def name(self) -> str:
        rank = "?" if self.rank is None else self.rank
        return f"{self.role} {rank} (pid {self.pid} on {self.host})"


class _JobAborted(RendezvousError):
    """A request after the job was aborted: answered 'aborted', not a bad message."""


@dataclass
class _Barrier:
    waiting: dict = field(default_factory=dict)  # node_id -> (ident, req_id, token)
    deadlines: dict = field(default_factory=dict)  # node_id -> (monotonic deadline, its timeout)


def describe_exit(code: int) -> str:
    """'exited with status 1' / 'was killed by SIGKILL'."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class Scheduler:
    """Rendezvous point of one job.

    Example::

        sched = Scheduler(num_workers=2, num_servers=1).start()
        ... start processes with KVSTORE_SCHEDULER_PORT=sched.port ...
        ok = sched.wait(timeout=600)   # True: every node finished; else see sched.failure
        sched.close()
    """

    def __init__(self, num_workers: int, num_servers: int, *, host: str = "127.0.0.1",
                 port: int = 0, timeout: float = 300.0, heartbeat_interval: float = 1.0,
                 heartbeat_timeout: float = 10.0, security: Security = Security()):
        if num_workers < 1 or num_servers < 1:
            raise ValueError("a job needs at least one worker and one server")
        self.num_workers = num_workers
        self.num_servers = num_servers
        self.host = host
        self.timeout = timeout
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.failure: str | None = None
        self._requested_port = port
        self.port: int | None = None
        self._events: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._security = security
        self._auth = None

    # -- public, thread-safe -------------------------------------------------
    def start(self) -> "Scheduler":
        self._auth = self._security.authenticator(self._ctx, "scheduler")
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._security.serve(self._sock)
        if self._auth is not None:
            self._auth.watch(self._sock)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_BYTES)
        if self._requested_port:
            self._sock.bind(f"tcp://{self.host}:{self._requested_port}")
            self.port = self._requested_port
        else:
            self.port = self._sock.bind_to_random_port(f"tcp://{self.host}")
        self._thread = threading.Thread(target=self._run, name="kvstore-scheduler", daemon=True)
        self._thread.start()
        log.info("scheduler listening on %s:%d for %d worker%s and %d server%s",
                 self.host, self.port, self.num_workers, "" if self.num_workers == 1 else "s",
                 self.num_servers, "" if self.num_servers == 1 else "s")
        return self

    def node_exited(self, role: str, rank: int, returncode: int) -> None:
        """A launcher reports that the process of ``role`` ``rank`` ended."""
        self._events.put(("exited", role, rank, returncode))

    def abort(self, reason: str) -> None:
        """Abort the job: every node is told ``reason``."""
        self._events.put(("abort", reason))

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
        self._nodes: dict[str, _Node] = {}
        self._registered_at_start: list[tuple[bytes, str, object]] = []
        self._book: dict | None = None
        self._barrier = _Barrier()
        self._shutdown_sent = False
        self._told_finished: list[int] = []   # finished workers the servers were told of
        self._shutdown_at: float | None = None
        self._abort_until: float | None = None
        self._deadline = time.monotonic() + self.timeout
        self._hb_idents: dict[str, bytes] = {}
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while True:
                if dict(poller.poll(TICK * 1000)):
                    while True:
                        try:
                            ident, frame = self._sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        except ValueError:  # a message with other than two frames
                            continue
                        self._on_message(ident, frame)
                if self._drain_events() or self._check_time():
                    break
        except Exception:  # report, don't die silently: the job must not hang
            log.exception("scheduler crashed")
            self.failure = self.failure or "the scheduler crashed (see its log)"
        finally:
            self._done.set()

    def _drain_events(self) -> bool:
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return False
            if event[0] == "stop":
                return True
            if event[0] == "abort":
                self._abort(event[1])
            elif event[0] == "exited":
                self._on_exit(*event[1:])

    def _check_time(self) -> bool:
        now = time.monotonic()
        if self._abort_until is not None:
            return now >= self._abort_until or all(n.finished for n in self._nodes.values())
        if self._book is None and now > self._deadline:
            self._abort(f"registration did not complete within {self.timeout:g}s "
                        f"(KVSTORE_TIMEOUT): {self._missing()}")
            return False
        # servers stay watched after the shutdown until they finished: one that dies
        # before its `finish` must end the job (a standalone scheduler has nobody else
        # watching the processes)
        for node in self._nodes.values():
            if node.finished:
                continue
            silent = now - node.last_seen
            if silent > self.heartbeat_timeout:
                when = " after it was told to shut down" if (
                    self._shutdown_sent and node.role == "server") else ""
                self._abort(f"{node.name()} sent no heartbeat for {silent:.1f}s{when} "
                            f"(KVSTORE_HEARTBEAT_TIMEOUT={self.heartbeat_timeout:g}); "
                            "it is dead or stuck")
                return False
        if self._shutdown_at is not None and now > self._shutdown_at + self.timeout:
            late = [n.name() for n in self._nodes.values() if n.role == "server" and not n.finished]
            if late:
                self._abort(f"{', '.join(late)} did not finish within {self.timeout:g}s of the "
                            "shutdown (KVSTORE_TIMEOUT)")
                return False
        self._check_barrier_deadlines(now)
        if self._book is not None:
            self._tell_servers_workers_finished()     # once their grace has passed
        if self._book is not None and all(n.finished for n in self._nodes.values()):
            return True
        return False

    def _check_barrier_deadlines(self, now: float) -> None:
        """A waiter whose deadline passed: the barrier fails for every waiter, naming
        the workers that did not arrive (the waiters know only that they waited)."""
        deadlines = self._barrier.deadlines
        late = [nid for nid, (deadline, _) in deadlines.items() if now >= deadline]
        if not late:
            return
        waiting = self._barrier.waiting
        limit = deadlines[late[0]][1]
        waiters = sorted((self._nodes[nid] for nid in waiting), key=lambda n: n.rank)
        absent = sorted((n for n in self._nodes.values() if n.role == "worker" and n.node_id not in waiting),
                        key=lambda n: n.rank)
        token = waiting[late[0]][2]
        names = ", ".join(n.name() for n in absent) or "no worker"
        self._fail_barrier(
            f"a barrier ({token!r}) timed out after {limit:g}s: {names} did not arrive "
            f"(worker{'s' if len(waiters) > 1 else ''} {', '.join(str(n.rank) for n in waiters)} "
            "waited). A worker missing at a collective call failed before it or is stuck; "
            "raise KVSTORE_TIMEOUT if it is just slow", "timeout")

    def _missing(self) -> str:
        have = {(n.role, n.rank) for n in self._nodes.values()}
        counts = {"worker": self.num_workers, "server": self.num_servers}
        parts = []
        for role, total in counts.items():
            got = sum(1 for n in self._nodes.values() if n.role == role)
            missing = [str(r) for r in range(total) if (role, r) not in have]
            detail = f" (missing ranks {', '.join(missing)})" if got and 0 < len(missing) < total else ""
            parts.append(f"{got} of {total} {role}s registered{detail}")
        return "; ".join(parts)

    # -- messages -----------------------------------------------------------
    def _send(self, ident: bytes, op: str, **fields) -> None:
        try:
            self._sock.send_multipart([ident, wire.encode(op, **fields)], zmq.NOBLOCK)
        except zmq.Again:
            log.warning("dropped %s to an unresponsive node", op)

    def _on_message(self, ident: bytes, frame: bytes) -> None:
        try:
            msg = wire.decode(frame)
            op = msg["op"]
            handler = getattr(self, f"_op_{op}", None)
            if handler is None:
                raise RendezvousError(f"unknown control op {op!r}")
            handler(ident, msg)
        except _JobAborted as e:   # a node that has not heard of the abort yet
            log.debug("request after the abort: %s", e)
            self._send(ident, "error", id=_req_id(frame), kind="aborted", message=str(e))
        except (RendezvousError, KeyError, TypeError, ValueError) as e:
            log.warning("bad control message: %s", e)
            kind = "aborted" if self.failure is not None else "invalid"
            self._send(ident, "error", id=_req_id(frame), kind=kind, message=str(e))
        except Exception as e:  # an input we did not foresee must not kill the job's scheduler
            log.exception("scheduler failed on a control message")
            self._send(ident, "error", id=_req_id(frame), kind="invalid",
                       message=f"the scheduler could not handle this message: {type(e).__name__}")

    def _op_heartbeat(self, ident: bytes, msg: dict) -> None:
        node_id = msg["node"]
        if not isinstance(node_id, str):
            raise RendezvousError("heartbeat needs a string 'node'")
        self._hb_idents[node_id] = ident
        node = self._nodes.get(node_id)
        if node is not None:
            node.last_seen = time.monotonic()
            node.hb_ident = ident
        if self.failure is not None:
            self._send(ident, "abort", reason=self.failure)
        elif node is not None and node.role == "server" and self._shutdown_sent:
            self._send(ident, "shutdown")
        elif node is not None and node.role == "server" and self._book is not None:
            self._send(ident, "ack", workers_finished=self._finished_workers())
        else:
            self._send(ident, "ack")

    def _op_register(self, ident: bytes, msg: dict) -> None:
        if self.failure is not None:
            return self._send(ident, "error", id=msg.get("id"), kind="aborted", message=self.failure)
        role, rank = msg["role"], msg.get("rank")
        if role not in ("worker", "server"):
            raise RendezvousError(f"cannot register role {role!r}: must be worker or server")
        total = self.num_workers if role == "worker" else self.num_servers
        if rank is not None and not (isinstance(rank, int) and 0 <= rank < total):
            raise RendezvousError(f"{role} rank {rank!r} is out of range: this job has {total} {role}s")
        if self._book is not None:
            raise RendezvousError(f"the job already has all its nodes; {role} {rank} is one too many")
        same_role = [n for n in self._nodes.values() if n.role == role]
        if len(same_role) >= total:
            raise RendezvousError(f"too many {role}s: the job expects {total}")
        if same_role and (rank is None) != (same_role[0].rank is None):
            raise RendezvousError(f"some {role}s set KVSTORE_RANK and some do not; set it for all or none")
        if rank is not None and any(n.rank == rank for n in same_role):
            raise RendezvousError(f"two processes claim {role} rank {rank}")
        node_id, host, addr, pid = msg["node"], msg["host"], msg.get("addr", ""), msg["pid"]
        if not (isinstance(node_id, str) and isinstance(host, str) and isinstance(addr, str)
                and type(pid) is int):
            raise RendezvousError("register needs string 'node', 'host', 'addr' and an integer 'pid'")
        node = _Node(node_id, role, rank, host, addr, pid,
                     ident, time.monotonic(), hb_ident=self._hb_idents.get(node_id))
        self._nodes[node_id] = node
        self._registered_at_start.append((ident, node_id, msg.get("id")))
        log.debug("registered %s", node.name())
        if len(self._nodes) == self.num_workers + self.num_servers:
            self._complete_registration()

    def _complete_registration(self) -> None:
        for role in ("worker", "server"):
            members = [n for n in self._nodes.values() if n.role == role]
            if members[0].rank is None:  # no launcher ranks: registration order, as MXNet
                for i, node in enumerate(members):
                    node.rank = i
        by_rank = lambda role: sorted((n for n in self._nodes.values() if n.role == role),
                                      key=lambda n: n.rank)
        self._book = {
            "servers": [n.addr for n in by_rank("server")],
            "workers": [f"{n.host}:{n.pid}" for n in by_rank("worker")],
        }
        for ident, node_id, req_id in self._registered_at_start:
            node = self._nodes[node_id]
            self._send(ident, "registered", id=req_id, rank=node.rank,
                       num_workers=self.num_workers, num_servers=self.num_servers, **self._book)
        log.info("all %d nodes registered", len(self._nodes))

    def _op_barrier(self, ident: bytes, msg: dict) -> None:
        node = self._known(msg, ident)
        if node.role != "worker":
            raise RendezvousError("only workers take part in barriers")
        waiting = self._barrier.waiting
        waiting[node.node_id] = (ident, msg.get("id"), msg.get("token", ""))
        limit = msg.get("timeout")
        if isinstance(limit, (int, float)) and not isinstance(limit, bool) and 0 < limit < 1e9:
            self._barrier.deadlines[node.node_id] = (time.monotonic() + limit, limit)
        else:
            self._barrier.deadlines.pop(node.node_id, None)
        gone = [n for n in self._nodes.values() if n.role == "worker" and n.finished]
        if gone:
            names = ", ".join(n.name() for n in gone)
            self._fail_barrier(f"barrier cannot complete: {names} already finished (called close())",
                               "invalid")
        elif len(waiting) == self.num_workers:
            tokens = {token for _, _, token in waiting.values()}
            if len(tokens) > 1:
                detail = "; ".join(f"worker {self._nodes[nid].rank}: {tok!r}"
                                   for nid, (_, _, tok) in sorted(waiting.items(),
                                                                  key=lambda kv: self._nodes[kv[0]].rank))
                self._fail_barrier(f"workers disagree at a collective call: {detail}", "mismatch")
            else:
                for ident_, req_id, _ in waiting.values():
                    self._send(ident_, "barrier_done", id=req_id)
                waiting.clear()
                self._barrier.deadlines.clear()

    def _fail_barrier(self, message: str, kind: str) -> None:
        for ident_, req_id, _ in self._barrier.waiting.values():
            self._send(ident_, "error", id=req_id, kind=kind, message=message)
        self._barrier.waiting.clear()
        self._barrier.deadlines.clear()

    def _op_finish(self, ident: bytes, msg: dict) -> None:
        node = self._known(msg, ident)
        node.finished = True
        node.finished_at = time.monotonic()
        self._send(ident, "finished", id=msg.get("id"))
        log.debug("%s finished", node.name())
        if node.role == "worker" and self._barrier.waiting:
            self._fail_barrier(f"barrier cannot complete: {node.name()} finished (called close())",
                               "invalid")
        self._maybe_shutdown_servers()

    def _op_fail(self, ident: bytes, msg: dict) -> None:
        """A node reports its own fatal error (e.g. an uncaught exception); after
        an abort, usually a consequence of it: logged, the first failure stays."""
        node = self._known(msg, ident, aborted_ok=True)
        node.finished = True
        if self.failure is None:
            self._abort(f"{node.name()} failed: {msg.get('reason')}")
        else:
            log.info("%s also failed: %s", node.name(), msg.get("reason"))
        self._send(ident, "finished", id=msg.get("id"))

    def _maybe_shutdown_servers(self) -> None:
        workers = [n for n in self._nodes.values() if n.role == "worker"]
        if self._shutdown_sent or self._book is None or not all(n.finished for n in workers):
            return
        self._shutdown_sent = True
        self._shutdown_at = time.monotonic()
        log.info("all workers finished; shutting down the servers")
        for node in self._nodes.values():
            if node.role == "server" and node.hb_ident is not None:
                self._send(node.hb_ident, "shutdown")

    def _finished_workers(self) -> list[int]:
        """Workers that finished at least FINISH_GRACE seconds ago (or whose process
        ended with status 0). A worker whose script fails after closing its store
        (``sys.exit(1)`` closes it at exit) is reported by its launcher within that
        time, so it is the root cause, not the others' rounds it left waiting."""
        since = time.monotonic() - FINISH_GRACE
        return sorted(n.rank for n in self._nodes.values() if n.role == "worker" and n.finished
                      and (n.finished_at is None or n.finished_at <= since))

    def _tell_servers_workers_finished(self) -> None:
        """Servers learn which workers finished: a sync round still waiting for one of
        them can never complete, and the server fails it at once naming that worker
        (instead of the others waiting for KVSTORE_TIMEOUT)."""
        ranks = self._finished_workers()
        if ranks == self._told_finished:
            return
        self._told_finished = ranks
        for node in self._nodes.values():
            if node.role == "server" and not node.finished and node.hb_ident is not None:
                self._send(node.hb_ident, "workers_finished", ranks=ranks)

    def _known(self, msg: dict, ident: bytes, aborted_ok: bool = False) -> _Node:
        node = self._nodes.get(msg.get("node")) if isinstance(msg.get("node"), str) else None
        if node is None:
            raise RendezvousError("request from a node that has not registered")
        if self.failure is not None and not aborted_ok:
            raise _JobAborted(self.failure)
        return node

    # -- failures -------------------------------------------------------------
    def _on_exit(self, role: str, rank: int, code: int) -> None:
        node = next((n for n in self._nodes.values() if n.role == role and n.rank == rank), None)
        what = f"{role} {rank}" if node is None else node.name()
        if code != 0:
            self._abort(f"{what} {describe_exit(code)}")
            return
        if node is not None and node.finished:
            node.finished_at = None   # ended cleanly after `finish`: no failure can follow
            return
        if node is None or self._book is None:
            self._abort(f"{what} exited with status 0 before the job formed")
        elif not node.finished:
            node.finished = True  # ended cleanly without close(): count it as finished
            if node.role == "server" and not self._shutdown_sent:
                self._abort(f"{what} exited while workers were still running")
            if node.role == "worker":
                self._tell_servers_workers_finished()
            self._maybe_shutdown_servers()

    def _abort(self, reason: str) -> None:
        if self.failure is not None:
            return
        self.failure = reason
        log.error("aborting the job: %s", reason)
        for node in self._nodes.values():
            if node.hb_ident is not None and not node.finished:
                self._send(node.hb_ident, "abort", reason=reason)
        if self._book is None:
            for ident, _, req_id in self._registered_at_start:
                self._send(ident, "error", id=req_id, kind="aborted", message=reason)
        self._fail_barrier(reason, "aborted")
        # keep answering heartbeats with 'abort' for a while so late nodes hear it too
        self._abort_until = time.monotonic() + 2 * self.heartbeat_interval + 1.0


def _req_id(frame: bytes):
    try:
        rid = wire.decode(frame).get("id")
        return rid if type(rid) is int else None
    except RendezvousError:
        return None
