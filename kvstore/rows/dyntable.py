"""One table of dynamic rows (kvstore.rows.dynamic): the rows one server holds of a
:class:`~kvstore.DynamicRows` key, or the whole key in the ``local`` store. The
servers and the local store run this same code, so that a distributed job can be
checked against one process. Pure numpy: no sockets, threads or clocks.

Layout: ``ids`` (sorted int64, the live rows) and ``slab_rows`` (each id's row in
``values``, a slab that doubles when full; freed slab rows are reused, the most
recently freed first). ``last[slab_rows[i]]`` is the round of the row's last update.
Looking up k ids costs O(k log n) (a binary search in ``ids``); a round that
creates or evicts rows rewrites ``ids`` and ``slab_rows`` (O(n), memmove speed).

A round (:meth:`DynTable.apply`) is a transaction: the new rows' values and the
update are computed on copies first, so a round that is refused (budget) or
whose optimizer raises changes nothing, counters included. Then, in this order:
rows evicted for the budget (the least recently updated first, ties to the
smaller id, never a row of this round), the new rows created with their
RowInit value (and fresh optimizer state), every row of the round written, its
``last`` set to the round; then rows not updated for ``evict_after`` rounds are
evicted. The optimizer's state of an evicted row goes with it.

Optimizer state is per slab row: None until the first update with an optimizer
(then made for every live row from its current value, as the Updater makes a
slab row's state at its first update), and fresh (``create_state`` of the row's
initial value) for a row created later. ``t`` counts the table's optimizer
updates, as the Updater counts a chunk's: a new optimizer starts it again.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .dynamic import DynamicRows
from ..errors import InvalidArgumentError

_NEVER = np.iinfo(np.int64).max
CAPACITY = 1024        # slab rows of a new table's slab
COUNTERS = ("created", "evicted_by_age", "evicted_by_budget", "hits", "misses")


class DynTable:
    """The rows of ``spec`` held here; ``label`` names them in errors, e.g.
    ``"key 'emb' on server 1"``.

    Example::

        t = DynTable(DynamicRows(2, budget=2), "key 'e'")
        t.apply(np.array([5, 9]), np.ones((2, 2), np.float32))     # creates 5 and 9
        t.read(np.array([5, 7]))                                    # 7: its initial value, no row made
        t.apply(np.array([11]), np.ones((1, 2), np.float32))        # evicts 5 (ties: smaller id)
    """

    def __init__(self, spec: DynamicRows, label: str, capacity: int = CAPACITY,
                 reserve: Callable[[int], None] | None = None):
        self.spec, self.label = spec, label
        self.init = spec.rowinit()
        self.width, self.dtype = spec.width, np.dtype(spec.dtype)
        # reserve(bytes) before the slab is made or grows; raises to refuse (a server's budget)
        self._reserve = reserve
        self._charge(capacity, 0)
        self.ids = np.zeros(0, np.int64)
        self.slab_rows = np.zeros(0, np.int64)
        self.values = np.zeros((capacity, self.width), self.dtype)
        self.last = np.zeros(capacity, np.int64)
        self.used = 0                             # slab rows handed out so far (the high-water mark)
        self.free = np.zeros(0, np.int64)         # freed slab rows below it, reused last-freed first
        self.state: list[np.ndarray] | None = None    # optimizer state per slab row, (capacity, width) each
        self.t = 0                                # optimizer updates
        self.clock = 0                            # rounds applied
        self.counts = dict.fromkeys(COUNTERS, 0)

    # -- reading ---------------------------------------------------------------------------
    def find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(positions in ``self.ids``, found mask) of sorted-or-not ``ids``."""
        pos = np.searchsorted(self.ids, ids)
        found = pos < len(self.ids)
        found[found] = self.ids[pos[found]] == ids[found]
        return pos, found

    def read(self, ids: np.ndarray) -> np.ndarray:
        """The values of ``ids`` (int64, any order): a row's value, or for an id with no
        row its initial value (no row is made). Counts hits and misses."""
        pos, found = self.find(ids)
        out = np.empty((len(ids), self.width), self.dtype)
        out[found] = self.values[self.slab_rows[pos[found]]]
        missing = np.flatnonzero(~found)
        if len(missing):
            out[missing] = self._initial(ids[missing])
        hits = int(found.sum())
        self.counts["hits"] += hits
        self.counts["misses"] += len(ids) - hits
        return out

    def _initial(self, ids: np.ndarray) -> np.ndarray:
        fresh = np.empty((len(ids), self.width), self.dtype)
        self.init.fill(fresh, ids)
        return fresh

    def stats(self) -> dict:
        """Counters: ``rows`` (live), ``capacity`` (slab rows allocated), ``created``,
        ``evicted`` (= by age + by budget), ``hits`` and ``misses`` (ids pulled that had
        a row, or not), ``rounds`` applied, ``updates`` (the optimizer's t)."""
        c = self.counts
        return {"rows": len(self.ids), "capacity": len(self.values), **c,
                "evicted": c["evicted_by_age"] + c["evicted_by_budget"],
                "rounds": self.clock, "updates": self.t}

    # -- a round -----------------------------------------------------------------------
    def apply(self, ids: np.ndarray, grad: np.ndarray, optimizer=None, index=None) -> None:
        """One round: ``ids`` unique and sorted (int64), ``grad`` their merged rows
        ``(len(ids), width)``. Without an optimizer the rows are assigned ``grad``;
        with one they get its lazy update (``index`` names the table to it). Raises
        InvalidArgumentError (budget) or the optimizer's error, changing nothing."""
        grad = np.ascontiguousarray(grad).reshape(len(ids), self.width)
        pos, found = self.find(ids)
        new = np.flatnonzero(~found)
        old_slab_rows = self.slab_rows[pos[found]]
        victims = self._budget_victims(len(new), pos[found], len(ids))
        w = np.empty((len(ids), self.width), self.dtype)
        w[found] = self.values[old_slab_rows]
        fresh = self._initial(ids[new])
        w[new] = fresh
        row_state = None
        if optimizer is None:
            w[...] = grad
        else:
            row_state = self._row_state(optimizer, found, old_slab_rows, new, fresh, len(ids))
            # the table's count starts at the optimizer's begin_num_update, as the Updater's
            optimizer.update(w, grad, row_state, max(self.t, optimizer.begin_num_update) + 1, index=index, rows=ids)
        # the slab's growth, if the new rows need it, is reserved last: a refusal changes nothing
        more = max(0, len(new) - len(self.free) - len(victims))
        if self.used + more > len(self.values):
            states = len(self.state) if self.state is not None else len(row_state or ())
            self._charge(max(self.used + more, 2 * len(self.values)) - len(self.values), states)
        # -- commit: nothing below raises
        if optimizer is not None and self.state is None:     # the first update: state for every row
            self.state = [s.reshape(len(self.values), self.width)
                          for s in optimizer.create_state(self.values.reshape(-1))]
        self._evict(victims, "evicted_by_budget")
        pos = pos - np.searchsorted(victims, pos)             # less the evicted rows before each (none is a round's)
        slab_rows = np.empty(len(ids), np.int64)
        slab_rows[found] = self.slab_rows[pos[found]]
        slab_rows[new] = self._take_slab_rows(len(new))
        if len(new):                                          # pos[new]: where each new id goes, in order
            self.ids = np.insert(self.ids, pos[new], ids[new])
            self.slab_rows = np.insert(self.slab_rows, pos[new], slab_rows[new])
        self.values[slab_rows] = w
        if row_state is not None:
            assert self.state is not None
            for whole, part in zip(self.state, row_state):
                whole[slab_rows] = part
        self.clock += 1
        self.last[slab_rows] = self.clock
        self.counts["created"] += len(new)
        if optimizer is not None:
            self.t = max(self.t, optimizer.begin_num_update) + 1
        if self.spec.evict_after is not None and len(self.ids):
            stale = np.flatnonzero(self.last[self.slab_rows] <= self.clock - self.spec.evict_after)
            self._evict(stale, "evicted_by_age")

    def _row_state(self, optimizer, found, old_slab_rows, new, fresh, n) -> tuple:
        """The optimizer state of a round's rows, as copies: the table's for rows that
        have one, fresh for new rows (and for every row before the first update)."""
        if self.state is None:
            w_now = np.empty((n, self.width), self.dtype)
            w_now[found] = self.values[old_slab_rows]
            w_now[new] = fresh
            return tuple(s.reshape(n, self.width) for s in optimizer.create_state(w_now.reshape(-1)))
        made = [s.reshape(len(new), self.width) for s in optimizer.create_state(fresh.reshape(-1))]
        parts = []
        for whole, init in zip(self.state, made):
            part = np.empty((n, self.width), whole.dtype)
            part[found] = whole[old_slab_rows]
            part[new] = init
            parts.append(part)
        return tuple(parts)

    def _budget_victims(self, new: int, touched: np.ndarray, n: int) -> np.ndarray:
        """Positions (in ``self.ids``) of the rows to evict so that the round fits the
        budget; raises when it cannot (eviction off, or the round alone is too big)."""
        budget = self.spec.budget
        after = len(self.ids) + new
        if budget is None or after <= budget:
            return np.zeros(0, np.int64)
        if not self.spec.evict:
            raise InvalidArgumentError(
                f"{self.label}: this round would make {after} rows ({len(self.ids)} held + {new} new), past "
                f"the budget of {budget} rows per server, and eviction is off (DynamicRows(evict=False)): "
                "the round was refused, nothing changed")
        if n > budget:
            raise InvalidArgumentError(
                f"{self.label}: one round updates {n} rows, more than the budget of {budget} rows per "
                "server (a round's rows cannot evict each other): the round was refused, nothing changed")
        need = after - budget
        last = self.last[self.slab_rows]
        last[touched] = _NEVER                  # this round's rows stay
        kth = np.partition(last, need - 1)[need - 1]
        below = np.flatnonzero(last < kth)
        ties = np.flatnonzero(last == kth)[:need - len(below)]   # ids are sorted: the smaller first
        return np.sort(np.concatenate([below, ties]))

    def _evict(self, positions: np.ndarray, counter: str) -> None:
        if not len(positions):
            return
        gone = self.slab_rows[positions]
        keep = np.ones(len(self.ids), bool)
        keep[positions] = False
        self.ids, self.slab_rows = self.ids[keep], self.slab_rows[keep]
        self.free = np.concatenate([self.free, gone])
        self.counts[counter] += len(positions)

    def _charge(self, rows: int, states: int) -> None:
        """Reserve the bytes of ``rows`` more slab rows (values, round marks and ``states``
        optimizer state arrays), where a reserve was given."""
        if self._reserve is not None and rows > 0:
            self._reserve(rows * (self.width * self.dtype.itemsize * (1 + states) + 8))

    def _take_slab_rows(self, k: int) -> np.ndarray:
        reused = self.free[len(self.free) - min(k, len(self.free)):][::-1]
        self.free = self.free[:len(self.free) - len(reused)]
        more = k - len(reused)
        if self.used + more > len(self.values):
            self._grow(self.used + more)
        top = np.arange(self.used, self.used + more, dtype=np.int64)
        self.used += more
        return np.concatenate([reused, top])

    def _grow(self, need: int) -> None:
        capacity = max(need, 2 * len(self.values))
        values = np.zeros((capacity, self.width), self.dtype)
        values[:len(self.values)] = self.values
        last = np.zeros(capacity, np.int64)
        last[:len(self.last)] = self.last
        if self.state is not None:
            grown = []
            for s in self.state:
                g = np.zeros((capacity, self.width), s.dtype)
                g[:len(s)] = s
                grown.append(g)
            self.state = grown
        self.values, self.last = values, last

    # -- the optimizer changed ----------------------------------------------------------------
    def reset_state(self) -> None:
        """A new optimizer: the state is made again at its first update, ``t`` starts at 0."""
        self.state, self.t = None, 0

    def scale_state(self, scale: float) -> None:
        """New hyper-parameters, state kept, multiplied by ``scale`` (set_learning_rate)."""
        if self.state is not None and scale != 1.0:
            for s in self.state:
                s *= scale

    # -- checkpoints -----------------------------------------------------------------------
    def snapshot(self) -> dict:
        """Everything that decides what comes next, rows in id order (msgpack-able)."""
        slab_rows = self.slab_rows
        return {"ids": self.ids.tobytes(), "values": self.values[slab_rows].tobytes(),
                "last": self.last[slab_rows].tobytes(), "t": self.t, "clock": self.clock,
                "counts": dict(self.counts),
                "state": None if self.state is None else
                [[s.dtype.str, s[slab_rows].tobytes()] for s in self.state]}

    @classmethod
    def restore(cls, spec: DynamicRows, label: str, snap: dict,
                reserve: Callable[[int], None] | None = None) -> "DynTable":
        """The table :meth:`snapshot` described (slab rows renumbered in id order: a
        table's behaviour never depends on which slab row a row has)."""
        ids = np.frombuffer(snap["ids"], np.int64).copy()
        n = len(ids)
        table = cls(spec, label, capacity=max(CAPACITY, n), reserve=reserve)
        values = np.frombuffer(snap["values"], table.dtype)
        last = np.frombuffer(snap["last"], np.int64)
        if values.size != n * table.width or last.size != n or \
                (n > 1 and not np.all(ids[1:] > ids[:-1])) or (n and ids[0] < 0):
            raise InvalidArgumentError(f"{label}: the checkpoint's dynamic rows are inconsistent "
                                       f"({n} ids, {values.size} values, {last.size} round marks)")
        table.ids, table.slab_rows, table.used = ids, np.arange(n, dtype=np.int64), n
        table.values[:n] = values.reshape(n, table.width)
        table.last[:n] = last
        table.t, table.clock = int(snap["t"]), int(snap["clock"])
        table.counts.update({k: int(snap["counts"][k]) for k in COUNTERS})
        if snap["state"] is not None:
            table.state = []
            for dtype, data in snap["state"]:
                s = np.zeros((len(table.values), table.width), np.dtype(dtype))
                s[:n] = np.frombuffer(data, np.dtype(dtype)).reshape(n, table.width)
                table.state.append(s)
        return table
