"""Bounded staleness (``dist_ssp``, Stale Synchronous Parallel; Ho et al., 2013).

The consistency strategy of a server in ``ssp`` mode, pure like the rest of the
state machine (no sockets, threads or clocks). Pushes are applied on arrival, as
in async mode (kvstore.server.asyncmode, which it extends); this file keeps, per
chunk, each worker's **clock** (how many of its pushes to the chunk were applied)
and the reads (pulls, and pushpulls' replies) that must wait.

The rule, per chunk, with staleness bound ``s`` (1 <= s < inf; 0 is sync mode
and inf async mode, chosen by the worker): a read from a worker whose clock is
``c`` when it arrives (after its own push, for a pushpull) is answered once
every worker's clock on that chunk is at least ``c - s``. So a worker that reads
after each step is never more than ``s`` steps ahead of the slowest, and what it
reads holds at least every worker's first ``c - s`` pushes and all of its own. A
read of several chunks waits for all of them and then takes their values at once
(copies: any push may change them later). The threshold is fixed when the read
arrives and clocks only grow, so a chunk that has let a read through never holds
it back again.

A worker that finished never pushes again: a read that waits for it fails,
naming it (at once if it arrives after the scheduler said so, else when it does).

In an elastic job (kvstore.server.members) "every worker" means every member
active on the chunk: a worker that left, or one that joined and has not pushed to
the chunk yet, holds no read back. A joiner's clock on a chunk starts, at its
first push there, at the slowest active member's, so that it runs within the
bound of the others from then on rather than far behind them.

Replicated servers (``KVSTORE_REPLICAS=1``, kvstore.server.replication): pushes
are numbered per (worker, chunk) and replicated one by one as in async mode, so
the backup's replica keeps each worker's last push number applied, which *is*
its clock on the chunk (every push applied once, numbered from 1; elastic
workers, whose clocks start elsewhere, are refused with replicas). A promoted
replica's clocks are those numbers (:meth:`Ssp.adopt`): the reads the workers send
again wait exactly as they would have on the dead server, and a pushpull sent
again whose push was applied already is not counted twice.

Why clocks are per chunk and not per worker step: a server sees pushes, not
steps, and a worker may push a key several times per step or keys in any order;
per chunk, "pushes applied" is exact. A restarted (resumed) server starts every
clock at 0: the checkpoint holds values, not clocks, and the resumed workers all
start counting again from their first push.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidArgumentError
from ..modes import SSP
from ..protocol import chunk_label, error_header, ops
from .asyncmode import Async
from .chunks import ChunkTable
from .members import Members
from .server_optimizer import ServerOptimizer
from .requests import ok, reply_values
from .rounds import Reply


@dataclass
class Read:
    """A pull (or a pushpull's reply) waiting for other workers' clocks."""
    peer: object
    req_id: int
    worker: int
    chunks: list          # chunk ids of the request, in order
    needs: dict           # chunk id -> the clock every worker must reach (unmet ones only)
    op: str = ops.PULL
    seen: float | None = None    # when the stall inspector first saw it (its caller's clock)
    reported: bool = False


class Ssp(Async):
    """Pushes applied on arrival to the chunks of ``table``; the clocks and waiting
    reads of bound ``bound`` (the ``staleness`` of configure, 1 <= bound < inf)."""

    mode = SSP                    # bounded; row-sparse keys are refused at init (SSP.no_rows)

    def __init__(self, table: ChunkTable, num_workers: int, members: Members, optimizer: ServerOptimizer,
                 bound: int | None = None, ordered: bool = False):
        if bound is None:
            raise ValueError("dist_ssp needs a staleness bound")
        super().__init__(table, num_workers, members, optimizer, bound, ordered)
        self.bound: int = bound
        self.clocks: dict[tuple, list[int]] = {}   # chunk id -> pushes applied, by worker
        self.reads: list[Read] = []

    def clock(self, cid) -> list[int]:
        return self.clocks.setdefault(cid, [0] * self.num_workers)

    # -- the strategy ----------------------------------------------------------------------
    def admit(self, worker: int, ids, want_values: bool) -> None:
        super().admit(worker, ids, want_values)
        if want_values:          # its reply would wait for a finished worker
            self.refuse_if_gone(worker, ids, ahead=1)

    def push(self, peer, req_id, worker: int, ids, chunks, arrays, want_values: bool,
             group: frozenset | None, norms: bool = False, rows: list | None = None,
             rounds: list | None = None) -> list[Reply]:
        """``rounds`` (replicated servers): the worker's number of this push of each
        chunk; a chunk whose numbered push was applied already (sent again after a
        failover) is neither applied nor counted again, and a pushpull's read still
        waits as the bound says."""
        pushes = self.numbered(worker, ids, rounds)      # (checked before anything changes)
        for cid in ids:          # a new member's clocks start at its first push
            if self.members.start(worker, cid):
                self.joined(worker, cid)
        self.apply(ids, chunks, arrays, rows, pushes)
        counted = ids if pushes is None else [cid for cid, p in zip(ids, pushes) if p is not None]
        return self.pushed(peer, req_id, worker, ids, want_values, counted)

    def pull(self, peer, req_id, worker: int, ids, chunks) -> list[Reply]:
        return self.read(peer, req_id, worker, ids)

    # -- requests ------------------------------------------------------------------------
    def refuse_if_gone(self, worker: int, ids, ahead: int = 0) -> None:
        """Before anything changes: a read (after ``ahead`` more pushes of its own)
        that would wait for a worker that finished can never be answered."""
        for cid in ids:
            need = self.clock(cid)[worker] + ahead - self.bound
            gone = self._lagging(cid, need, self.table.gone)
            if gone:
                raise InvalidArgumentError(self._gone_message(worker, cid, need, gone))

    def pushed(self, peer, req_id: int, worker: int, ids, want_values: bool, counted=None) -> list[Reply]:
        """A push (``want_values``: a pushpull) of ``worker`` was applied to ``ids``
        (``counted``: those of them it was applied to now, all unless given): advance
        its clocks there; the replies now ready (its own, unless it must wait, and
        the reads that waited for this push)."""
        counted = ids if counted is None else counted
        for cid in counted:
            self.clock(cid)[worker] += 1
        replies = self._release(counted)
        if want_values:
            return self.read(peer, req_id, worker, ids, ops.PUSHPULL) + replies
        return [ok(peer, req_id)] + replies

    def read(self, peer, req_id: int, worker: int, ids, op: str = ops.PULL) -> list[Reply]:
        """A read of ``ids`` by ``worker``: answered now, or parked until the slowest
        worker's clock is within ``bound`` of this worker's on every chunk."""
        self.refuse_if_gone(worker, ids)
        needs = {}
        for cid in ids:
            need = self.clock(cid)[worker] - self.bound
            # (a joiner that has not pushed to cid yet has no clock there: it reads now)
            if self._slowest(cid) < need and self.members.active(worker, cid):
                needs[cid] = need
        waiting = Read(peer, req_id, worker, list(ids), needs, op)
        if needs:
            self.reads.append(waiting)
            return []
        return [self._answer(waiting)]

    # -- replicated servers ------------------------------------------------------------
    def adopt(self, cid, rounds: int, last: dict | None = None) -> None:
        """A promoted replica: its clocks are its workers' last push numbers applied
        (each worker numbers its pushes of a chunk 1, 2, ... and each is applied
        once, so the number of its last one is how many were applied: the clock the
        dead primary had), and the staleness rule goes on from them."""
        super().adopt(cid, rounds, last)
        clock = self.clock(cid)
        for worker, number in (last or {}).items():
            clock[worker] = number

    # -- releasing -----------------------------------------------------------------------
    def _release(self, ids) -> list[Reply]:
        """Answer the parked reads that the clocks of ``ids`` no longer hold back."""
        replies, still = [], []
        for waiting in self.reads:
            for cid in ids:
                if cid in waiting.needs and self._slowest(cid) >= waiting.needs[cid]:
                    del waiting.needs[cid]
            if waiting.needs:
                still.append(waiting)
            else:
                replies.append(self._answer(waiting))
        self.reads = still
        return replies

    def _answer(self, waiting: Read) -> Reply:
        chunks = [self.table.chunks[cid] for cid in waiting.chunks]
        return reply_values(waiting.peer, waiting.req_id, self.table.backend, chunks, True, copy=True)

    def workers_finished(self) -> list[Reply]:
        """The parked reads that wait for a worker that finished fail, naming it."""
        replies, still = [], []
        for waiting in self.reads:
            failed = next(((cid, need, gone) for cid, need in waiting.needs.items()
                           if (gone := self._lagging(cid, need, self.table.gone))), None)
            if failed is None:
                still.append(waiting)
                continue
            message = self._gone_message(waiting.worker, *failed)
            replies.append(Reply(waiting.peer, error_header(waiting.req_id, "RemoteError", message)))
        self.reads = still
        return replies

    def _slowest(self, cid) -> float:
        """The lowest clock on ``cid`` of the members active there (inf if none is)."""
        clock, members = self.clock(cid), self.members
        if members.everyone(len(clock)):
            return min(clock)
        return min((c for w, c in enumerate(clock) if members.active(w, cid)), default=float("inf"))

    # -- elastic members -----------------------------------------------------------------
    def joined(self, worker: int, cid) -> None:
        """A joiner's first push to ``cid`` (before it is counted): its clock there
        starts at the slowest other active member's."""
        clock, members = self.clock(cid), self.members
        others = [c for w, c in enumerate(clock) if w != worker and members.active(w, cid)]
        clock[worker] = min(others, default=clock[worker])

    def left(self, worker: int, message: str) -> list[Reply]:
        """``worker`` left the elastic job: its parked reads get ``message``; the reads
        that waited only for its clock are answered."""
        replies = [Reply(p.peer, error_header(p.req_id, "RemoteError", message))
                   for p in self.reads if p.worker == worker]
        self.reads = [p for p in self.reads if p.worker != worker]
        return replies + self._release(list(self.clocks))

    def _lagging(self, cid, need: int, among) -> list[int]:
        """The workers of ``among`` whose clock on ``cid`` is below ``need``."""
        clock = self.clock(cid)
        return sorted(w for w in among if clock[w] < need)

    def _gone_message(self, worker: int, cid, need: int, gone) -> str:
        clock, many = self.clock(cid), len(gone) > 1
        who = ", ".join(f"{w} (after {clock[w]} push{'es' if clock[w] != 1 else ''})" for w in gone)
        return (f"worker{'s' if many else ''} {who} closed {'their' if many else 'its'} store, but "
                f"worker {worker}'s read of {chunk_label(cid)} waits for every worker to have pushed "
                f"it {need} times ({self._rule()}): every worker must take the same number of steps "
                "(give each the same number of batches, e.g. with kvstore.torch.shard)")

    def _rule(self) -> str:
        return (f"dist_ssp, staleness {self.bound}: no worker reads more than {self.bound} "
                f"step{'s' if self.bound > 1 else ''} ahead of the slowest")

    # -- stall inspector -----------------------------------------------------------------
    def stalled(self, now: float, after: float) -> list[str]:
        """Reads parked longer than ``after`` seconds (each reported once), naming the
        chunk and the workers they wait for; ``now`` is the caller's clock."""
        lines = []
        for waiting in self.reads:
            waiting.seen = now if waiting.seen is None else waiting.seen
            if waiting.reported or now - waiting.seen < after:
                continue
            waiting.reported = True
            cid, need = next(iter(waiting.needs.items()))
            slow = self._lagging(cid, need, [w for w in range(self.num_workers)
                                             if self.members.active(w, cid)])
            lines.append(f"a {waiting.op} of worker {waiting.worker} has waited {now - waiting.seen:.0f}s "
                         f"for worker(s) {', '.join(map(str, slow))} to push {chunk_label(cid)} "
                         f"{need} times ({self._rule()}; they pushed it "
                         f"{', '.join(str(self.clock(cid)[w]) for w in slow)} times)")
        return lines
