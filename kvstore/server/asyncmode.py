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
             group: frozenset | None, norms: bool = False) -> list[Reply]:
        self.apply(ids, chunks, arrays)
        return [reply_values(peer, req_id, self.table.backend, chunks, want_values, copy=True)]

    def apply(self, ids, chunks, arrays) -> None:
        updater = self.optimizer.updater
        assert updater is not None          # admit() refused pushes before set_optimizer
        for cid, chunk, grad in zip(ids, chunks, arrays):
            updater(cid, grad.reshape(-1), chunk.value)

    def pull(self, peer, req_id, worker: int, ids, chunks) -> list[Reply]:
        return [reply_values(peer, req_id, self.table.backend, chunks, True, copy=True)]
