"""Where the rows of a row-sparse table live: row ``r`` on server ``r % S``, at
local position ``r // S``.

Round-robin keeps the shards balanced (sizes differ by at most one row) and
spreads the hot rows of a Zipf-distributed id space (small ids are the frequent
ones after hashing-by-frequency) over every server, where contiguous ranges
would pile them on server 0. It is a pure function of (row, S): every worker
and server computes it alone. Used by the workers (split a push or pull by
server) and by the servers (check ownership, address their shard).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgumentError


@dataclass(frozen=True)
class RowLayout:
    """Server ``server`` of ``servers`` holding its share of a ``num_rows`` x
    ``width`` table (``width`` = elements per row)."""
    num_rows: int
    width: int
    server: int
    servers: int

    @property
    def local_rows(self) -> int:
        """How many rows this server holds."""
        return max(0, (self.num_rows - self.server + self.servers - 1) // self.servers)

    def local(self, rows: np.ndarray, what: str) -> np.ndarray:
        """Local positions of global ``rows`` (int64), after checking each is in range
        and held here; names the first bad id."""
        rows = np.asarray(rows)
        if rows.dtype != np.int64 or rows.ndim != 1:
            raise InvalidArgumentError(f"{what}: row ids must be a 1-d int64 array, got {rows.dtype}{rows.shape}")
        bad = np.flatnonzero((rows < 0) | (rows >= self.num_rows) | (rows % self.servers != self.server))
        if len(bad):
            raise InvalidArgumentError(f"{what}: row id {int(rows[bad[0]])} is not one of this server's rows "
                                       f"(server {self.server} of {self.servers}, table of {self.num_rows} rows)")
        return rows // self.servers


def split(rows: np.ndarray, servers: int) -> list[np.ndarray]:
    """Positions in ``rows`` (sorted or not) of each server's rows, in order: the
    ``s``-th array indexes the rows that live on server ``s``."""
    owner = rows % servers
    order = np.argsort(owner, kind="stable")
    bounds = np.searchsorted(owner[order], np.arange(servers + 1))
    return [order[bounds[s]:bounds[s + 1]] for s in range(servers)]
