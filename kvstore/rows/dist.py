"""Row-sparse keys of a distributed store: which server gets which rows.

Row ``r`` of a table lives on server ``r % S`` (:mod:`kvstore.rows.layout`), as the
one chunk ``(key, s)`` of that server. A pull asks only the servers that own
the rows it names, and carries only those rows. An async push does the same; a
sync push also sends a header with no rows to every other server, because a
server's round closes when every worker has pushed to it (as MXNet's workers
send empty pushes to the servers whose ranges hold none of their rows).

A key of dynamic rows (:class:`~kvstore.DynamicRows`) goes the same way with its
own ops (``init_dyn``, ``push_dyn``, ``pull_dyn``, ``dyn_stats``), its ids placed
by hash: id ``i`` on server ``splitmix64(i) % S`` (:mod:`kvstore.rows.dynamic`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from . import dynamic as dynrows, layout as rowshard
from .dynamic import DynamicRows
from ..modes import ConsistencyMode
from ..protocol import ops
from ..transport.links import RequestOptions


class DistRows:
    """The row-sparse requests of a DistStore: sent through ``client`` (a
    :class:`kvstore.worker.client.Client`) to servers in ``mode`` (kvstore.modes); init is
    collective through ``collective(token)``, and ``leads()`` says whether this worker
    sends for all."""

    def __init__(self, client, mode: ConsistencyMode, collective: Callable[..., None], leads: Callable[[], bool]):
        self._client, self._mode, self._collective, self._leads = client, mode, collective, leads
        self._dynamic: set = set()          # keys of dynamic rows

    def _placed(self, key, rows: np.ndarray) -> tuple[list[np.ndarray], str, str]:
        """Each server's positions in ``rows``, and the push and pull ops of ``key``."""
        if key in self._dynamic:
            return dynrows.split(rows, self.servers), ops.PUSH_DYN, ops.PULL_DYN
        return rowshard.split(rows, self.servers), ops.PUSH_ROWS, ops.PULL_ROWS

    @property
    def servers(self) -> int:
        return self._client.num_shares     # the job's servers (a replacement serves one of their shares)

    def chunks(self, key) -> list:
        return [[key, s] for s in range(self.servers)]

    def init(self, items: list) -> None:
        """``items``: (key, shape, dtype, spec (RowInit, DynamicRows or None), rows, data).
        Collective, as a dense init: rank 0 sends, nobody returns before the servers
        hold the rows. The store records the keys (kvstore.worker.dist)."""
        self._collective("init rows", items=[f"key {k!r} {tuple(shape)} {np.dtype(dtype).name}"
                                             for k, shape, dtype, *_ in items])
        if self._leads():
            self._send_init(items)
        self._collective("init rows done")
        self._dynamic |= {k for k, _, _, spec, *_ in items if isinstance(spec, DynamicRows)}

    def _send_init(self, items: list) -> None:
        client = self._client
        ids = []
        for key, shape, dtype, spec, rows, data in items:
            if isinstance(spec, DynamicRows):   # no rows: pushes make them
                ids += [client.request(s, ops.INIT_DYN, f"init of dynamic rows key {key!r}", [], chunk=[key, s],
                                       servers=self.servers, spec=spec.to_wire())[0] for s in range(self.servers)]
                continue
            for s, where in enumerate(rowshard.split(rows, self.servers)):
                ids.append(client.request(s, ops.INIT_ROWS, f"init of row-sparse key {key!r}",
                                          [rows[where], np.ascontiguousarray(data[where])], chunk=[key, s],
                                          shape=list(shape), dtype=np.dtype(dtype).name, servers=self.servers,
                                          init=None if spec is None else spec.to_wire())[0])
        client.wait(ids, f"init of {len(items)} row-sparse key(s)")

    def push(self, items: list) -> None:
        """``items``: (key, rows, data) with unique sorted rows, one merged push per key."""
        client, rounds = self._client, self._mode.rounds
        for key, rows, data in items:
            what = f"push of row-sparse key {key!r}"
            placed, push, _ = self._placed(key, rows)
            for s, where in enumerate(placed):
                if len(where) or rounds:       # a round needs every worker's push
                    client.request(s, push, what, [rows[where], np.ascontiguousarray(data[where])],
                                   chunk=[key, s])

    def assign(self, key, rows: np.ndarray, data: np.ndarray) -> None:
        """Set ``rows`` (unique, sorted) to ``data`` on the servers that own them;
        returns once every one of them has."""
        client, what = self._client, f"assign_rows of key {key!r}"
        ids = [client.request(s, ops.SET_ROWS, what, [rows[where], np.ascontiguousarray(data[where])],
                              chunk=[key, s])[0]
               for s, where in enumerate(rowshard.split(rows, self.servers)) if len(where)]
        client.wait(ids, what)

    def pull(self, key, rows: np.ndarray, row_shape: tuple, dtype) -> np.ndarray:
        """The current values of ``rows`` (unique, sorted), after this worker's pushes."""
        client, what = self._client, f"row_sparse_pull of key {key!r}"
        data = np.empty((len(rows),) + tuple(row_shape), dtype)
        ids = []
        placed, _, pull = self._placed(key, rows)
        for s, where in enumerate(placed):
            if len(where):
                ids.append(client.request(s, pull, what, [rows[where]], RequestOptions(on_reply=_into(data, where, what)),
                                          chunk=[key, s])[0])
        client.wait(ids, what)
        return data

    def stats(self, key) -> list[dict]:
        """Each server's counters of a dynamic rows ``key``, after this worker's pushes."""
        client, what = self._client, f"row_stats of key {key!r}"
        found: dict[int, dict] = {}

        def keep(server: int):
            def got(header, values):
                found[server] = dict(header["stats"])
            return got
        ids = [client.request(s, ops.DYN_STATS, what, [], RequestOptions(on_reply=keep(s)), chunk=[key, s])[0]
               for s in range(self.servers)]
        client.wait(ids, what)
        return [found[s] for s in range(self.servers)]


def _into(data: np.ndarray, where: np.ndarray, what: str):
    def fill(header, values):
        (rows,) = values
        data[where] = rows.reshape((len(where),) + data.shape[1:])
    return fill


def gather_states(info, found: dict, servers: int, fresh) -> dict | None:
    """A row-sparse key's optimizer state as whole ``info.shape`` arrays from the
    servers' shards (``found``: (key, server) -> (t, [flat arrays])); ``fresh(s)``
    makes the state of a shard that has none yet. None when no shard has any."""
    entries = [found.get((info.key, s)) for s in range(servers)]
    if all(e is None for e in entries):
        return None
    shards = [e if e is not None else (0, fresh(s)) for s, e in enumerate(entries)]
    width = info.size // info.shape[0] if info.shape[0] else 0
    joined = []
    for i in range(len(shards[0][1])):
        full = np.empty((info.shape[0], width), shards[0][1][i].dtype)
        for s, (_, arrays) in enumerate(shards):
            full[s::servers] = arrays[i].reshape(-1, width)
        joined.append(full.reshape(info.shape))
    return {"t": max(t for t, _ in shards), "state": joined}


def split_states(info, t: int, flats: list, servers: int) -> dict:
    """{server: ([key, server, t, count], [flat arrays])}: a whole state cut into shards."""
    rows = info.shape[0]
    return {s: ([info.key, s, t, len(flats)], [np.ascontiguousarray(f.reshape(rows, -1)[s::servers]).reshape(-1)
                                                for f in flats])
            for s in range(servers)}
