"""The face of a consistency strategy: how a validated push becomes the value and
when a read is answered, for one :class:`~kvstore.modes.ConsistencyMode`.

:class:`~kvstore.server.state.ServerState` validates each request and hands it to
the strategy of the mode chosen at ``configure`` (``kvstore.server.modes.MODES``).
A strategy is a subclass of :class:`Consistency` whose ``mode`` says what it
allows; it implements :meth:`~Consistency.push` and :meth:`~Consistency.pull`, and
overrides the rest where it keeps something waiting. The hooks of what only some
modes allow (:meth:`~Consistency.write`, :meth:`~Consistency.written`,
:meth:`~Consistency.apply_norms`) refuse unless a strategy whose mode allows them
overrides them; the state asks the mode before it calls one.

Pure like the rest of the state machine: no sockets, threads or clocks.
"""

from __future__ import annotations

from typing import ClassVar, Iterator

import numpy as np

from ..errors import InvalidArgumentError, ProtocolError
from ..modes import ConsistencyMode
from .chunks import ChunkTable
from .members import Members
from .server_optimizer import ServerOptimizer
from .replication import Replication
from .rounds import Reply


class Consistency:
    """The strategy of one consistency mode over the chunks of ``table`` for
    ``num_workers`` worker ranks; ``bound``: the staleness bound (a bounded mode's
    only); ``ordered``: deterministic sums (refused unless the mode has them)."""

    mode: ClassVar[ConsistencyMode]     # what it allows (kvstore.modes), shared with the worker
    # the server's replication strategy (kvstore.server.replication), told each applied
    # round by the modes that replicate (dist_sync); the state sets it after configure
    replication: Replication = Replication()

    def __init__(self, table: ChunkTable, num_workers: int, members: Members, optimizer: ServerOptimizer,
                 bound: int | None = None, ordered: bool = False):
        if ordered and not self.mode.ordered_sums:
            raise InvalidArgumentError(f"dist_{self.mode.name} applies each push as it arrives, so the order of "
                                       "updates is the order of arrival: deterministic sums need dist_sync")
        self.table = table
        self.num_workers = num_workers
        self.members = members
        self.optimizer = optimizer
        self.bound = bound            # the staleness bound (None unless the mode is bounded)
        self.ordered = ordered        # a round's pushes are added in worker-rank order

    # -- what every mode answers ------------------------------------------------------------
    def admit(self, worker: int, ids, want_values: bool) -> None:
        """Raise if this push (or write) of ``worker`` to the (existing) chunks ``ids``
        must be refused in this mode; before anything changes."""
        if self.mode.needs_optimizer and self.optimizer.updater is None:
            raise InvalidArgumentError(f"dist_{self.mode.name} applies every push with an optimizer: "
                                       "call set_optimizer() before push")

    def push(self, peer, req_id, worker: int, ids, chunks, arrays, want_values: bool,
             group: frozenset | None, norms: bool = False, rows: list | None = None) -> list[Reply]:
        """A validated push (``want_values``: a pushpull; ``group``: a host's sum;
        ``norms``: a layer-wise one, where the mode splits norms; ``rows``, given only
        when the push has them: per chunk the values a row-sparse push named, a bool
        mask, or None, dense; see :meth:`update`): the replies now ready."""
        raise NotImplementedError

    def pull(self, peer, req_id, worker: int, ids, chunks) -> list[Reply]:
        """A validated pull: the replies now ready (none if it must wait)."""
        raise NotImplementedError

    def update(self, cid, grad, value, rows) -> None:
        """The optimizer's update of chunk ``cid``'s ``value`` by ``grad`` (in place):
        with ``rows`` (a mask of the values a row-sparse push named), MXNet's lazy
        update of those values alone where the optimizer is lazy on dense keys
        (``Updater.update_lazy``)."""
        updater = self.optimizer.updater
        assert updater is not None
        if rows is None:
            updater(cid, grad, value)
        else:
            updater.update_lazy(cid, grad, value, self.table.backend.upload(np.flatnonzero(rows)))

    def adopt(self, cid, rounds: int, last: dict | None = None) -> None:
        """StoredChunk ``cid`` (a promoted replica: kvstore.server.replication) has had
        ``rounds`` rounds (or pushes) applied already; ``last``: per worker, the
        number of its last push applied (where pushes are applied one by one), or
        (where pushes join rounds) the bases of the workers that joined
        (kvstore.server.numbering)."""

    def applied(self, cid) -> tuple[int, dict]:
        """(Replicated servers) the rounds (or pushes) applied to chunk ``cid`` and, where
        pushes are applied one by one, each worker's last push number applied (where
        pushes join rounds: the bases of the workers that joined): what a replica
        rebuilt now must start from."""
        return 0, {}

    def workers_finished(self) -> list[Reply]:
        """The table's ``gone`` workers grew: what waits for them fails."""
        return []

    def left(self, worker: int, message: str) -> list[Reply]:
        """``worker`` left the elastic job: what it was part of goes on without it."""
        return []

    def became_member(self, worker: int) -> None:
        """(Replicated servers) ``worker`` became a member of the elastic job, a new
        process that numbers its pushes from 1 again (kvstore.server.numbering)."""

    def queued_rounds(self) -> Iterator:
        """(chunk id, round) of every round still waiting (for the stall inspector)."""
        return iter(())

    def stalled(self, now: float, after: float) -> list[str]:
        """Readable lines for the reads that waited longer than ``after`` seconds."""
        return []

    # -- what only some modes allow: refused unless overridden ------------------------------
    def write(self, peer, header: dict) -> list[Reply]:
        """``write`` (``mode.write_in``): a co-located worker asks for the sums of its chunks."""
        raise InvalidArgumentError(f"writing in is for uncompressed dist_sync pushes only; "
                                   f"{self.table.name} runs dist_{self.mode.name}")

    def written(self, peer, header: dict) -> list[Reply]:
        """``written`` (``mode.write_in``): a granted write is done."""
        raise ProtocolError(f"'written' names no write granted: {self.table.name} runs dist_{self.mode.name}")

    def apply_norms(self, peer, req_id, ids, chunks, sums, numbers, want_values: bool) -> list[Reply]:
        """``apply_norms`` (``mode.split_norms``): a key's sums of layer-wise terms."""
        raise InvalidArgumentError(f"norms across servers are for dist_sync; {self.table.name} runs "
                                   f"dist_{self.mode.name}")
