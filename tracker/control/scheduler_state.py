"""The scheduler's brain: registration, deterministic ranks, address book,
barriers, liveness, finish, fail and abort, as a pure state machine.

No sockets, threads or clocks: the loop in :mod:`tracker.control.rendezvous`
hands every event in with the time it happened (``now``, monotonic seconds) and
sends the :class:`Send` messages each call returns, in order. Tests drive it the
same way, with made-up times (tests/test_scheduler_state.py).

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
why, and :attr:`SchedulerState.failure` names the culprit.
"""

from __future__ import annotations

import logging

from . import wire
from .errors import RendezvousError
from .records import Barrier, Node, Send, describe_exit

log = logging.getLogger(__name__)

# seconds between a worker's `finish` and the servers failing the rounds it left
# waiting (uneven shards): time for its launcher to report a failing exit first
FINISH_GRACE = 1.0


class _JobAborted(RendezvousError):
    """A request after the job was aborted: answered 'aborted', not a bad message."""


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

    OPS = ("heartbeat", "register", "barrier", "finish", "fail")   # requests it answers

    def __init__(self, num_workers: int, num_servers: int, *, now: float, timeout: float,
                 heartbeat_interval: float, heartbeat_timeout: float):
        if num_workers < 1 or num_servers < 1:
            raise ValueError("a job needs at least one worker and one server")
        self.num_workers = num_workers
        self.num_servers = num_servers
        self.timeout = timeout
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.failure: str | None = None
        self.over = False
        self._now = now
        self._out: list[Send] = []
        self._nodes: dict[str, Node] = {}
        self._registered_at_start: list[tuple[bytes, str, object]] = []
        self._book: dict | None = None
        self._barrier = Barrier()
        self._shutdown_sent = False
        self._told_finished: list[int] = []   # finished workers the servers were told of
        self._shutdown_at: float | None = None
        self._abort_until: float | None = None
        self._deadline = now + timeout
        self._hb_idents: dict[str, bytes] = {}

    # -- events in, messages out -----------------------------------------------
    def receive(self, ident: bytes, frame: bytes, now: float) -> list[Send]:
        """A control frame from the peer ``ident``: handled, or answered with an error."""
        self._now = now
        try:
            msg = wire.decode(frame)
            op = msg["op"]
            if op not in self.OPS:
                raise RendezvousError(f"unknown control op {op!r}")
            getattr(self, f"_op_{op}")(ident, msg)
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
        return self._flush()

    def node_exited(self, role: str, rank: int, code: int, now: float) -> list[Send]:
        """A launcher saw the process of ``role`` ``rank`` end with status ``code``."""
        self._now = now
        node = next((n for n in self._nodes.values() if n.role == role and n.rank == rank), None)
        what = f"{role} {rank}" if node is None else node.name()
        if code != 0:
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
                self._tell_servers_workers_finished()
            self._maybe_shutdown_servers()
        return self._flush()

    def abort(self, reason: str, now: float) -> list[Send]:
        """Abort the job (unless it already was): every node is told ``reason``."""
        self._now = now
        self._abort(reason)
        return self._flush()

    def tick(self, now: float) -> list[Send]:
        """Time passed: registration, heartbeat, shutdown and barrier deadlines;
        finished workers whose grace passed are reported to the servers."""
        self._now = now
        if self._abort_until is not None:
            self.over = now >= self._abort_until or all(n.finished for n in self._nodes.values())
        elif self._book is None and now > self._deadline:
            self._abort(f"registration did not complete within {self.timeout:g}s "
                        f"(KVSTORE_TIMEOUT): {self._missing()}")
        elif not self._check_liveness(now):
            self._check_barrier_deadlines(now)
            if self._book is not None:
                self._tell_servers_workers_finished()     # once their grace has passed
                self.over = all(n.finished for n in self._nodes.values())
        return self._flush()

    # -- time ------------------------------------------------------------------
    def _check_liveness(self, now: float) -> bool:
        """Abort (and return True) for a node silent too long, or servers that do not
        finish after the shutdown. Servers stay watched after the shutdown until they
        finished: one that dies before its `finish` must end the job (a standalone
        scheduler has nobody else watching the processes)."""
        for node in self._nodes.values():
            silent = now - node.last_seen
            if not node.finished and silent > self.heartbeat_timeout:
                when = " after it was told to shut down" if (
                    self._shutdown_sent and node.role == "server") else ""
                self._abort(f"{node.name()} sent no heartbeat for {silent:.1f}s{when} "
                            f"(KVSTORE_HEARTBEAT_TIMEOUT={self.heartbeat_timeout:g}); "
                            "it is dead or stuck")
                return True
        if self._shutdown_at is not None and now > self._shutdown_at + self.timeout:
            late = [n.name() for n in self._nodes.values() if n.role == "server" and not n.finished]
            if late:
                self._abort(f"{', '.join(late)} did not finish within {self.timeout:g}s of the "
                            "shutdown (KVSTORE_TIMEOUT)")
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
        waiters = self._by_rank(self._nodes[nid] for nid in waiting)
        absent = self._by_rank(n for n in self._nodes.values()
                               if n.role == "worker" and n.node_id not in waiting)
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

    # -- requests --------------------------------------------------------------
    def _send(self, ident: bytes, op: str, **fields) -> None:
        self._out.append(Send(ident, op, fields))

    def _flush(self) -> list[Send]:
        out, self._out = self._out, []
        return out

    def _op_heartbeat(self, ident: bytes, msg: dict) -> None:
        node_id = msg["node"]
        if not isinstance(node_id, str):
            raise RendezvousError("heartbeat needs a string 'node'")
        self._hb_idents[node_id] = ident
        node = self._nodes.get(node_id)
        if node is not None:
            node.last_seen = self._now
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
        node = Node(node_id, role, rank, host, addr, pid,
                     ident, self._now, hb_ident=self._hb_idents.get(node_id))
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
        by_rank = lambda role: self._by_rank(n for n in self._nodes.values() if n.role == role)
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
        node = self._known(msg)
        if node.role != "worker":
            raise RendezvousError("only workers take part in barriers")
        waiting = self._barrier.waiting
        waiting[node.node_id] = (ident, msg.get("id"), msg.get("token", ""))
        limit = msg.get("timeout")
        if isinstance(limit, (int, float)) and not isinstance(limit, bool) and 0 < limit < 1e9:
            self._barrier.deadlines[node.node_id] = (self._now + limit, limit)
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
        node = self._known(msg)
        node.finished = True
        node.finished_at = self._now
        self._send(ident, "finished", id=msg.get("id"))
        log.debug("%s finished", node.name())
        if node.role == "worker" and self._barrier.waiting:
            self._fail_barrier(f"barrier cannot complete: {node.name()} finished (called close())",
                               "invalid")
        self._maybe_shutdown_servers()

    def _op_fail(self, ident: bytes, msg: dict) -> None:
        """A node reports its own fatal error (e.g. an uncaught exception); after
        an abort, usually a consequence of it: logged, the first failure stays."""
        node = self._known(msg, aborted_ok=True)
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
        self._shutdown_at = self._now
        log.info("all workers finished; shutting down the servers")
        for node in self._nodes.values():
            if node.role == "server" and node.hb_ident is not None:
                self._send(node.hb_ident, "shutdown")

    def _finished_workers(self) -> list[int]:
        """Workers that finished at least FINISH_GRACE seconds ago (or whose process
        ended with status 0). A worker whose script fails after closing its store
        (``sys.exit(1)`` closes it at exit) is reported by its launcher within that
        time, so it is the root cause, not the others' rounds it left waiting."""
        since = self._now - FINISH_GRACE
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

    def _known(self, msg: dict, aborted_ok: bool = False) -> Node:
        node = self._nodes.get(msg.get("node")) if isinstance(msg.get("node"), str) else None
        if node is None:
            raise RendezvousError("request from a node that has not registered")
        if self.failure is not None and not aborted_ok:
            raise _JobAborted(self.failure)
        return node

    @staticmethod
    def _by_rank(nodes) -> list[Node]:
        return sorted(nodes, key=lambda n: n.rank)

    # -- failures --------------------------------------------------------------
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
        self._abort_until = self._now + 2 * self.heartbeat_interval + 1.0


def _req_id(frame: bytes):
    try:
        rid = wire.decode(frame).get("id")
        return rid if type(rid) is int else None
    except RendezvousError:
        return None
