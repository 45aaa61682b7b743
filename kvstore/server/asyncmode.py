"""Asynchronous mode (``dist_async``): the consistency strategy that applies every
push on arrival, with the optimizer, and answers every read at once with a copy of
the values as they are.

Nothing waits here, so the face's defaults (kvstore.server.consistency) answer the
rest: finished or departed workers hold nothing back, no round is queued.

Replicated servers (``KVSTORE_REPLICAS=1``, kvstore.server.replication): every
applied push goes to the backup (its gradient, the chunk's update count, and the
pushing worker's number of it), and a push is numbered per (worker, chunk) by its
worker (``rounds``): one sent again after a failover whose number was applied
already is answered without being applied again, so every acknowledged push is
applied exactly once. Pure like
the rest of the state machine (no sockets, threads or clocks); the chunks live in
the server's :class:`~kvstore.server.chunks.ChunkTable`.
"""

from __future__ import annotations

from ..errors import InvalidArgumentError
from ..modes import ASYNC
from ..protocol import chunk_label
from .consistency import Consistency
from .requests import reply_values
from .rounds import Reply


class Async(Consistency):
    """Every push applied on arrival to the chunks of ``table``."""

    mode = ASYNC                  # no rounds: each push is applied by the optimizer at once

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._applied: dict = {}      # replicated: chunk id -> pushes applied (the replica's order)
        self._last: dict = {}         # replicated: chunk id -> {worker: its last push number applied}

    def push(self, peer, req_id, worker: int, ids, chunks, arrays, want_values: bool,
             group: frozenset | None, norms: bool = False, rows: list | None = None,
             rounds: list | None = None) -> list[Reply]:
        """``rounds`` (replicated servers): the worker's number of this push of each
        chunk; a chunk whose numbered push was applied already is not applied again."""
        self.apply(ids, chunks, arrays, rows, self.numbered(worker, ids, rounds))
        return [reply_values(peer, req_id, self.table.backend, chunks, want_values, copy=True)]

    def numbered(self, worker: int, ids, rounds: list | None) -> list | None:
        """A push's ``rounds`` (replicated servers: ``worker``'s number of this push of
        each chunk) as :meth:`apply` takes them: per chunk (worker, number), or None
        where that number was applied already (a push sent again after a failover);
        None without numbers. Raises InvalidArgumentError for a number that skips one
        (checked for every chunk before anything changes)."""
        if rounds is None:
            return None
        pushes = []
        for cid, number in zip(ids, rounds):
            last = self._last.get(cid, {}).get(worker, 0)
            if number > last + 1:
                raise InvalidArgumentError(f"{chunk_label(cid)}: worker {worker} pushes its push {number}, but "
                                           f"its last one applied on {self.table.name} is {last}")
            pushes.append((worker, number) if number > last else None)
        return pushes

    def apply(self, ids, chunks, arrays, rows: list | None = None, pushes: list | None = None) -> None:
        """Apply each chunk's gradient; ``pushes``: per chunk (worker, its push number),
        or None where that numbered push was applied already (skipped)."""
        assert self.optimizer.updater is not None          # admit() refused pushes before set_optimizer
        with self.table.backend.batched():    # on a GPU: one launch for the push's updates
            for i, (cid, chunk, grad) in enumerate(zip(ids, chunks, arrays)):
                if pushes is not None:
                    if pushes[i] is None:
                        continue
                    worker, number = pushes[i]
                    self._last.setdefault(cid, {})[worker] = number
                    self._applied[cid] = self._applied.get(cid, 0) + 1
                    self.replication.round_applied(cid, self._applied[cid], grad.reshape(-1), True,
                                                   pusher=(worker, number),
                                                   rows=None if rows is None else rows[i])
                self.update(cid, grad.reshape(-1), chunk.value, None if rows is None else rows[i])

    def adopt(self, cid, rounds: int, last: dict | None = None) -> None:
        self._applied[cid] = rounds
        self._last[cid] = dict(last or {})

    def applied(self, cid) -> tuple[int, dict]:
        return self._applied.get(cid, 0), dict(self._last.get(cid, {}))

    def became_member(self, worker: int) -> None:
        for last in self._last.values():    # its new process numbers its pushes from 1 again
            last.pop(worker, None)

    def pull(self, peer, req_id, worker: int, ids, chunks) -> list[Reply]:
        return [reply_values(peer, req_id, self.table.backend, chunks, True, copy=True)]
