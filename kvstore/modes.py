"""The consistency modes a distributed store runs its servers in, and what each allows.

One :class:`ConsistencyMode` per mode, shared by both ends: the worker's store
(:func:`kvstore.worker.types.server_mode` picks one from the store type) asks it
what to send, the server (``kvstore.server.modes.MODES``: its name -> the strategy
class that runs it, whose ``mode`` it is) asks it what to accept. Neither side tests
which mode it is: each asks for the capability it needs, and everything a mode does
not list is refused (every flag is False unless the mode says otherwise).

Example::

    from kvstore.modes import SYNC, SSP

    SYNC.write_in, SSP.write_in        # -> (True, False)
    SSP.configure_fields(2)            # -> {"mode": "ssp", "staleness": 2}

A new mode is one line here (its name and what it allows) plus its strategy on the
server (docs/architecture.md, "Adding a piece").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConsistencyMode:
    """A consistency mode: its name (as ``configure``, checkpoints and messages spell
    it: ``dist_<name>``) and what it allows."""

    name: str
    rounds: bool = False          # pushes merge into rounds (one push from every worker),
    #                               each applied once; else each push is applied on arrival
    needs_optimizer: bool = False  # every push is applied with an optimizer: set_optimizer() before push
    bounded: bool = False         # configure carries a staleness bound, 1 <= bound < inf
    takes_rows: bool = False      # row-sparse keys and dynamic rows
    write_in: bool = False        # co-located workers write into a round's sums (kvstore.server.sync)
    host_sums: bool = False       # a host's summed push speaks for its workers (kvstore.hostgroup)
    split_norms: bool = False     # layer-wise norms of keys cut over servers (LARS, LAMB)
    ordered_sums: bool = False    # deterministic sums: a round's pushes added in rank order
    why_no_rows: str = ""         # why row-sparse keys are refused (said by worker and server)

    @property
    def no_rows(self) -> str:
        """Why this mode refuses row-sparse keys."""
        return self.why_no_rows or f"row-sparse keys do not work with dist_{self.name}"

    def configure_fields(self, bound) -> dict:
        """The fields of ``configure`` that name this mode (and its staleness ``bound``
        when the mode is bounded)."""
        return {"mode": self.name, **({"staleness": bound} if self.bounded else {})}


SYNC = ConsistencyMode("sync", rounds=True, takes_rows=True, write_in=True, host_sums=True,
                       split_norms=True, ordered_sums=True)
"""``dist_sync`` (BSP): rounds per chunk (kvstore.server.sync)."""

ASYNC = ConsistencyMode("async", needs_optimizer=True, takes_rows=True)
"""``dist_async``: every push applied on arrival (kvstore.server.asyncmode)."""

# a worker sends push_rows only to the servers that hold some of its rows, so a
# server's count of them is no step count
SSP = ConsistencyMode("ssp", needs_optimizer=True, bounded=True, why_no_rows=(
    "row-sparse keys do not work with dist_ssp (0 < staleness < inf): a worker pushes rows only to the "
    "servers that hold them, so servers cannot count its steps; use dist_sync (staleness 0) or "
    "dist_async (inf)"))
"""``dist_ssp`` with 0 < staleness < inf: on arrival, reads held within the bound
(kvstore.server.ssp)."""
