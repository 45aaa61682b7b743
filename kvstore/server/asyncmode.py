"""Asynchronous mode (``dist_async``): the consistency strategy that applies every
push on arrival, with the optimizer, and answers every read at once with a copy of
the values as they are.

Nothing waits here, so the face's defaults (kvstore.server.consistency) answer the
rest: finished or departed workers hold nothing back, no round is queued. Pure like
the rest of the state machine (no sockets, threads or clocks); the chunks live in
the server's :class:`~kvstore.server.chunks.ChunkTable`.
"""

from __future__ import annotations

from ..modes import ASYNC
from .consistency import Consistency
from .requests import reply_values
from .rounds import Reply


class Async(Consistency):
    """Every push applied on arrival to the chunks of ``table``."""

    mode = ASYNC                  # no rounds: each push is applied by the optimizer at once

    def push(self, peer, req_id, worker: int, ids, chunks, arrays, want_values: bool,
             group: frozenset | None, norms: bool = False, rows: list | None = None) -> list[Reply]:
        self.apply(ids, chunks, arrays, rows)
        return [reply_values(peer, req_id, self.table.backend, chunks, want_values, copy=True)]

    def apply(self, ids, chunks, arrays, rows: list | None = None) -> None:
        assert self.optimizer.updater is not None          # admit() refused pushes before set_optimizer
        with self.table.backend.batched():    # on a GPU: one launch for the push's updates
            for i, (cid, chunk, grad) in enumerate(zip(ids, chunks, arrays)):
                self.update(cid, grad.reshape(-1), chunk.value, None if rows is None else rows[i])

    def pull(self, peer, req_id, worker: int, ids, chunks) -> list[Reply]:
        return [reply_values(peer, req_id, self.table.backend, chunks, True, copy=True)]
