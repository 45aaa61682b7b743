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

:class:`WriteIn` holds the ``write`` and ``written`` ops of
:class:`kvstore.server.state.ServerState`, which keeps the rounds they act on
(docs/protocol.md section 4, ``write`` and ``written``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import InvalidArgumentError, ProtocolError
from ..protocol import chunk_label, error_header
from .rounds import Pending, Reply, is_int


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
    """The write/written ops; a mixin of ServerState, whose chunks, rounds and helpers
    (``_existing``, ``_take_spare``, ``_apply_complete_rounds``, ...) it uses."""

    def _on_write(self, peer, header, arrays):
        if arrays:
            raise ProtocolError("a write request carries no buffers")
        if not self.write_in:
            raise InvalidArgumentError(f"{self.name} keeps its sums in private memory: workers "
                                       "cannot write into them (push instead)")
        if self.mode != "sync" or header.get("compression") is not None:
            raise InvalidArgumentError("writing in is for uncompressed dist_sync pushes only")
        worker = self._worker(header)
        ids = self._chunk_ids(header, None)
        want_values = header.get("values", True)
        if not isinstance(want_values, bool):
            raise ProtocolError("'values' must be true or false")
        chunks = self._existing(ids)
        self._refuse_if_gone(worker, ids)
        if self.updater is not None:
            for cid, chunk in zip(ids, chunks):
                if chunk.value.dtype.kind != "f":
                    raise InvalidArgumentError(f"{chunk_label(cid)} holds {chunk.value.dtype.name}: "
                                               "optimizers update floating-point values only")
        if (worker, header["id"]) in self._grants or any(
                isinstance(g, Grant) and (g.worker, g.req_id) == (worker, header["id"]) for g in self._queue):
            raise ProtocolError(f"write request id {header['id']} of worker {worker} is already open")
        self._queue.append(Grant(peer, header["id"], worker, ids, chunks, want_values))
        return self._grant_ready()

    # -- a worker's order: a write counts as its push from the moment it arrives --------
    def _writing(self, worker: int, cid, chunk) -> bool:
        """Whether ``worker`` has a write on ``cid`` that is granted and not ``written``,
        or queued (or a push queued behind one): its round is still to come."""
        if any(r.writer == worker for r in chunk.rounds):
            return True
        return any(e.worker == worker and cid in e.ids for e in self._queue)

    def _writes_ahead(self, worker: int, ids) -> bool:
        """Whether a queued write (or held push) of ``worker`` shares a chunk with ``ids``."""
        if not self._queue:
            return False
        wanted = set(ids)
        return any(e.worker == worker and not wanted.isdisjoint(e.ids) for e in self._queue)

    def _hold_push(self, peer, req_id, worker, ids, chunks, arrays, want_values) -> list[Reply]:
        self._queue.append(HeldPush(peer, req_id, worker, ids, chunks, arrays, want_values))
        return []

    def _fail_queued(self) -> list[Reply]:
        """Every queued write and held push fails: a worker finished, so the rounds
        they would join cannot complete (see ServerState.workers_finished)."""
        replies = []
        for entry in self._queue:
            cid, chunk = entry.ids[0], entry.chunks[0]
            pos = next((i for i, r in enumerate(chunk.rounds) if r.open_to(entry.worker)),
                       len(chunk.rounds))
            replies.append(Reply(entry.peer, error_header(
                entry.req_id, "InvalidArgumentError", self._gone_message(cid, pos, set()))))
        self._queue = []
        return replies

    def _grant_ready(self) -> list[Reply]:
        """Grant every queued write whose rounds have no writer now, oldest first; a
        worker's requests on a chunk go in the order they came (a push held behind
        its write joins the rounds once the write is granted)."""
        replies, still = [], []
        behind: dict = {}      # worker -> chunk ids of its requests still queued
        recheck = []           # chunks of refused writes: pulls parked behind them go on
        for grant in self._queue:
            blocked = behind.setdefault(grant.worker, set())
            if not blocked.isdisjoint(grant.ids):
                still.append(grant)
                blocked.update(grant.ids)
                continue
            if isinstance(grant, HeldPush):
                replies += self._join_rounds(grant.peer, grant.req_id, grant.worker, grant.ids,
                                             grant.chunks, grant.arrays, grant.want_values)
                continue
            targets = [next((r for r in chunk.rounds if r.open_to(grant.worker)), None)
                       for chunk in grant.chunks]
            if any(r is not None and r.writer is not None for r in targets):
                still.append(grant)
                blocked.update(grant.ids)
                continue
            accs = [rnd.acc if rnd is not None and rnd.acc is not None else self._take_spare(chunk)
                    for chunk, rnd in zip(grant.chunks, targets)]
            private = [cid for cid, acc in zip(grant.ids, accs) if not self._shared(acc)]
            if private:                        # refuse the whole request; nothing is granted
                for chunk, rnd, acc in zip(grant.chunks, targets, accs):
                    if rnd is None or rnd.acc is not acc:
                        chunk.spare = acc      # give back what was taken for it
                replies.append(Reply(grant.peer, error_header(
                    grant.req_id, "InternalError",
                    f"{self.name}: cannot grant worker {grant.worker} a write into "
                    f"{chunk_label(private[0])}: its sum is not in shared memory (none could be "
                    "allocated); set KVSTORE_WRITE_IN=0 to push instead")))
                recheck += zip(grant.ids, grant.chunks)
                continue
            modes = []
            for cid, chunk, rnd, acc in zip(grant.ids, grant.chunks, targets, accs):
                if rnd is None:                # opens the round: copy into a fresh accumulator
                    rnd = self._opened(cid, chunk, acc)
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
            replies.append(self._ok(grant.peer, grant.req_id, [r.acc for r in grant.rounds],
                                    modes=modes, write_in=True))
        self._queue = still
        for cid, chunk in recheck:
            replies += self._release(cid, chunk)
        return replies

    def _on_written(self, peer, header, arrays):
        if arrays:
            raise ProtocolError("a written request carries no buffers")
        worker = self._worker(header)
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
            ready += self._apply_complete_rounds(cid, chunk)
        return ready + self._grant_ready()
