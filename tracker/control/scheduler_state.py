"""The scheduler's brain: registration, deterministic ranks, address book,
barriers, liveness, finish, fail and abort, as a pure state machine.

No sockets, threads or clocks: the loop in :mod:`tracker.control.rendezvous`
hands every event in with the time it happened (``now``, monotonic seconds) and
sends the :class:`Send` messages each call returns, in order. Tests drive it the
same way, with made-up times (tests/scheduler/test_scheduler_state.py).

Life of a job::

    register (every node)  -> when W workers + S servers are in: reply ranks + address book
    barrier (workers)      -> when every member arrived with the same token: release all;
                              a waiter's deadline passing fails it naming the absent workers;
                              with payloads (an all-gather), each gets all of them, by rank
                              (bounded: records.gather_budget)
    heartbeat (every node) -> acknowledged; silence for heartbeat_timeout aborts the job
    progress (workers)     -> a small dict kept for the job (workers that join read it)
    finish (every node)    -> servers hear which workers finished; when all workers
                              finished, servers are told to shut down (and stay watched
                              until they finish); when everyone finished, the job succeeded

Any failure (a node silent too long, a launcher reporting a dead process, a
registration that cannot complete in time) aborts the job: every node is told
why, and :attr:`SchedulerState.failure` names the culprit. In elastic jobs
(``elastic=(MIN, MAX)``) workers leave instead (while MIN remain) and join later:
the rules are in :mod:`tracker.control.elastic`. With replicated servers
(``replicas=1``) a server that dies is replaced by the backup of its chunks: the
scheduler publishes a new epoch of the servers' book to every node
(:mod:`tracker.control.failover`) and the job goes on, unless that was the second
failure of one replication chain. A replacement server (``--restart-servers``)
registers into the running job as server ``num_servers + i``: it becomes the
backup of the shares without one, and their owners report on their heartbeats
(``rebuilt``) when its replica is complete.

A scheduler that a launcher restarted (``restarted=True``) rebuilds the job from
its members' registrations (:mod:`tracker.control.recovery`): until every member
expected registered again, it answers nothing but heartbeats and registrations
(other requests get an error of kind ``restarting``: the node sends them again once
it registered again), then it goes on where the job was. Every ``ack`` and
``registered`` carries its :attr:`SchedulerState.incarnation`, by which nodes
notice the restart.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable

from . import env, wire
from .elastic import FINISH_GRACE, WorkerRanks  # noqa: F401 (FINISH_GRACE: for the tests)
from .errors import RendezvousError
from .failover import ServerBook
from .records import Node, Send, describe_exit, gather_budget, missing
from .recovery import Recovery, read_report
from .start_again import StartsAgain

log = logging.getLogger(__name__)


# seconds after which a job that has not formed (a process not started: a hand-started
# job without its servers) is reported, by the scheduler and to every node waiting in
# its registration, long before KVSTORE_TIMEOUT ends it
FORMING_NOTICE = 10.0


class _JobAborted(RendezvousError):
    """A request after the job was aborted: answered 'aborted', not a bad message."""


class _Restarting(RendezvousError):
    """A request to a restarted scheduler before every member registered again:
    answered 'restarting' (the node sends it again once it registered again)."""


class SchedulerState:
    """The state of one job's rendezvous. Every event method takes ``now`` and
    returns the messages to send; :attr:`failure` is the reason the job was
    aborted (None while it was not) and :attr:`over` turns true when the loop may
    stop (every node finished, or an abort has been told to the nodes).

    Example::

        state = SchedulerState(1, 1, now=0.0, timeout=300, heartbeat_interval=1,
                               heartbeat_timeout=10)
        sends = state.receive(b"peer", wire.encode("register", id=1, node="w", role="worker",
                                                   rank=0, host="h", pid=1), now=0.1)
        sends += state.tick(now=11.0)   # nobody else registered, no heartbeat: aborted
    """

    OPS = wire.REQUESTS   # requests it answers

    def __init__(self, num_workers: int, num_servers: int, *, now: float, timeout: float,
                 heartbeat_interval: float, heartbeat_timeout: float,
                 elastic: tuple[int, int] | None = None, job: str | None = None,
                 replicas: int = env.default("KVSTORE_REPLICAS"), restarted: bool = False,
                 restart_timeout: float = env.default("KVSTORE_SCHEDULER_RESTART_TIMEOUT"),
                 restartable: bool = False):
        if num_workers < 1 or num_servers < 1:
            raise ValueError("a job needs at least one worker and one server")
        if replicas and num_servers < 2:
            raise ValueError(f"KVSTORE_REPLICAS=1 needs at least 2 servers (a backup on another server); "
                             f"this job has {num_servers}")
        self.replicas = replicas
        self.servers_book: ServerBook | None = None   # replicas: who serves each share, once formed
        self._ranks = WorkerRanks(num_workers, elastic)   # raises ValueError naming --elastic
        self.num_workers = num_workers
        self.num_servers = num_servers
        self.timeout = timeout
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.failure: str | None = None
        self.over = False
        self.elastic = elastic   # (MIN, MAX) or None
        # the job's id, in the servers' registration: their checkpoint files name it
        # (kvstore.server.checkpoint); random, so that two jobs never share one
        self.job = job if job is not None else secrets.token_hex(8)
        # this scheduler process's own id, in every ack and registered: a node that hears
        # another one than it registered with registers again (the scheduler was restarted)
        self.incarnation = secrets.token_hex(4)
        self.restart_timeout = restart_timeout
        self.restarted = restarted
        # a launcher restarts this scheduler if it dies (tracker.scheduler_process): told to
        # every node in `registered`, which then waits KVSTORE_SCHEDULER_RESTART_TIMEOUT for
        # it before stopping (a hand-started scheduler: only the heartbeat timeout)
        self.restartable = restartable or restarted
        # restarted by its launcher: the job is rebuilt from the members' registrations
        self._recovery = Recovery(self._ranks.count, num_servers, elastic=elastic is not None,
                                  job=self.job) if restarted else None
        # replicated jobs a launcher runs: servers lost before the job formed are started again
        self._starts_again = StartsAgain(num_servers) if replicas and restartable and not restarted else None
        self._registered_at = now       # the last registration before the job formed (start_again)
        # what a launcher reads to judge a failed exit (tracker.launcher): the exits it
        # reported so far, the ranks of the workers that called close() (replaced whole,
        # never changed in place: read from the launcher's thread), and how many exits
        # had been heard when the job failed (an exit after those is a consequence)
        self.exits_heard = 0
        self.closed_workers: frozenset[int] = frozenset()
        self.failed_after: int | None = None
        self._now = now
        self._out: list[Send] = []
        self._nodes: dict[str, Node] = {}
        self._registered_at_start: list[tuple[bytes, str, object]] = []
        self._book: dict | None = None   # the servers' addresses, once the job formed
        self._shutdown_sent = False
        self._shutdown_at: float | None = None
        self._abort_until: float | None = None
        self._deadline = now + timeout
        self._started = now
        self._noticed = False   # that the job has not formed after FORMING_NOTICE (logged once)
        self._hb_idents: dict[str, bytes] = {}
        self._handlers: dict[str, Callable[[bytes, dict], None]] = {
            wire.HEARTBEAT: self._op_heartbeat, wire.REGISTER: self._op_register, wire.BARRIER: self._op_barrier,
            wire.FINISH: self._op_finish, wire.FAIL: self._op_fail, wire.PROGRESS: self._op_progress}
        assert tuple(self._handlers) == self.OPS

    @property
    def start_again(self) -> dict[int, int]:
        """Server rank -> how many times this scheduler asked its launcher to start that
        server again in place (it died or hung before the job formed:
        :mod:`tracker.control.start_again`)."""
        return dict(self._starts_again.counts) if self._starts_again is not None else {}

    @property
    def members(self) -> list[int]:
        """The ranks of the workers in the job now, sorted ([] before it formed)."""
        return self._ranks.members

    @property
    def epoch(self) -> int:
        """The membership epoch: 0 when the job formed, +1 at every join and leave."""
        return self._ranks.epoch

    # -- events in, messages out -----------------------------------------------
    def receive(self, ident: bytes, frame: bytes, now: float) -> list[Send]:
        """A control frame from the peer ``ident``: handled, or answered with an error."""
        self._now = now
        try:
            msg = wire.decode(frame)
            op = msg["op"]
            if op not in self.OPS:
                raise RendezvousError(f"unknown control op {op!r}")
            if self._recovery is not None and op not in (wire.HEARTBEAT, wire.REGISTER, wire.FAIL) \
                    and self.failure is None:
                raise _Restarting(f"the scheduler was restarted and waits for every member to register "
                                  f"again ({self.recovering}): {op} is answered after that")
            self._handlers[op](ident, msg)
        except _JobAborted as e:   # a node that has not heard of the abort yet
            log.debug("request after the abort: %s", e)
            self._send(ident, wire.ERROR, id=_req_id(frame), kind=wire.ABORTED, message=str(e))
        except _Restarting as e:   # sent again by the node once it registered again
            log.debug("request before the recovery: %s", e)
            self._send(ident, wire.ERROR, id=_req_id(frame), kind=wire.RESTARTING, message=str(e))
        except (RendezvousError, KeyError, TypeError, ValueError) as e:
            log.warning("bad control message: %s", e)
            kind = wire.ABORTED if self.failure is not None else wire.INVALID
            self._send(ident, wire.ERROR, id=_req_id(frame), kind=kind, message=str(e))
        except Exception as e:  # an input we did not foresee must not kill the job's scheduler
            log.exception("scheduler failed on a control message")
            self._send(ident, wire.ERROR, id=_req_id(frame), kind=wire.INVALID,
                       message=f"the scheduler could not handle this message: {type(e).__name__}")
        return self._flush()

    def node_exited(self, role: str, rank: int, code: int, now: float) -> list[Send]:
        """A launcher saw the process of ``role`` ``rank`` end with status ``code`` (of a
        worker: the one holding the rank now, which may replace one that left). While a
        restarted scheduler waits for the members, kept for after the recovery."""
        self._now = now
        self.exits_heard += 1
        if self._recovery is not None:
            self._recovery.exit(role, rank, code)
            self._maybe_recover()
        else:
            self._node_exited(role, rank, code)
        return self._flush()

    def _node_exited(self, role: str, rank: int, code: int) -> None:
        now = self._now
        node = next((n for n in reversed(self._nodes.values()) if n.role == role and n.rank == rank),
                    None)   # the last to register with that rank: a replacement if one joined
        what = f"{role} {rank}" if node is None else node.name()
        if role == "server" and code != 0 and self._start_again(rank, describe_exit(code)):
            return
        if role == "server" and node is not None and self.servers_book is not None \
                and node.rank in self.servers_book.dead:
            log.info("%s %s (its chunks were handed to their backups)", what, describe_exit(code))
        elif role == "server" and node is None and self.servers_book is not None and rank >= self.num_servers:
            # a replacement (--restart-servers) that never joined: the job goes on without it
            log.warning("replacement server %d %s before it joined the job", rank, describe_exit(code))
        elif self._replicated(node, role) and code != 0:
            assert node is not None
            self._server_died(node, describe_exit(code))
        elif self._lost_at_shutdown(node, role) and code != 0:
            assert node is not None
            self._server_lost_at_shutdown(node, describe_exit(code))
        elif self.elastic is not None and role == "worker" and self._book is not None:
            if node is not None and self._ranks.holds(node):   # a clean exit is no failure
                self._leave(node, describe_exit(code) if code else "exited with status 0 without "
                            "finishing (close())", failure=code != 0)
            else:
                log.warning("%s %s; it was no member (it had left, or never joined)", what,
                            describe_exit(code))
        elif code != 0:
            self._abort(f"{what} {describe_exit(code)}")
        elif node is not None and node.finished:
            node.finished_at = None   # ended cleanly after `finish`: no failure can follow
        elif node is None or self._book is None:
            self._abort(f"{what} exited with status 0 before the job formed")
        else:
            node.finished = True  # ended cleanly without close(): count it as finished
            if node.role == "server" and not self._shutdown_sent:
                self._abort(f"{what} exited while workers were still running")
            if node.role == "worker":
                self._out += self._ranks.tell_finished(now, self._live_servers())
            self._maybe_shutdown_servers()

    def abort(self, reason: str, now: float) -> list[Send]:
        """Abort the job (unless it already was): every node is told ``reason``."""
        self._now = now
        self._abort(reason)
        return self._flush()

    def tick(self, now: float) -> list[Send]:
        """Time passed: registration, heartbeat, shutdown and barrier deadlines;
        finished workers whose grace passed are reported to the servers."""
        self._now = now
        if self._abort_until is None and not self._noticed and (notice := self._forming()):
            self._noticed = True
            log.warning("%s", notice["forming"])
        if self._abort_until is not None:
            self.over = now >= self._abort_until or all(n.finished for n in self._nodes.values())
        elif self._recovery is not None and self._recovery.reports:
            waited = self.heartbeat_timeout + self.restart_timeout
            if now > self._started + waited:
                self._abort(f"the scheduler was restarted and waited {waited:g}s (KVSTORE_HEARTBEAT_TIMEOUT + "
                            f"KVSTORE_SCHEDULER_RESTART_TIMEOUT) for the job's members to register again: "
                            f"{self.recovering} did not (dead or stuck, or cut off from the scheduler)")
        elif self._book is None and self._recovery is None and now > self._registered_at + self.heartbeat_timeout \
                and self._start_missing_again(f"had not registered {now - self._registered_at:.1f}s after the "
                                              f"last process did (KVSTORE_HEARTBEAT_TIMEOUT={self.heartbeat_timeout:g})"):
            pass
        elif self._book is None and now > self._deadline:
            if self._start_missing_again(f"did not register within {self.timeout:g}s (KVSTORE_TIMEOUT)"):
                return self._flush()
            who = missing(self._nodes.values(), self.num_workers, self.num_servers)
            self._abort(f"registration did not complete within {self.timeout:g}s (KVSTORE_TIMEOUT): {who}")
        elif not self._check_liveness(now):
            self._out += self._ranks.barrier.expire(now, list(self._ranks.holders.values()), self._nodes)
            if self._book is not None:
                for node, error in self._ranks.overdue(now, self.timeout, self._live_servers()):
                    self._out.append(error)
                    self._leave(node, "the servers did not acknowledge its join in time", False)
                if late := self._ranks.held_too_long(now, self.timeout, self._live_servers()):
                    self._abort(late)   # a barrier that made joiners members waits for a server
                self._out += self._ranks.tell_finished(now, self._live_servers())   # after the grace
                self.over = all(n.finished for n in self._nodes.values())
        return self._flush()

    # -- time ------------------------------------------------------------------
    def _check_liveness(self, now: float) -> bool:
        """Abort (and return True) for a node silent too long, or servers that do not
        finish after the shutdown. Servers stay watched after the shutdown until they
        finished: one that dies before its `finish` must end the job (a standalone
        scheduler has nobody else watching the processes)."""
        for node in list(self._nodes.values()):
            silent = now - node.last_seen
            if not node.finished and silent > self.heartbeat_timeout:
                when = " after it was told to shut down" if (
                    self._shutdown_sent and node.role == "server") else ""
                why = (f"sent no heartbeat for {silent:.1f}s{when} (KVSTORE_HEARTBEAT_TIMEOUT="
                       f"{self.heartbeat_timeout:g}); it is dead or stuck")
                if self._elastic_worker(node):
                    self._leave(node, why, failure=True)
                    if self.failure is None:
                        continue
                if self._replicated(node, node.role):
                    self._server_died(node, why)
                    if self.failure is None:
                        continue
                if self._lost_at_shutdown(node, node.role):
                    self._server_lost_at_shutdown(node, why)
                    continue
                if node.role == "server" and self._start_again(node.rank, why):
                    continue
                self._abort(f"{node.name()} {why}")
                return True
        if self._shutdown_at is not None and now > self._shutdown_at + self.timeout:
            late = [n.name() for n in self._nodes.values() if n.role == "server" and not n.finished]
            if late:
                self._abort(f"{', '.join(late)} did not finish within {self.timeout:g}s of the "
                            "shutdown (KVSTORE_TIMEOUT)")
                return True
        return False

    # -- requests --------------------------------------------------------------
    def _send(self, ident: bytes, op: str, **fields) -> None:
        self._out.append(Send(ident, op, fields))

    def _flush(self) -> list[Send]:
        """The messages to send; every ``ack`` and ``registered`` with :attr:`incarnation`,
        every ``registered`` with :attr:`restartable`."""
        out, self._out = self._out, []
        return [Send(s.ident, s.op, {**s.fields, "incarnation": self.incarnation,
                                     **({"restartable": self.restartable} if s.op == wire.REGISTERED else {})})
                if s.op in (wire.ACK, wire.REGISTERED) else s for s in out]

    def _op_heartbeat(self, ident: bytes, msg: dict) -> None:
        node_id = msg["node"]
        if not isinstance(node_id, str):
            raise RendezvousError("heartbeat needs a string 'node'")
        self._hb_idents[node_id] = ident
        node = self._nodes.get(node_id)
        if node is not None:
            node.last_seen = self._now
            node.hb_ident = ident
            if node.role == "server" and type(msg.get("epoch")) is int:
                node.epoch = max(node.epoch, msg["epoch"])   # the membership it holds
            if node.role == "server" and "rebuilt" in msg and self.failure is None and not node.finished:
                self._rebuilt(node, msg["rebuilt"])          # replicas rebuilt on a replacement
        if self.failure is not None:
            self._send(ident, wire.ABORT, reason=self.failure)
        elif node is not None and node.removed is not None:
            self._send(ident, wire.ABORT, reason=node.removal())
        elif node is not None and node.role == "server" and self._shutdown_sent:
            self._send(ident, wire.SHUTDOWN)
        elif node is not None and node.role == "server" and self._book is not None:
            self._send(ident, wire.ACK, **self._ranks.acknowledgement(self._now), **self._book_news())
            self._out += self._ranks.answers(self._live_servers(), self._book)   # (elastic) joiners
        else:
            self._send(ident, wire.ACK, **self._book_news(), **self._forming())

    def _forming(self) -> dict:
        """``{"forming": why}`` once the job has not formed for FORMING_NOTICE seconds
        (who registered and who is missing, the settings, the deadline); else {}."""
        if self._book is not None or self._recovery is not None \
                or self._now < self._started + min(FORMING_NOTICE, self.timeout / 2):
            return {}
        who = missing(self._nodes.values(), self.num_workers, self.num_servers)
        return {"forming": (
            f"the job has not formed {self._now - self._started:.0f}s after the scheduler started: {who}. "
            "Start the missing processes (a server: DMLC_ROLE=server, or python -m kvstore.server), or make "
            "KVSTORE_NUM_WORKERS / KVSTORE_NUM_SERVERS (DMLC_NUM_WORKER / DMLC_NUM_SERVER) match what runs; "
            f"registration gives up {self.timeout:g}s after the start (KVSTORE_TIMEOUT)"
            + ("; a server still missing KVSTORE_HEARTBEAT_TIMEOUT after the last registration is started "
               "again by the launcher (KVSTORE_REPLICAS=1)"
               if self._starts_again is not None else ""))}

    def _op_register(self, ident: bytes, msg: dict) -> None:
        if self.failure is not None:
            return self._send(ident, wire.ERROR, id=msg.get("id"), kind=wire.ABORTED, message=self.failure)
        role, rank = msg["role"], msg.get("rank")
        if role not in ("worker", "server"):
            raise RendezvousError(f"cannot register role {role!r}: must be worker or server")
        if self._recovery is not None:
            return self._register_again(ident, msg, role, rank)
        known = self._nodes.get(msg["node"]) if isinstance(msg["node"], str) else None
        if known is not None:   # the same request again (sent again to a restarted scheduler)
            return self._registered_again(known, ident, msg.get("id"))
        if role == "worker" and self.elastic is not None and self._book is not None:
            return self._join(ident, msg)
        if role == "server" and self.servers_book is not None and msg.get("replacement") is True:
            return self._replacement(ident, msg)
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
        node = Node.registering(msg, role, rank, ident, self._now, self._hb_idents)
        self._nodes[node.node_id] = node
        self._registered_at_start.append((ident, node.node_id, msg.get("id")))
        self._registered_at = self._now
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
                                      key=lambda n: n.ranked)
        # the job's servers' addresses; a replacement's is in the servers' book (``added``)
        self._book = {"num_servers": self.num_servers,
                      "servers": [n.addr for n in by_rank("server") if n.ranked < self.num_servers]}
        if self.replicas:
            self.servers_book = ServerBook(self.num_servers, [n.host for n in by_rank("server")])
            self._book.update(self.servers_book.fields())
        self._ranks.fill(by_rank("worker"))
        for ident, node_id, req_id in self._registered_at_start:
            node = self._nodes[node_id]
            self._send(ident, wire.REGISTERED, id=req_id, **self._ranks.registered(node, self._book),
                       **({"job": self.job} if node.role == "server" else {}))
        log.info("all %d nodes registered", len(self._nodes))

    def _registered_again(self, node: Node, ident: bytes, req_id) -> None:
        """A registration of ``node`` came again (its node sent it again: it heard a
        restarted scheduler): answered once, when the job forms, or at once if it did."""
        if self._book is None:
            self._registered_at_start = [(ident, node.node_id, req_id) if entry[1] == node.node_id else entry
                                         for entry in self._registered_at_start]
        elif not self._ranks.again(node, ident, req_id):   # an elastic joiner: answered once servers hold it
            self._send(ident, wire.REGISTERED, id=req_id, **self._ranks.registered(node, self._book),
                       **({"job": self.job} if node.role == "server" else {}))

    # -- a restarted scheduler (tracker.control.recovery) ---------------------------------
    @property
    def recovering(self) -> str | None:
        """Who a restarted scheduler still waits for to register again ('server 2,
        worker 1'; 'nobody' just before it goes on); None when it waits for nobody."""
        if self._recovery is None:
            return None
        registered = {(n.role, n.rank) for n in self._nodes.values()}
        return ", ".join(f"{role} {rank}" for role, rank in self._recovery.missing(registered)) or "nobody"

    def _register_again(self, ident: bytes, msg: dict, role: str, rank) -> None:
        """A node registers with a restarted scheduler: with what it knows of the job
        (``rejoin``) if it had registered before, else plainly (the job had not formed)."""
        assert self._recovery is not None
        if rank is None and role == "worker" and self.elastic is not None:
            raise _Restarting("a worker joins a running elastic job once the restarted scheduler rebuilt it")
        report = None if msg.get("rejoin") is None else read_report(
            msg["rejoin"], self._ranks.count, self.num_servers, self.job)
        # a replacement server (--restart-servers) re-registers with the rank it joined with,
        # past the job's servers: valid when the book it reports lists it (ServerBook.restore)
        total = self._ranks.count if role == "worker" else self.num_servers + (
            len(report.book.get("added", [])) if report is not None and report.book is not None else 0)
        if role == "server" and msg.get("replacement") is True and report is None:
            # its first registration: the old scheduler may have let it join (its owners' books
            # list it) and died before answering; else it joins once the job is rebuilt
            book = self._recovery.book() if self._recovery.reports else None
            if not (book is not None and type(rank) is int and self.num_servers <= rank < book.ranks
                    and book.added[rank - self.num_servers] == msg.get("addr")):
                raise _Restarting("a replacement server joins a running job once the restarted scheduler "
                                  "rebuilt it")
            total = book.ranks
        if not (type(rank) is int and 0 <= rank < total):
            raise RendezvousError(f"{role} rank {rank!r} is out of range or missing: a restarted scheduler "
                                  f"takes registrations with the ranks of the job's {total} {role}s")
        if report is None and role == "worker" and self.elastic is not None and self._recovery.reports:
            raise _Restarting("a worker joins a running elastic job once the restarted scheduler rebuilt it")
        node = Node.registering(msg, role, rank, ident, self._now, self._hb_idents)
        other = next((n for n in self._nodes.values() if n.role == role and n.rank == rank
                      and n.node_id != node.node_id), None)
        if other is not None:
            raise RendezvousError(f"two processes claim {role} rank {rank}: {other.name()} registered "
                                  "with the restarted scheduler already")
        if report is not None:
            node.hb_ident = ident   # a node registers again from its heartbeat thread's socket
            self._recovery.add(node.node_id, report)
        else:
            self._recovery.drop(node.node_id)
        self._nodes[node.node_id] = node
        self._registered_at_start = [e for e in self._registered_at_start if e[1] != node.node_id] + [
            (ident, node.node_id, msg.get("id"))]
        log.info("%s registered %swith the restarted scheduler", node.name(), "again " if report else "")
        self._maybe_recover()

    def _maybe_recover(self) -> None:
        """Once nobody is missing: the job formed (nobody had registered before the
        restart), or it is rebuilt from the reports and goes on."""
        rec = self._recovery
        assert rec is not None
        if self.failure is not None or rec.missing({(n.role, n.rank) for n in self._nodes.values()}):
            return
        self._recovery = None
        if not rec.reports:
            if len(self._nodes) == self.num_workers + self.num_servers:
                self._complete_registration()
            for (role, rank), code in rec.exited.items():
                self._node_exited(role, rank, code)
            return
        self._rebuild(rec)

    def _rebuild(self, rec: Recovery) -> None:
        """The job as its members reported it: the servers' book, the members and their
        epoch, the finished workers and the progress; a placeholder for each node that
        did not register again (finished, dead, or ended: its exit is replayed)."""
        book = rec.book()
        dead = book.dead if book is not None else {}
        finished = rec.finished_workers()
        epoch, members = rec.membership()
        registered = {(n.role, n.rank): n for n in self._nodes.values()}
        for node in registered.values():
            node.last_seen = self._now
            if node.role == "server" and node.ranked in dead:   # failed over, yet it came back (stopped)
                node.finished, node.removed = True, f"{dead[node.ranked]}; its chunks are served by their backups now"
        server_ranks = book.ranks if book is not None else self.num_servers   # replacements included
        addresses = rec.addresses()
        for role, total in (("server", server_ranks), ("worker", self._ranks.count)):
            for rank in range(total):
                if (role, rank) in registered or (role == "worker" and self.elastic is not None
                                                  and rank not in members):
                    continue
                code = rec.exited.get((role, rank))
                # (a server that died before the restart keeps its address in the job's book)
                addr = addresses[rank] if role == "server" and rank < len(addresses) else ""
                node = Node(f"{role}-{rank}-before-the-restart", role, rank, "?", addr, 0, b"", self._now)
                # a node that ended with a failure during the restart: its exit, replayed below, judges it
                node.finished = not (code and rank not in dead and self.elastic is None)
                node.removed = f"{dead[rank]}; its chunks are served by their backups now" \
                    if role == "server" and rank in dead else None
                self._nodes[node.node_id] = node
                registered[(role, rank)] = node
        by_rank = lambda role: sorted((n for n in self._nodes.values() if n.role == role),  # noqa: E731
                                      key=lambda n: n.ranked)
        # the job's servers' addresses; a replacement's is in the servers' book (``added``)
        self._book = {"num_servers": self.num_servers,
                      "servers": [n.addr for n in by_rank("server") if n.ranked < self.num_servers]}
        if self.replicas:
            self.servers_book = book or ServerBook(self.num_servers, [n.host for n in by_rank("server")])
            self._book.update(self.servers_book.fields())
        workers = by_rank("worker")
        holders = [n for n in workers if self.elastic is None or n.ranked in members]
        self._ranks.restore(holders, [n for n in workers if n not in holders], epoch, rec.progress(),
                            sorted(finished))
        self._ranks.barrier.restore(rec.barrier())
        for node in workers:
            if node.ranked in finished:
                node.finished = True
        for ident, node_id, req_id in self._registered_at_start:
            node = self._nodes[node_id]
            # (a replacement that registers for the first time hears the replacements' addresses too)
            added = {"servers": self._book["servers"] + self.servers_book.added} if (
                self.servers_book is not None and node.role == "server" and node.ranked >= self.num_servers) else {}
            self._send(ident, wire.REGISTERED, id=req_id, **self._ranks.registered(node, {**self._book, **added}),
                       **({"job": self.job} if node.role == "server" else {}))
        self._registered_at_start = []
        log.warning("the restarted scheduler rebuilt the job from %d registrations (servers' book epoch %s, "
                    "membership epoch %d, finished workers %s): the job goes on", len(rec.reports),
                    "-" if self.servers_book is None else self.servers_book.epoch, epoch,
                    sorted(finished) or "none")
        for (role, rank), code in rec.exited.items():
            self._node_exited(role, rank, code)
        self._maybe_shutdown_servers()

    def _join(self, ident: bytes, msg: dict) -> None:
        """(elastic) A worker registers with the running job: it takes a vacant rank."""
        if self._shutdown_sent:
            raise RendezvousError("the job is ending (every worker finished or left): "
                                  "no worker can join it now")
        node = Node.registering(msg, "worker", None, ident, self._now, self._hb_idents)
        if node.node_id in self._nodes:
            raise RendezvousError(f"{self._nodes[node.node_id].name()} registered already")
        self._out += self._ranks.join(node, msg.get("rank"), ident, msg.get("id"), self._now,
                                      self._live_servers())
        self._nodes[node.node_id] = node

    def _leave(self, node: Node, why: str, failure: bool, removed: bool = True) -> None:
        """(elastic) Worker ``node`` leaves the job ``why`` (a ``failure`` below MIN aborts
        it instead). Not ``removed`` (by `finish`): its late heartbeats get no ``abort``."""
        if self._ranks.holds(node):   # else it left before: nothing changes
            node.finished, node.removed = True, why if removed else None
        sends, abort = self._ranks.leave(node, why, failure, self._live_servers(), self._nodes, self._now)
        self._out += sends
        if abort is not None:
            return self._abort(abort)
        self._maybe_shutdown_servers()

    # -- replicated servers (tracker.control.failover) -------------------------------------
    def _replicated(self, node: Node | None, role: str) -> bool:
        """Whether the death of ``node`` is the servers' book's to handle: a server of a
        replicated job that formed, before the servers were told to shut down."""
        return (role == "server" and node is not None and self.servers_book is not None
                and not node.finished and not self._shutdown_sent and self.failure is None)

    def _lost_at_shutdown(self, node: Node | None, role: str) -> bool:
        """Whether the death of ``node`` loses nothing: a server of a replicated job
        after every worker finished (the servers were told to shut down). Every round
        it answered is on its backup (a reply waits for the backup's acknowledgement),
        no worker asks it anything more, and a server writes nothing as it shuts down."""
        return (role == "server" and node is not None and self.servers_book is not None
                and not node.finished and self._shutdown_sent and self.failure is None)

    def _server_lost_at_shutdown(self, node: Node, why: str) -> None:
        """Server ``node`` died ``why`` while the servers shut down: logged, counted as
        finished; the job ends as it would have."""
        node.finished, node.removed = True, f"{why} after every worker finished"
        log.warning("%s %s after every worker finished: nothing is lost (every round it answered is "
                    "on its backup); the job ends as it would have", node.name(), why)

    def _start_again(self, rank, why: str) -> bool:
        """Before a replicated job formed: ask the launcher to start server ``rank``
        again in place (it died or hung ``why``), forgetting its registration, and give
        it a whole KVSTORE_TIMEOUT to register; whether it was asked (else the caller
        ends the job). Nothing is lost: no server has served a request yet."""
        again = self._starts_again
        if again is None or self._book is not None or self.failure is not None or not again.take(rank):
            return False
        gone = [node_id for node_id, n in self._nodes.items() if n.role == "server" and n.rank == rank]
        for node_id in gone:
            del self._nodes[node_id]
        self._registered_at_start = [e for e in self._registered_at_start if e[1] not in gone]
        self._deadline = max(self._deadline, self._now + self.timeout)
        log.warning("server %s %s before the job formed: its launcher starts it again in place (%s; nothing "
                    "was served yet, KVSTORE_REPLICAS=1)", rank, why, again.describe(rank))
        return True

    def _start_missing_again(self, why: str) -> bool:
        """When every worker registered and the processes missing are servers only, each
        of which may start again (stopped or hung before they registered: ``why``),
        ask for them; whether it did. Tried ``KVSTORE_HEARTBEAT_TIMEOUT`` after the last
        registration (as late as a silent node), and at the registration deadline."""
        again = self._starts_again
        have = {(n.role, n.rank) for n in self._nodes.values()}
        gone = [r for r in range(self.num_servers) if ("server", r) not in have]
        workers = sum(1 for n in self._nodes.values() if n.role == "worker")
        if again is None or workers < self.num_workers or not gone or not all(map(again.can, gone)):
            return False
        for rank in gone:
            self._start_again(rank, why)
        return True

    def _server_died(self, node: Node, why: str) -> None:
        """Server ``node`` died ``why``: the backups of its chunks take over (every node
        hears the new book at once, and with every ``ack``), or the job ends naming
        both servers of a chain that failed twice."""
        book = self.servers_book
        assert book is not None
        lost = book.server_died(node.ranked, why)
        if lost is not None:
            return self._abort(lost)
        node.finished, node.removed = True, f"{why}; its chunks are served by their backups now"
        log.warning("%s %s: its chunks are served by their backups (servers' book epoch %d: owners %s)",
                    node.name(), why, book.epoch, book.owners)
        self._tell_book()
        self._maybe_shutdown_servers()

    def _replacement(self, ident: bytes, msg: dict) -> None:
        """A replacement server (``--restart-servers``) registers with the running job:
        it takes the next server rank and becomes the backup of every share without
        one (tracker.control.failover); every node hears the new book."""
        book = self.servers_book
        assert book is not None
        if self._shutdown_sent:
            raise RendezvousError("the job is ending (every worker finished): no server can join it now")
        if len(book.added) >= len(book.dead):     # one per death: what a launcher starts, no more
            raise RendezvousError(f"a replacement server joins in place of a dead one; {len(book.dead)} died and "
                                  f"{len(book.added)} replacement(s) joined already")
        rank = msg.get("rank")
        if rank != book.ranks:
            raise RendezvousError(f"a replacement server registers as server {book.ranks} (the next rank), "
                                  f"not {rank!r}")
        node = Node.registering(msg, "server", rank, ident, self._now, self._hb_idents)
        if node.node_id in self._nodes:
            raise RendezvousError(f"{self._nodes[node.node_id].name()} registered already")
        shares = book.server_joined(rank, node.addr)
        self._nodes[node.node_id] = node
        log.warning("%s joined as a replacement: it backs up the shares of servers %s (servers' book epoch %d; "
                    "their owners rebuild the replicas)", node.name(), shares, book.epoch)
        assert self._book is not None
        self._send(ident, wire.REGISTERED, id=msg.get("id"), job=self.job,
                   **self._ranks.registered(node, {**self._book, **book.fields(),
                                                   "servers": self._book["servers"] + book.added}))
        self._tell_book()

    def _rebuilt(self, node: Node, reports) -> None:
        """Server ``node`` reports (on its heartbeats) the replicas it rebuilt on a
        replacement: ``[[share, backup], ...]``; a new epoch for those that completed."""
        book = self.servers_book
        if book is None or not isinstance(reports, list):
            return
        changed = False
        for item in reports:
            if isinstance(item, list) and len(item) == 2 and all(type(x) is int for x in item) \
                    and 0 <= item[0] < book.num_servers and book.owners[item[0]] == node.rank \
                    and book.replica_rebuilt(item[0], item[1]):
                log.warning("%s rebuilt the replica of server %d's share on server %d (servers' book epoch %d)",
                            node.name(), item[0], item[1], book.epoch)
                changed = True
        if changed:
            self._tell_book()

    def _tell_book(self) -> None:
        """Every live node hears the servers' book (``servers`` on its heartbeat socket)."""
        assert self.servers_book is not None
        for other in self._nodes.values():
            if other.hb_ident is not None and not other.finished:
                self._send(other.hb_ident, wire.SERVERS, **self.servers_book.fields())

    def _book_news(self) -> dict:
        """The servers' book for an ``ack`` (replicated jobs; repairs a lost ``servers``)."""
        return {} if self.servers_book is None or not self.servers_book.epoch else self.servers_book.fields()

    def _live_servers(self) -> list[Node]:
        return [n for n in self._nodes.values() if n.role == "server" and not n.finished]

    def _elastic_worker(self, node: Node) -> bool:   # it leaves rather than aborting the job
        return self.elastic is not None and node.role == "worker" and self._book is not None

    def _op_barrier(self, ident: bytes, msg: dict) -> None:
        node = self._known(msg, worker="take part in barriers")
        if self._handled(node, msg):
            return
        if self._elastic_worker(node) and not self._ranks.holds(node):
            raise RendezvousError(f"{node.name()} left the job (it finished): it takes no part "
                                  "in its barriers")
        replayed = self._ranks.barrier.replay(node, ident, msg.get("id"), msg.get("token", ""), msg.get("after"))
        if replayed is not None:   # released by the scheduler before a restart, which died before answering it
            log.warning("%s was answered with barrier %d, released to the others before the scheduler's restart",
                        node.name(), self._ranks.barrier.released)
            self._out += replayed
            return
        # a payload (an all-gather) is bounded per barrier by the members it goes back to
        self._out += self._ranks.barrier.arrive(node.node_id, ident, msg.get("id"), msg.get("token", ""),
                                                msg.get("timeout"), self._now, self._nodes, msg.get("data"),
                                                gather_budget(len(self._ranks.holders)))
        gone = [n for n in self._nodes.values() if n.role == "worker" and n.finished]
        if gone and self.elastic is None:   # elastic: a finished worker is just no member
            names = ", ".join(n.name() for n in gone)
            self._fail_barrier(f"barrier cannot complete: {names} already finished (called close())",
                               wire.INVALID)
        else:
            self._out += self._ranks.release(self._nodes, self._live_servers(), self._now)

    def _fail_barrier(self, message: str, kind: str) -> None:
        self._out += self._ranks.barrier.end(wire.ERROR, kind=kind, message=message)

    def _op_finish(self, ident: bytes, msg: dict) -> None:
        node = self._known(msg)
        if self._handled(node, msg):
            return
        node.finished_at = self._now
        if node.role == "worker" and node.rank is not None and msg.get("closed") is True:
            self.closed_workers = self.closed_workers | {node.rank}
        self._send(ident, wire.FINISHED, id=msg.get("id"))
        log.debug("%s finished", node.name())
        if self._elastic_worker(node):   # leaves: the others go on without it
            return self._leave(node, "finished (called close())", failure=False, removed=False)
        node.finished = True
        if node.role == "worker" and self._ranks.barrier.waiting:
            self._fail_barrier(f"barrier cannot complete: {node.name()} finished (called close())",
                               wire.INVALID)
        self._maybe_shutdown_servers()

    def _op_fail(self, ident: bytes, msg: dict) -> None:
        """A node reports its own fatal error (e.g. an uncaught exception); after
        an abort, usually a consequence of it: logged, the first failure stays."""
        node = self._known(msg, aborted_ok=True)
        if self.failure is None and self._elastic_worker(node):   # leaves (unless below MIN)
            self._send(ident, wire.FINISHED, id=msg.get("id"))
            return self._leave(node, f"failed: {msg.get('reason')}", failure=True)
        node.finished = True
        if self.failure is None:
            self._abort(f"{node.name()} failed: {msg.get('reason')}")
        else:
            log.info("%s also failed: %s", node.name(), msg.get("reason"))
        self._send(ident, wire.FINISHED, id=msg.get("id"))

    def _op_progress(self, ident: bytes, msg: dict) -> None:
        """A worker saves the job's progress (what a joining worker resumes from)."""
        if self._handled(self._known(msg, worker="save progress"), msg):
            return
        self._ranks.save(msg.get("progress"))
        self._send(ident, "progress_saved", id=msg.get("id"))

    def _maybe_shutdown_servers(self) -> None:
        workers = [n for n in self._nodes.values() if n.role == "worker"]
        if self._shutdown_sent or self._book is None or not all(n.finished for n in workers):
            return
        self._shutdown_sent = True
        self._shutdown_at = self._now
        log.info("all workers finished%s; shutting down the servers", " or left" if self.elastic else "")
        for node in self._live_servers():
            if node.hb_ident is not None:
                self._send(node.hb_ident, "shutdown")

    def _handled(self, node: Node, msg: dict) -> bool:
        """Whether ``msg`` is a copy of a request of ``node`` handled already: a node sends
        a request again once it registered again with a restarted scheduler, and a copy
        held in its socket while the scheduler was away may reach this one too; dropped.
        Else it counts as handled. (Only in a restarted scheduler: nothing else sends again.)"""
        req_id = msg.get("id")
        if not self.restarted or type(req_id) is not int:
            return False
        if req_id <= node.last_request:
            log.info("dropped a copy of request %d of %s (handled already)", req_id, node.name())
            return True
        node.last_request = req_id
        return False

    def _known(self, msg: dict, aborted_ok: bool = False, worker: str = "") -> Node:
        """The registered node of ``msg`` (``worker``: what only workers may do)."""
        node_id = msg.get("node")
        node = self._nodes.get(node_id) if isinstance(node_id, str) else None
        if node is None:
            raise RendezvousError("request from a node that has not registered")
        if self.failure is not None and not aborted_ok:
            raise _JobAborted(self.failure)
        if node.removed is not None and not aborted_ok:
            raise _JobAborted(node.removal())
        if worker and node.role != "worker":
            raise RendezvousError(f"only workers {worker}")
        return node

    # -- failures --------------------------------------------------------------
    def _abort(self, reason: str) -> None:
        if self.failure is not None:
            return
        self.failed_after = self.exits_heard
        self.failure = reason
        log.error("aborting the job: %s", reason)
        for node in self._nodes.values():
            if node.hb_ident is not None and not node.finished:
                self._send(node.hb_ident, "abort", reason=reason)
        for ident, req_id in ([(i, r) for i, _, r in self._registered_at_start] if self._book is None
                              else self._ranks.unanswered()):
            self._send(ident, wire.ERROR, id=req_id, kind=wire.ABORTED, message=reason)
        self._fail_barrier(reason, wire.ABORTED)
        # keep answering heartbeats with 'abort' for a while so late nodes hear it too
        self._abort_until = self._now + 2 * self.heartbeat_interval + 1.0


def _req_id(frame: bytes):
    try:
        rid = wire.decode(frame).get("id")
        return rid if type(rid) is int else None
    except RendezvousError:
        return None
