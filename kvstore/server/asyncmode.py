"""Asynchronous mode (``dist_async``): the consistency strategy that applies every
push on arrival, with the optimizer, and answers every read at once with a copy of
the values as they are.

Pure like the rest of the state machine (no sockets, threads or clocks); the
chunks live in the server's :class:`~kvstore.server.chunks.ChunkTable`.
"""

from __future__ import annotations

from ..errors import InvalidArgumentError
from .chunks import ChunkTable
from .members import Members
from .optimizer_slot import ServerOptimizer
from .requests import reply_values
from .rounds import Reply


class Async:
    """Every push applied on arrival to the chunks of ``table``."""

    name = "async"
    applies_on_arrival = True     # no rounds: each push is applied by the optimizer at once
    takes_rows = True
    bounded = False               # configure carries no staleness bound

    def __init__(self, table: ChunkTable, num_workers: int, members: Members, optimizer: ServerOptimizer,
                 bound: int | None = None, ordered: bool = False):
        if ordered:
            raise InvalidArgumentError(f"dist_{self.name} applies each push as it arrives, so the order of "
                                       "updates is the order of arrival: deterministic sums need dist_sync")
        self.ordered = False          # pushes are not summed: each is applied on arrival
        self.table = table
        self.num_workers = num_workers
        self.members = members
        self.optimizer = optimizer
        self.bound = bound

    def admit(self, worker: int, ids, want_values: bool) -> None:
        if self.optimizer.updater is None:
            raise InvalidArgumentError(f"dist_{self.name} applies every push with an optimizer: "
                                       "call set_optimizer() before push")

    def push(self, peer, req_id, worker: int, ids, chunks, arrays, want_values: bool,
             group: frozenset | None) -> list[Reply]:
        self.apply(ids, chunks, arrays)
        return [reply_values(peer, req_id, self.table.backend, chunks, want_values, copy=True)]

    def apply(self, ids, chunks, arrays) -> None:
        updater = self.optimizer.updater
        assert updater is not None          # admit() refused pushes before set_optimizer
        for cid, chunk, grad in zip(ids, chunks, arrays):
            updater(cid, grad.reshape(-1), chunk.value)

    def pull(self, peer, req_id, worker: int, ids, chunks) -> list[Reply]:
        return [reply_values(peer, req_id, self.table.backend, chunks, True, copy=True)]

    def workers_finished(self) -> list[Reply]:
        return []                # nothing waits for anyone

    def left(self, worker: int, message: str) -> list[Reply]:
        return []

    def queued_rounds(self):
        return iter(())

    def stalled(self, now: float, after: float) -> list[str]:
        return []
