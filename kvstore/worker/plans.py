"""Call plans: what a repeated call's arguments resolved to, kept so that the next
call with the same keys and arrays of the same kind checks them in one pass.

A training loop calls ``kv.pushpull(keys, grads, out=weights)`` (or ``push`` and
``pull``) every step with the same keys and arrays of the same shapes, dtypes and
devices. The first call goes
through every check of :class:`~kvstore.worker.arguments.Keys` (key kinds, keys
initialised, dense keys, each value's shape and dtype, no row-sparse values) and
its resolution is kept as a :class:`CallPlan`: the distinct keys with the positions
of their values, the signature of every value and output that passed
(:func:`signature`), and the chunks' routes to the servers (:class:`Routes`). A later
call is taken by the plan only if its keys are the same keys of the same types, in
the same form (a list of keys with one array each, or one key and one array), and
every value's and output's signature equals the recorded one: then the full checks
would pass again, so nothing they refuse gets through (anything else takes the full
path, which raises its errors or records a new plan).

:class:`Plans` is the one owner of a store's plans. The store calls
:meth:`Plans.clear` whenever what a plan depends on changes: a key initialised, the
optimizer or its learning rate set, compression or multi-precision set (which
changes the dtypes the checks take), optimizer states loaded, the
members of an elastic job changed, the store closed.

Example (what :class:`~kvstore.worker.store.KVStore` does)::

    plans = Plans()
    plan = plans.find(PUSHPULL, keys, grads, outs)
    if plan is None:
        ...                                    # the full checks, then
        plan = plans.record(PUSHPULL, keys, grads, outs, groups)   # None if not plannable
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..devices import arrays
from ..rows import sparse

PLAN_LIMIT = 256       # plans kept per store (e.g. a Trainer's buckets); the oldest goes first


def signature(value) -> tuple:
    """What the argument checks of a value depend on: its type, shape and dtype, and
    for tensors of other libraries their layout (torch's sparse layouts are refused
    where a dense value is needed) and device."""
    kind = type(value)
    if kind is np.ndarray:
        return (kind, value.shape, value.dtype)
    if isinstance(value, np.ndarray):         # a subclass (the host devices' emulated device memory)
        return (kind, value.shape, value.dtype, getattr(value, "device", None))
    if arrays.is_torch(value):
        return (kind, tuple(value.shape), value.dtype, value.layout, value.device)
    return (kind, tuple(value.shape), value.dtype, getattr(value, "device", None))


@dataclass(frozen=True, eq=False)
class Routes:
    """Where a call's chunks go: for each server, the wire ids of its chunks and, for
    each, ``(item, start, stop)``: which of the call's values it is cut from and where
    (``start`` None: the whole value). Computed once per plan."""
    servers: dict        # server -> (wire ids, [(item, start | None, stop)])

    @staticmethod
    def of(infos) -> "Routes":
        servers: dict = {}
        for item, info in enumerate(infos):
            size = info.size
            for chunk in info.chunks:
                ids, cuts = servers.setdefault(chunk.server, ([], []))
                ids.append(chunk.wire_id)
                whole = chunk.start == 0 and chunk.stop == size
                cuts.append((item, None if whole else chunk.start, chunk.stop))
        return Routes(servers)

    def pick(self, flats: list) -> dict[int, tuple[list, list]]:
        """{server: (wire ids, flat slices)} of ``flats`` (one flat array per item):
        what :func:`kvstore.worker.exchange.by_server` returns for them."""
        return {server: (ids, [flats[i] if start is None else flats[i][start:stop] for i, start, stop in cuts])
                for server, (ids, cuts) in self.servers.items()}


@dataclass(frozen=True, eq=False)
class CallPlan:
    """One call's resolution. ``groups``: ``(KeyInfo, positions)`` per distinct key in
    the order first named (a key listed twice has two positions, whose values are
    summed); ``values``/``outs``: the signature of each value and output (``outs``
    None: the call had none; a pull's outputs are its ``values``); ``single``: the
    call named one key, not a list."""
    keys: tuple
    key_types: tuple
    single: bool
    groups: tuple
    values: tuple
    outs: tuple | None

    @property
    def infos(self) -> list:
        return [info for info, _ in self.groups]

    def routes(self) -> Routes:
        """The chunks' routes of this call (made on first use, then kept)."""
        routes = self.__dict__.get("_routes")
        if routes is None:
            routes = Routes.of(self.infos)
            object.__setattr__(self, "_routes", routes)
        return routes

    def takes(self, values, outs) -> bool:
        """Whether ``values`` and ``outs`` (lists, one per key; ``outs`` None) have the
        recorded signatures."""
        if len(values) != len(self.values):
            return False
        if not all(signature(v) == s for v, s in zip(values, self.values)):
            return False
        if outs is None:
            return self.outs is None
        return (self.outs is not None and len(outs) == len(self.outs)
                and all(signature(o) == s for o, s in zip(outs, self.outs)))


def _form(keys, values, outs) -> tuple[tuple, list, list | None, bool] | None:
    """(keys, values, outs, single) of a call in a plannable form, else None."""
    if isinstance(keys, (list, tuple)):
        if not isinstance(values, (list, tuple)) or (outs is not None and not isinstance(outs, (list, tuple))):
            return None
        return tuple(keys), list(values), None if outs is None else list(outs), False
    if isinstance(values, (list, tuple)) or isinstance(outs, (list, tuple)):
        return None
    return (keys,), [values], None if outs is None else [outs], True


class Plans:
    """A store's call plans, by operation and keys (see the module)."""

    def __init__(self, limit: int = PLAN_LIMIT):
        self._plans: dict = {}
        self._limit = limit
        self._also: list = []        # what else forgets with the plans (also_forget)

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        """Forget every plan: what they were made under changed."""
        self._plans.clear()
        for forget in self._also:
            forget()

    def also_forget(self, forget) -> None:
        """Call ``forget()`` whenever the plans are forgotten: what the transport keeps
        of repeated calls (the links' layouts, kvstore/protocol/layouts.py) starts again
        with them."""
        self._also.append(forget)

    def find(self, op: str, keys, values, outs=None) -> tuple[CallPlan, list, list | None] | None:
        """``(plan, values, outs)`` (the values and outputs as lists, one per key) when
        a plan takes this call, else None."""
        form = _form(keys, values, outs)
        if form is None:
            return None
        keys, values, outs, single = form
        try:
            plan = self._plans.get((op, keys, tuple(map(type, keys)), outs is None, single))
        except TypeError:              # an unhashable key: the full checks name it
            return None
        if plan is None or not plan.takes(values, outs):
            return None
        return plan, values, outs

    def record(self, op: str, keys, values, outs, groups: list) -> CallPlan | None:
        """Keep the resolution of a call that passed every check: ``groups``, its
        ``(KeyInfo, [values])`` per distinct key as :meth:`Keys.grouped` made them.
        Calls in other forms, with lists of values for a key, or with values that are
        not dense arrays are not kept (None)."""
        form = _form(keys, values, outs)
        if form is None or not form[0]:      # (a call of no keys does nothing to plan)
            return None
        keys, values, outs, single = form
        every = values + (outs or [])
        if not all(arrays.is_array(v) and not sparse.is_sparse_value(v) for v in every):
            return None
        positions: dict = {}
        for i, k in enumerate(keys):
            positions.setdefault(k, []).append(i)
        if len(groups) != len(positions):
            return None
        try:
            plan = CallPlan(keys, tuple(map(type, keys)), single,
                            tuple((info, tuple(positions[info.key])) for info, _ in groups),
                            tuple(signature(v) for v in values),
                            None if outs is None else tuple(signature(o) for o in outs))
            index = (op, keys, plan.key_types, outs is None, single)
            if len(self._plans) >= self._limit:
                self._plans.pop(next(iter(self._plans)))
            self._plans[index] = plan
        except TypeError:              # a key not hashable as given (never kept)
            return None
        return plan
