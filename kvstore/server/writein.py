"""Writing in: co-located workers add their gradients into a server's sums.

Writing in (sync mode, co-located workers, values in shared memory): instead of
pushing a gradient, a worker asks to ``write`` its chunks and is granted, per
chunk, the round's accumulator in our memory, to copy its gradient into (it opens
the round) or add it to (the round has a sum already). One worker writes into a
round at a time; a request is granted all of its chunks at once or waits, so no
two requests can wait on each other. ``written`` ends the grant: the worker then
counts as having pushed, and is answered as a pushpull. Pushes that arrive while a
worker writes into their round are added after it is done.

:class:`WriteIn` holds the ``write`` and ``written`` ops of
:class:`kvstore.server.state.ServerState`, which keeps the rounds they act on
(docs/protocol.md section 4, ``write`` and ``written``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import InvalidArgumentError, ProtocolError
from ..protocol import chunk_label, error_header
from .rounds import Pending, Reply, Round, is_int


@dataclass
class Grant:
    peer: object
    req_id: int
    worker: int
    ids: list             # chunk ids, in order
    chunks: list          # their Chunk
    want_values: bool
    rounds: list = field(default_factory=list)   # the Round written into, per chunk, once granted


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
        if self.updater is not None:
            for cid, chunk in zip(ids, chunks):
                if chunk.value.dtype.kind != "f":
                    raise InvalidArgumentError(f"{chunk_label(cid)} holds {chunk.value.dtype.name}: "
                                               "optimizers update floating-point values only")
        if (worker, header["id"]) in self._grants or any(
                (g.worker, g.req_id) == (worker, header["id"]) for g in self._queue):
            raise ProtocolError(f"write request id {header['id']} of worker {worker} is already open")
        self._queue.append(Grant(peer, header["id"], worker, ids, chunks, want_values))
        return self._grant_ready()

    def _grant_ready(self) -> list[Reply]:
        """Grant every queued write whose rounds have no writer now, oldest first."""
        replies, still = [], []
        for grant in self._queue:
            targets = [next((r for r in chunk.rounds if r.open_to(grant.worker)), None)
                       for chunk in grant.chunks]
            if any(r is not None and r.writer is not None for r in targets):
                still.append(grant)
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
                continue
            modes = []
            for chunk, rnd, acc in zip(grant.chunks, targets, accs):
                if rnd is None:                # opens the round: copy into a fresh accumulator
                    rnd = Round(acc, set())
                    chunk.rounds.append(rnd)
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
        return replies

    def _on_written(self, peer, header, arrays):
        if arrays:
            raise ProtocolError("a written request carries no buffers")
        worker = self._worker(header)
        gid = header.get("grant")
        grant = self._grants.pop((worker, gid), None) if is_int(gid) else None
        if grant is None:
            raise ProtocolError(f"'written' names no write granted to worker {worker}: {gid!r}")
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
