"""The job's worker ranks: which worker holds which rank (the *members*), the
membership *epoch*, the progress workers saved, and the rules of elastic jobs
(``--elastic MIN:MAX``, docs/protocol.md): where a joining worker goes, when a
leave aborts the job instead, when a joiner is answered (once every server
acknowledged the epoch that lists its process) and when it becomes a member (at
its first barrier with the members, released once every server holds that epoch).

Pure, like :class:`~.scheduler_state.SchedulerState`, which holds one
:class:`WorkerRanks` and sends the messages its methods return. Without elastic the
ranks are the ``num_workers`` ones, filled once when the job forms, and the
members never change.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgpack

from . import wire
from .errors import RendezvousError
from .records import Barrier, Node, Send

log = logging.getLogger(__name__)

PROGRESS_BYTES = 64 << 10   # the most a saved progress may take (msgpack): it rides on replies
# seconds between a worker's `finish` and the servers failing the rounds it left
# waiting (uneven shards; not elastic): time for its launcher to report a failing exit first
FINISH_GRACE = 1.0


@dataclass
class Joiner:
    """A worker that joined a running job and waits for its ``registered``."""
    node: Node
    ident: bytes          # its control socket
    req_id: object        # its register request
    epoch: int            # the first epoch that lists its process (not yet a member)
    since: float


class WorkerRanks:
    """Worker ranks 0..count-1 and their holders. ``servers`` arguments: the servers
    that have not finished (they hear of every change and acknowledge it).

    Example::

        ranks = WorkerRanks(2, (1, 3))                  # 2 workers now, 1 to 3 allowed
        ranks.fill([worker0, worker1])            # the job formed: epoch 0, members [0, 1]
        sends = ranks.join(worker2, None, b"w2", 7, 5.0, servers)   # epoch 1: rank 2, pending
        sends = ranks.answers(servers, book)      # every server holds epoch 1: its registered
        sends = ranks.release(nodes, servers, 9.0)   # all 3 at a barrier: epoch 2, members
        sends = ranks.answers(servers, None)         # [0, 1, 2]; barrier_done once servers hold 2
        sends, abort = ranks.leave(worker0, "was killed by SIGKILL", True, servers, nodes, 9.5)
    """

    def __init__(self, num_workers: int, elastic: tuple[int, int] | None):
        if elastic is not None:
            low, high = elastic
            if not (type(low) is int and type(high) is int and 1 <= low <= num_workers <= high):
                raise ValueError(f"--elastic {low}:{high} does not fit a job of {num_workers} "
                                 "workers: it needs 1 <= MIN <= the number of workers <= MAX")
        self.bounds = elastic
        self.count = num_workers if elastic is None else elastic[1]
        self.epoch = 0
        self.progress: dict = {}
        self.holders: dict[int, Node] = {}     # rank -> the member holding it
        self.pending: dict[int, Node] = {}     # rank -> a joiner, a member from its first barrier
        self.joiners: dict[str, Joiner] = {}   # node_id -> a joiner not yet answered
        self.barrier = Barrier()               # of the members
        self._held: tuple | None = None        # (epoch, since, barrier_done sends) until servers hold it
        self._told_finished: list[int] = []    # (not elastic) what the servers were told

    @property
    def members(self) -> list[int]:
        return sorted(self.holders)

    @property
    def _elastic(self) -> tuple[int, int]:
        """(MIN, MAX): the bounds, which only an elastic job's ranks ask for."""
        assert self.bounds is not None, "not an elastic job"
        return self.bounds

    @property
    def flag(self) -> str:
        return f"--elastic {self._elastic[0]}:{self._elastic[1]}"

    def fill(self, workers: list[Node]) -> None:
        """The job formed with ``workers`` (ranked): they are the members of epoch 0."""
        self.holders = {n.ranked: n for n in workers}

    def restore(self, holders: list[Node], pending: list[Node], epoch: int, progress: dict,
                told_finished: list[int]) -> None:
        """A restarted scheduler's ranks, as the members reported them
        (:mod:`tracker.control.recovery`): ``holders`` (ranked) are the members of
        ``epoch``, ``pending`` workers joined but are no members yet, the servers
        heard ``told_finished`` finished."""
        self.holders = {n.ranked: n for n in holders}
        self.pending = {n.ranked: n for n in pending}
        self.epoch, self.progress, self._told_finished = epoch, progress, told_finished

    def again(self, node: Node, ident: bytes, req_id) -> bool:
        """A joiner's registration came again: it is answered on that request once the
        servers hold its epoch (True); False: ``node`` is no joiner waiting."""
        joiner = self.joiners.get(node.node_id)
        if joiner is None:
            return False
        joiner.ident, joiner.req_id = ident, req_id
        return True

    def holds(self, node: Node) -> bool:
        """Whether ``node`` holds its rank (a member, or a joiner not yet one)."""
        return node.rank is not None and (self.holders.get(node.rank) is node
                                          or self.pending.get(node.rank) is node)

    def registered(self, node: Node, book: dict, joined: bool = False) -> dict:
        """The fields of ``registered`` for ``node``: ``book`` (servers) and the ranks (``worker_ranks``)."""
        holder = lambda r: self.holders.get(r) or self.pending.get(r)   # noqa: E731
        return {"rank": node.rank, **book, "joined": joined, "num_workers": len(self.holders),
                "worker_ranks": self.count, "progress": self.progress,
                # workers' own endpoints (host groups: kvstore.hostgroup.group), "" where none
                "worker_addrs": [n.addr if (n := holder(r)) else "" for r in range(self.count)],
                "elastic": None if self.bounds is None else list(self.bounds),
                "barriers": self.barrier.released,   # a joiner took part in none of these
                **self.news()}

    def news(self) -> dict:
        """What servers hear of the members (``members``, and an elastic ``ack``):
        the epoch, the ranks and "host:pid" by rank (the processes that may map memory)."""
        holder = lambda r: self.holders.get(r) or self.pending.get(r)   # noqa: E731
        return {"epoch": self.epoch, "members": self.members,
                "workers": [f"{n.host}:{n.pid}" if (n := holder(r)) else "" for r in range(self.count)]}

    def release(self, nodes: dict, servers: list[Node], now: float) -> list[Send]:
        """End the barrier if every member waits (``nodes``: every node by id). The
        joiners waiting at it with the members' token become members (a new epoch):
        no round is in flight at a barrier, so they take part in every round from
        the next one. The servers are told, and the barrier's end is held until
        every server holds that epoch (:meth:`answers`): no push after the barrier
        may reach a server whose rounds would not wait for them."""
        waiting = self.barrier.waiting
        if self._held is not None or any(n.node_id not in waiting for n in self.holders.values()):
            return []
        tokens = {waiting[n.node_id][2] for n in self.holders.values()}
        if len(tokens) > 1:   # the members disagree: it fails for every waiter, and nobody joins
            return self.barrier.release(list(self.holders.values()), nodes)
        joining = [n for n in self.pending.values() if n.node_id in waiting and
                   (not tokens or waiting[n.node_id][2] in tokens)]   # no members: any joiner
        if not self.holders and not joining:
            return []
        # joiners at another barrier wait on (with their deadlines) for the members' next one
        later = {n.node_id: (waiting.pop(n.node_id), self.barrier.deadlines.pop(n.node_id, None))
                 for n in self.pending.values() if n.node_id in waiting and n not in joining}
        for node in joining:
            self.holders[node.ranked] = self.pending.pop(node.ranked)
        if joining:
            self.epoch += 1
            log.info("%s met the others at a barrier: member%s from epoch %d (members %s)",
                     ", ".join(n.name() for n in joining), "s" if len(joining) > 1 else "",
                     self.epoch, ", ".join(map(str, self.members)))
        sends = self.barrier.release(list(self.holders.values()), nodes, epoch=self.epoch,
                                     members=self.members, progress=self.progress)
        for node_id, (waiter, deadline) in later.items():
            waiting[node_id] = waiter
            if deadline is not None:
                self.barrier.deadlines[node_id] = deadline
        if not joining:
            return sends
        self._held = (self.epoch, now, sends)
        return self._tell(servers) + self.answers(servers, None)

    def tell_finished(self, now: float, servers: list[Node]) -> list[Send]:
        """(Not elastic) ``workers_finished`` when the finished workers changed: a sync
        round still waiting for one of them can never complete, and the servers fail it
        at once naming that worker (instead of the others waiting for KVSTORE_TIMEOUT)."""
        ranks = self.finished(now)
        if self.bounds is not None or ranks == self._told_finished:   # elastic: `members`
            return []
        self._told_finished = ranks
        return [Send(s.hb_ident, wire.WORKERS_FINISHED, {"ranks": ranks}) for s in servers
                if s.hb_ident is not None]

    def acknowledgement(self, now: float) -> dict:
        """The fields of the ``ack`` to a server's heartbeat: the finished workers, or
        (elastic) the members, which repairs a lost ``members`` message."""
        return {"workers_finished": self.finished(now)} if self.bounds is None else self.news()

    def finished(self, now: float) -> list[int]:
        """(Not elastic) workers that finished at least FINISH_GRACE seconds ago (or
        whose process ended with status 0). A worker whose script fails after closing
        its store (``sys.exit(1)`` closes it at exit) is reported by its launcher
        within that time, so it is the root cause, not the others' rounds it left waiting."""
        return sorted(n.ranked for n in self.holders.values() if n.finished
                      and (n.finished_at is None or n.finished_at <= now - FINISH_GRACE))

    def save(self, progress) -> None:
        """Store a worker's ``progress`` (a map, at most PROGRESS_BYTES as msgpack)."""
        if not isinstance(progress, dict):
            raise RendezvousError(f"progress must be a map, not {type(progress).__name__}")
        size = len(msgpack.packb(progress, use_bin_type=True))
        if size > PROGRESS_BYTES:
            raise RendezvousError(f"progress of {size} bytes (msgpack) exceeds {PROGRESS_BYTES}: "
                                  "save a small record (counters, a file name), not the state")
        self.progress = progress

    # -- joins and leaves (elastic) ------------------------------------------------
    def join(self, node: Node, rank, ident: bytes, req_id, now: float,
             servers: list[Node]) -> list[Send]:
        """``node`` takes rank ``rank`` (None: the lowest vacant one) in a new epoch
        and waits to be answered; RendezvousError if that rank is out of range or
        taken, or the job is full."""
        node.rank = self._pick(rank)
        self.pending[node.rank] = node
        self.epoch += 1      # the servers learn its process (shared memory), not a member yet
        self.joiners[node.node_id] = Joiner(node, ident, req_id, self.epoch, now)
        log.info("%s joins the job (members %s, epoch %d); it becomes a member at its first "
                 "barrier", node.name(), ", ".join(map(str, self.members)), self.epoch)
        return self._tell(servers)

    def _pick(self, rank) -> int:
        taken = {**self.holders, **self.pending}
        vacant = [r for r in range(self.count) if r not in taken]
        if rank is None:
            if not vacant:
                raise RendezvousError(f"the elastic job is full: all {self.count} worker ranks are "
                                      f"in use ({self.flag}); this worker cannot join")
            return vacant[0]
        if not (type(rank) is int and 0 <= rank < self.count):
            raise RendezvousError(f"worker rank {rank!r} is out of range: this elastic job has "
                                  f"{self.count} worker ranks ({self.flag})")
        if rank in taken:
            free = f"vacant: {', '.join(map(str, vacant))}" if vacant else "none is vacant"
            raise RendezvousError(f"worker rank {rank} is taken by {taken[rank].name()}: "
                                  f"a joining worker needs a vacant rank ({free}) or none")
        return rank

    def leave(self, node: Node, why: str, failure: bool, servers: list[Node],
              nodes: dict, now: float) -> tuple[list[Send], str | None]:
        """``node`` no longer holds its rank: a new epoch without it, and the barrier
        no longer waits for it. Returns the messages to send (to the servers; the
        barrier's end), and for a ``failure`` that leaves fewer than MIN members the
        reason to abort the job instead (nothing if it held no rank)."""
        if not self.holds(node):
            log.info("%s %s after it left the job", node.name(), why)
            return [], None
        rank = node.ranked   # it holds a rank
        self.barrier.leave(node.node_id)
        if self.pending.get(rank) is node:      # a joiner that never became a member
            del self.pending[rank]
            self.joiners.pop(node.node_id, None)
            log.warning("%s left before it became a member: %s; the members stay %s", node.name(),
                        why, ", ".join(map(str, self.members)) or "none")
            return self.release(nodes, servers, now), None
        del self.holders[rank]
        self.joiners.pop(node.node_id, None)
        self.epoch += 1
        n = len(self.holders)
        remain = f"{n} worker{' remains' if n == 1 else 's remain'}"
        if failure and n < self._elastic[0]:
            return [], (f"{node.name()} {why}; {remain}, fewer than the elastic minimum "
                        f"{self._elastic[0]} ({self.flag})")
        if n:   # a failure is a warning; a worker that finished (close()) is news only
            log.log(logging.WARNING if failure else logging.INFO,
                    "%s left the job: %s; %s (members %s, epoch %d): sync rounds now complete "
                    "without it and the effective batch size changes", node.name(), why, remain,
                    ", ".join(map(str, self.members)), self.epoch)
        else:
            log.info("%s left the job: %s; no worker remains", node.name(), why)
        return self._tell(servers) + self.release(nodes, servers, now), None

    def _tell(self, servers: list[Node]) -> list[Send]:
        return [Send(s.hb_ident, wire.MEMBERS, self.news()) for s in servers if s.hb_ident is not None]

    def answers(self, servers: list[Node], book: dict | None) -> list[Send]:
        """What waited for the servers to acknowledge an epoch (to hold it or a later
        one): ``registered`` for each joiner (none without a ``book``), and a barrier's
        end that made joiners members."""
        held = min((s.epoch for s in servers), default=self.epoch)
        sends = []
        if self._held is not None and self._held[0] <= held:
            sends, self._held = self._held[2], None
        if book is None:
            return sends
        for joiner in [j for j in self.joiners.values() if j.epoch <= held]:
            del self.joiners[joiner.node.node_id]
            log.info("%s joined the job: every server holds epoch %d", joiner.node.name(), joiner.epoch)
            sends.append(Send(joiner.ident, wire.REGISTERED,
                              {"id": joiner.req_id, **self.registered(joiner.node, book, joined=True)}))
        return sends

    def held_too_long(self, now: float, timeout: float, servers: list[Node]) -> str | None:
        """Why the job must end when a barrier's end waited ``timeout`` seconds for
        servers to acknowledge the epoch that made joiners members."""
        if self._held is None or now - self._held[1] <= timeout:
            return None
        names = ", ".join(s.name() for s in servers if s.epoch < self._held[0])
        return (f"{names} did not acknowledge membership epoch {self._held[0]} within {timeout:g}s "
                "(KVSTORE_TIMEOUT): the workers that joined cannot start")

    def unanswered(self) -> list[tuple]:
        """(ident, request id) of every request waiting for the servers: joiners'
        registrations and a held barrier's waiters (an abort answers them)."""
        held = [(send.ident, send.fields.get("id")) for send in (self._held[2] if self._held else [])]
        return [(j.ident, j.req_id) for j in self.joiners.values()] + held

    def overdue(self, now: float, timeout: float, servers: list[Node]) -> list[tuple[Node, Send]]:
        """Joiners still unanswered ``timeout`` seconds after they registered, each
        with its error, which names the servers that did not acknowledge its epoch."""
        late = []
        for joiner in [j for j in self.joiners.values() if now - j.since > timeout]:
            del self.joiners[joiner.node.node_id]
            names = ", ".join(f"{s.name()} (at epoch {s.epoch})" for s in servers
                              if s.epoch < joiner.epoch)
            message = (f"{joiner.node.name()} could not join: {names} did not acknowledge membership "
                       f"epoch {joiner.epoch} within {timeout:g}s (KVSTORE_TIMEOUT)")
            error = {"id": joiner.req_id, "kind": wire.TIMEOUT, "message": message}
            late.append((joiner.node, Send(joiner.ident, wire.ERROR, error)))
        return late
