"""The ``local`` store: everything in this process, no network.

Pushed values are summed and either assigned or handed to the optimizer; pulls
copy the stored value out. It is also the oracle the distributed stores are
tested against: a ``local`` store fed every worker's pushes of a round as one
list ends in the same state as ``dist_sync``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import optimizer as _optimizer
from .store import KeyInfo, KVStore, fill_outputs
from ..devices import arrays
from ..rows.sparse import RowSparse
from ..rows.dynamic import DynamicRows
from ..rows.dyntable import DynTable
from ..errors import InvalidArgumentError


class LocalStore(KVStore):
    """In-process store (``kvstore.create("local")``).

    Example::

        kv = kvstore.create("local")
        kv.init(0, np.zeros(3, np.float32))
        kv.push(0, [np.ones(3, np.float32), np.ones(3, np.float32)])   # sums: 2
        w = np.empty(3, np.float32); kv.pull(0, out=w)                 # w == [2, 2, 2]
    """

    def __init__(self, name: str = "local"):
        super().__init__(name)
        self._store: dict[object, np.ndarray] = {}
        self._dyn: dict[object, DynTable] = {}    # keys of dynamic rows (kvstore.rows.dynamic): one table each
        # an Updater (set_optimizer), MXNet's custom updater function (_set_updater), or None
        self._updater: Any = None

    def _merged(self, info: KeyInfo, vals: list, what: str) -> np.ndarray:
        if self._compressor is not None:  # each device's value is compressed on its own
            vals = [self._compressor.roundtrip((info.key, i), arrays.to_numpy(v, what))
                    for i, v in enumerate(vals)]
        return super()._merged(info, vals, what)

    def _set_updater(self, updater) -> None:
        """MXNet's escape hatch: ``updater(key, merged_grad, stored_weight)`` in place."""
        self._updater = updater

    def _do_init(self, items) -> None:
        for key, shape, dtype, value in items:
            self._keys[key] = KeyInfo(key, shape, dtype)
            self._store[key] = np.array(value, dtype=dtype, order="C", copy=True)

    def _do_init_rows(self, items) -> None:
        for key, shape, dtype, spec, rows, data in items:
            if isinstance(spec, DynamicRows):     # one table, as one server holding every row
                self._keys[key] = KeyInfo(key, tuple(shape), dtype, sparse=True, dynamic=spec)
                self._dyn[key] = DynTable(spec, f"key {key!r} in the local store")
                continue
            table = np.zeros(shape, dtype)
            if spec is not None:
                spec.fill(table, np.arange(shape[0], dtype=np.int64))
            table[rows] = data
            self._keys[key] = KeyInfo(key, tuple(shape), dtype, sparse=True)
            self._store[key] = table

    def _do_push_rows(self, items) -> None:
        for info, rows, data in items:
            if info.dynamic is not None:
                if self._updater is not None and not isinstance(self._updater, _optimizer.Updater):
                    raise InvalidArgumentError(f"push of key {info.key!r}: a custom updater function cannot "
                                               "update dynamic rows; use set_optimizer")
                optimizer = None if self._updater is None else self._updater.optimizer
                self._dyn[info.key].apply(rows, data, optimizer, index=info.key)
                continue
            table = self._store[info.key]
            if self._updater is None:
                table[rows] = data                      # the pushed rows only; others keep theirs
            elif isinstance(self._updater, _optimizer.Updater):
                # by the row width, not -1: a push of no rows (an all-zero gradient) is an
                # update of none, which still counts (as on the servers, and in MXNet)
                width = table[0].size if len(table) else 0
                self._updater.update_rows(info.key, rows, data.reshape(len(rows), width),
                                          table.reshape(len(table), width))
            else:                                       # MXNet's custom updater sees a RowSparse
                self._updater(info.key, RowSparse(data, rows, info.shape), table)

    def _do_assign_rows(self, info: KeyInfo, rows: np.ndarray, data: np.ndarray) -> None:
        self._store[info.key][rows] = data

    def _do_pull_rows(self, info: KeyInfo, rows: np.ndarray) -> np.ndarray:
        if info.dynamic is not None:
            return self._dyn[info.key].read(rows).reshape((len(rows),) + info.shape[1:])
        return self._store[info.key][rows]

    def _do_row_stats(self, info: KeyInfo) -> list[dict]:
        return [self._dyn[info.key].stats()]

    def _apply(self, info: KeyInfo, merged: np.ndarray, rows=None) -> None:
        """The merged push of ``info``'s key: assigned, or given to the updater; ``rows``
        (the ids a row-sparse push named, KVStore._lazy_rows): the optimizer's lazy
        update of those rows."""
        stored = self._store[info.key]
        if self._updater is None:
            np.copyto(stored, merged.reshape(info.shape))
        elif rows is not None and isinstance(self._updater, _optimizer.Updater):
            self._updater.update_lazy(info.key, merged.reshape(info.shape), stored, rows)
        else:
            self._updater(info.key, merged.reshape(info.shape), stored)

    def _do_push(self, items, wait_sent: bool = True, rows: dict | None = None) -> None:
        for info, merged in items:
            self._apply(info, merged, (rows or {}).get(info.key))

    def _do_pull_start(self, items, paced: bool = False) -> None:
        for info, targets in items:
            stored = self._store[info.key].reshape(-1)
            flat, direct = arrays.flat_target(targets[0], "pull")
            np.copyto(flat, stored)
            fill_outputs(targets, flat, direct, "pull")

    def _do_pushpull_start(self, items, rows: dict | None = None, paced: bool = False, plan=None) -> None:
        self._do_push([(info, merged) for info, merged, _ in items], rows=rows)
        self._do_pull_start([(info, targets) for info, _, targets in items])

    def _do_set_optimizer(self, optimizer, collective: bool = True, keep_state: bool = False,
                          state_scale: float = 1.0) -> None:
        if keep_state and isinstance(self._updater, _optimizer.Updater):
            self._updater.replace_optimizer(optimizer, state_scale)
            for table in self._dyn.values():
                table.scale_state(state_scale)
        else:
            self._updater = _optimizer.Updater(optimizer)
            for table in self._dyn.values():
                table.reset_state()

    def _get_states(self) -> dict:
        if not isinstance(self._updater, _optimizer.Updater):
            return {}
        # a row-sparse key's state is flat in the updater (as on the servers): the key's shape here
        return {key: {"t": entry["t"], "state": [np.array(s).reshape(self._keys[key].shape)
                                                 for s in entry["state"]]}
                for key, entry in self._updater.get_states().items()}

    def _set_states(self, states: dict) -> None:
        self._updater.set_states({key: {"t": entry["t"], "state": [
            s.reshape(-1) if self._keys[key].sparse else s for s in entry["state"]]}
            for key, entry in states.items()})
