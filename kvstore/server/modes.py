"""The consistency modes a server can run in, one strategy class each, chosen by
name at ``configure`` (kvstore.server.state), and the job a server is configured for.

A strategy (a :class:`~kvstore.server.consistency.Consistency` subclass) decides how
a validated push becomes the value and when a read is answered; its ``mode``
(kvstore.modes, shared with the worker) says what the mode allows. ``sync`` merges
pushes into rounds (kvstore.server.sync), ``async`` applies each on arrival
(kvstore.server.asyncmode), ``ssp`` applies on arrival and holds reads within a
staleness bound (kvstore.server.ssp). A new mode is one file with such a
class, its line in kvstore/modes.py, plus one line in :data:`MODES`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..modes import ConsistencyMode
from .asyncmode import Async
from .consistency import Consistency
from .requests import worker_of
from .ssp import Ssp
from .sync import Sync


MODES: dict[str, type[Consistency]] = {
    Sync.mode.name: Sync,
    Async.mode.name: Async,
    Ssp.mode.name: Ssp,
}


@dataclass
class Job:
    """The job a server serves, as configured (or restored from a checkpoint, whose
    ``ssp`` mode waits for configure to bring its bound): its consistency mode and
    worker ranks. Set by :class:`~kvstore.server.state.ServerState`; read by the
    collaborators that act on the mode's behalf (kvstore.server.tables)."""

    mode: ConsistencyMode | None = None
    num_workers: int | None = None

    def worker(self, header: dict) -> int:
        """The sender's worker rank, checked against the configured ranks."""
        assert self.num_workers is not None     # ServerState.handle refuses ops before configure
        return worker_of(header, self.num_workers)
