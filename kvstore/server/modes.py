"""The consistency modes a server can run in, one strategy class each, chosen by
name at ``configure`` (kvstore.server.state).

A strategy decides how a validated push becomes the value and when a read is
answered; the state machine validates requests and hands them over. Each class
has the same face (:class:`Consistency`): ``sync`` merges pushes into rounds
(kvstore.server.sync), ``async`` applies each on arrival
(kvstore.server.asyncmode), ``ssp`` applies on arrival and holds reads within a
staleness bound (kvstore.server.staleness). A new mode is one file with such a
class plus one line in :data:`MODES`.
"""

from __future__ import annotations

from typing import Iterator, Protocol

from .asyncmode import Async
from .chunks import ChunkTable
from .members import Members
from .optimizer_slot import ServerOptimizer
from .rounds import Reply
from .staleness import Staleness
from .sync import Sync


class Consistency(Protocol):
    name: str                  # as configure and checkpoints spell it
    applies_on_arrival: bool   # each push applied at once (no rounds)
    takes_rows: bool           # row-sparse keys allowed
    bounded: bool              # configure must carry a staleness bound (1 <= bound < inf)

    @property
    def bound(self) -> int | None:
        """The staleness bound (None unless ``bounded``)."""

    ordered: bool              # a round's pushes are added in worker-rank order (deterministic sums)

    def __init__(self, table: ChunkTable, num_workers: int, members: Members, optimizer: ServerOptimizer,
                 bound: int | None = None, ordered: bool = False) -> None:
        """``ordered``: deterministic sums; a mode that cannot give them raises
        InvalidArgumentError saying why."""

    def admit(self, worker: int, ids, want_values: bool) -> None:
        """Raise if this push (or write) of ``worker`` to the (existing) chunks ``ids``
        must be refused in this mode; before anything changes."""

    def push(self, peer, req_id, worker: int, ids, chunks, arrays, want_values: bool,
             group: frozenset | None) -> list[Reply]:
        """A validated push (``want_values``: a pushpull; ``group``: a host's sum): the replies now ready."""

    def pull(self, peer, req_id, worker: int, ids, chunks) -> list[Reply]:
        """A validated pull: the replies now ready (none if it must wait)."""

    def workers_finished(self) -> list[Reply]:
        """The table's ``gone`` workers grew: what waits for them fails."""

    def left(self, worker: int, message: str) -> list[Reply]:
        """``worker`` left the elastic job: what it was part of goes on without it."""

    def queued_rounds(self) -> Iterator:
        """(chunk id, round) of every round still waiting (for the stall inspector)."""

    def stalled(self, now: float, after: float) -> list[str]:
        """Readable lines for the reads that waited longer than ``after`` seconds."""


MODES: dict[str, type[Consistency]] = {
    Sync.name: Sync,
    Async.name: Async,
    Staleness.name: Staleness,
}
