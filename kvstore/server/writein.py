"""Writing in: co-located workers add their gradients into a server's sums.

Writing in (sync mode, co-located workers, values in shared memory): instead of
pushing a gradient, a worker asks to ``write`` its chunks and is granted, per
chunk, the round's accumulator in our memory, to copy its gradient into (it opens
the round) or add it to (the round has a sum already). One worker writes into a
round at a time; a request is granted all of its chunks at once or waits, so no
two requests can wait on each other. ``written`` ends the grant: the worker then
counts as having pushed, and is answered as a pushpull. Pushes that arrive while a
worker writes into their round are added after it is done.

A write counts as its worker's push from the moment it arrives: the worker's
later pull of those chunks waits for the write's round (read-your-writes), and its
later push or write of a chunk that an earlier write of its own still waits for
is queued behind it, so that each takes its rounds in the order they were sent.

:class:`WriteIn` is a collaborator of the sync strategy
(:class:`kvstore.server.sync.Sync`), whose rounds it writes into: it owns the
writes queued and granted, and answers the ``write`` and ``written`` ops
(docs/protocol.md section 4) once :class:`kvstore.server.state.ServerState` has
checked that the server keeps its sums in shared memory and runs in sync mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..errors import InvalidArgumentError, ProtocolError
from ..protocol import chunk_label, error_header
from .requests import chunk_ids, ok, worker_of
from .rounds import Pending, Reply, is_int

if TYPE_CHECKING:
    from .sync import Sync


@dataclass
class Grant:
    peer: object
    req_id: int
    worker: int
    ids: list             # chunk ids, in order
    chunks: list          # their Chunk
    want_values: bool
    rounds: list = field(default_factory=list)   # the Round written into, per chunk, once granted
    error: str | None = None   # its rounds failed while it wrote: `written` gets this


@dataclass
class HeldPush:
    """A validated sync push queued behind an earlier, not yet granted write of its
    worker on one of its chunks."""
    peer: object
    req_id: int
    worker: int
    ids: list
    chunks: list
    arrays: list
    want_values: bool


class WriteIn:
    """The writes into the rounds of ``rounds`` (the sync strategy): queued ones
    (and pushes held behind them) and granted ones, until ``written``."""

    def __init__(self, rounds: "Sync"):
        self.rounds = rounds
        self.table = rounds.table
        self._queue: list = []      # Grant (write requests) and HeldPush, oldest first
        self._grants: dict = {}     # (worker, write id) -> granted Grant

    def on_write(self, peer, header: dict) -> list[Reply]:
        """A ``write`` request (no buffers, sync mode, shared sums: checked by the
        caller): queued, and granted once its rounds have no other writer."""
        worker = worker_of(header, self.rounds.num_workers)
        ids = chunk_ids(header, None)
        want_values = header.get("values", True)
        if not isinstance(want_values, bool):
            raise ProtocolError("'values' must be true or false")
        chunks = self.table.existing(ids)
        self.rounds.admit(worker, ids, want_values)
        for cid, chunk in zip(ids, chunks):
            pos = self.rounds.round_to_join(chunk, worker)
            if pos < len(chunk.rounds) and chunk.rounds[pos].layerwise:
                raise InvalidArgumentError(f"{chunk_label(cid)}: its round takes layer-wise pushes (norms "
                                           "across servers); a write cannot join it")
        if self.rounds.optimizer.updater is not None:
            for cid, chunk in zip(ids, chunks):
                if chunk.value.dtype.kind != "f":
                    raise InvalidArgumentError(f"{chunk_label(cid)} holds {chunk.value.dtype.name}: "
                                               "optimizers update floating-point values only")
        if (worker, header["id"]) in self._grants or any(
                isinstance(g, Grant) and (g.worker, g.req_id) == (worker, header["id"]) for g in self._queue):
            raise ProtocolError(f"write request id {header['id']} of worker {worker} is already open")
        self._queue.append(Grant(peer, header["id"], worker, ids, chunks, want_values))
        return self.grant_ready()

    # -- a worker's order: a write counts as its push from the moment it arrives --------
    def writing(self, worker: int, cid, chunk) -> bool:
        """Whether ``worker`` has a write on ``cid`` that is granted and not ``written``,
        or queued (or a push queued behind one): its round is still to come."""
        if any(r.writer == worker for r in chunk.rounds):
            return True
        return any(e.worker == worker and cid in e.ids for e in self._queue)

    def ahead(self, worker: int, ids) -> bool:
        """Whether a queued write (or held push) of ``worker`` shares a chunk with ``ids``."""
        if not self._queue:
            return False
        wanted = set(ids)
        return any(e.worker == worker and not wanted.isdisjoint(e.ids) for e in self._queue)

    def hold(self, peer, req_id, worker, ids, chunks, arrays, want_values) -> list[Reply]:
        """Queue a validated push behind its worker's earlier write."""
        self._queue.append(HeldPush(peer, req_id, worker, ids, chunks, arrays, want_values))
        return []

    # -- writes that cannot go on ----------------------------------------------------------
    def fail_queued(self) -> list[Reply]:
        """Every queued write and held push fails: a worker finished, so the rounds
        they would join cannot complete (see Sync.workers_finished)."""
        replies = []
        for entry in self._queue:
            cid, chunk = entry.ids[0], entry.chunks[0]
            pos = self.rounds.round_to_join(chunk, entry.worker)
            replies.append(Reply(entry.peer, error_header(
                entry.req_id, "InvalidArgumentError", self.rounds.gone_message(cid, pos, set()))))
        self._queue = []
        return replies

    def fail_grants_into(self, rnd, message: str) -> None:
        """The grants that wrote into ``rnd`` (which will never be applied) get
        ``message`` at their ``written``."""
        for grant in self._grants.values():
            if any(r is rnd for r in grant.rounds):
                grant.error = grant.error or message

    def leave(self, worker: int) -> list:
        """``worker`` left the job: its queued writes and held pushes are dropped and
        returned (to be answered with an error), its grants forgotten."""
        queued = [entry for entry in self._queue if entry.worker == worker]
        self._queue = [entry for entry in self._queue if entry.worker != worker]
        for key in [key for key in self._grants if key[0] == worker]:
            del self._grants[key]
        return queued

    # -- granting -----------------------------------------------------------------------------
    def grant_ready(self) -> list[Reply]:
        """Grant every queued write whose rounds have no writer now, oldest first; a
        worker's requests on a chunk go in the order they came (a push held behind
        its write joins the rounds once the write is granted)."""
        replies, still = [], []
        behind: dict = {}      # worker -> chunk ids of its requests still queued
        recheck: list = []           # chunks of refused writes: pulls parked behind them go on
        rounds, shared = self.rounds, self.table.backend.shared
        for grant in self._queue:
            blocked = behind.setdefault(grant.worker, set())
            if not blocked.isdisjoint(grant.ids):
                still.append(grant)
                blocked.update(grant.ids)
                continue
            if isinstance(grant, HeldPush):
                replies += rounds.join(grant.peer, grant.req_id, grant.worker, grant.ids,
                                       grant.chunks, grant.arrays, grant.want_values)
                continue
            targets = [next((r for r in chunk.rounds if r.open_to(grant.worker)), None)
                       for chunk in grant.chunks]
            if any(r is not None and r.writer is not None for r in targets):
                still.append(grant)
                blocked.update(grant.ids)
                continue
            accs = [rnd.acc if rnd is not None and rnd.acc is not None else rounds.take_spare(chunk)
                    for chunk, rnd in zip(grant.chunks, targets)]
            private = [cid for cid, acc in zip(grant.ids, accs) if not shared(acc)]
            if private:                        # refuse the whole request; nothing is granted
                for chunk, rnd, acc in zip(grant.chunks, targets, accs):
                    if rnd is None or rnd.acc is not acc:
                        chunk.spare = acc      # give back what was taken for it
                replies.append(Reply(grant.peer, error_header(
                    grant.req_id, "InternalError",
                    f"{self.table.name}: cannot grant worker {grant.worker} a write into "
                    f"{chunk_label(private[0])}: its sum is not in shared memory (none could be "
                    "allocated); set KVSTORE_WRITE_IN=0 to push instead")))
                recheck += zip(grant.ids, grant.chunks)
                continue
            modes = []
            for chunk, rnd, acc in zip(grant.chunks, targets, accs):
                if rnd is None:                # opens the round: copy into a fresh accumulator
                    rnd = rounds.opened(chunk, acc)
                    modes.append("copy")
                else:
                    if rnd.acc is None:        # its first push came in a message
                        rnd.acc = acc
                        np.copyto(rnd.acc, rnd.first)
                        rnd.first = None
                    modes.append("add")
                rnd.writer = grant.worker
                grant.rounds.append(rnd)
            self._grants[(grant.worker, grant.req_id)] = grant
            replies.append(ok(grant.peer, grant.req_id, [r.acc for r in grant.rounds],
                              modes=modes, write_in=True))
        self._queue = still
        for cid, chunk in recheck:
            replies += rounds.release(cid, chunk)
        return replies

    def on_written(self, peer, header: dict) -> list[Reply]:
        """``written``: the grant ends; its worker counts as having pushed and is
        answered as a pushpull once its rounds are applied."""
        worker = worker_of(header, self.rounds.num_workers)
        gid = header.get("grant")
        grant = self._grants.pop((worker, gid), None) if is_int(gid) else None
        if grant is None:
            raise ProtocolError(f"'written' names no write granted to worker {worker}: {gid!r}")
        if grant.error is not None:          # its rounds failed meanwhile (a worker finished)
            return [Reply(peer, error_header(header["id"], "InvalidArgumentError", grant.error))]
        pending = Pending(peer, header["id"], worker, grant.ids, grant.want_values, set(grant.ids))
        for chunk in grant.chunks:
            chunk.waiting.append(pending)
        ready = []
        for cid, chunk, rnd in zip(grant.ids, grant.chunks, grant.rounds):
            rnd.writer = None
            rnd.workers.add(worker)
            for grad in rnd.deferred:          # pushes that came while it wrote
                rnd.acc += grad
            rnd.deferred = []
            pending.rounds[cid] = rnd
            ready += self.rounds.apply_complete(cid, chunk)
        return ready + self.grant_ready()
