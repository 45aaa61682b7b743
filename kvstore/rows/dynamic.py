"""Dynamic row tables: rows that live and die (the spec and where rows go).

A row-sparse key made with :class:`DynamicRows` has no fixed number of rows: its
ids are any int64 in ``[0, 2**63)`` (a user id, a feature cross: no hashing into a
fixed table, so no collisions). A row is created by the first push that names it,
with its :class:`~kvstore.RowInit` value (a pure function of (seed, id, column)),
and evicted when it was not updated for ``evict_after`` rounds, or, the least
recently updated first, when a server's table would pass ``budget`` rows. Pulling
an id that has no row returns its initial value without creating it.

Row ``id`` lives on server ``splitmix64(id) % S`` (:func:`owner`): the ids of a
real id space are anything but uniform (sequential user ids, crosses of small
numbers), and their hash spreads them evenly. Pure functions, used by the workers
(split a push or pull by server) and by the servers (check ownership).

Example::

    kv.init("users", kvstore.DynamicRows(16, init=("normal", 0.01), budget=1_000_000, evict_after=1000))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgumentError
from .rowinit import KINDS, RowInit, _splitmix64

__all__ = ["DynamicRows", "ID_LIMIT", "owner", "split"]

ID_LIMIT = 1 << 63          # ids are int64 in [0, ID_LIMIT): every non-negative int64


def _count(value, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise InvalidArgumentError(f"DynamicRows: {what} must be an int >= 1 or None, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class DynamicRows:
    """A row-sparse key whose rows are created on first push and evicted.

    ``row_shape``: the shape of one row (an int is a width); ``dtype`` a float
    type; ``init``: ``(kind, scale)`` of the rows' initial value, kind "zeros",
    "normal" or "uniform" as :class:`~kvstore.RowInit`, with ``seed``.

    ``budget``: the most rows one server holds (None: no limit). When a round
    would pass it, the rows updated least recently (ties: the smaller id) are
    evicted to make room if ``evict`` is True; with ``evict=False`` the round is
    refused (InvalidArgumentError naming the key, server, budget and count) and
    nothing changes. ``evict_after``: a row not updated for this many rounds of
    its server is evicted at the end of the round that makes it so (None: never).
    A round is one sync round (one push from every worker), or one push in
    ``dist_async`` and in the ``local`` store.
    """
    row_shape: tuple
    dtype: str = "float32"
    init: tuple = ("zeros", 0.0)
    seed: int = 0
    budget: int | None = None
    evict_after: int | None = None
    evict: bool = True

    def __post_init__(self):
        shape = (self.row_shape,) if isinstance(self.row_shape, (int, np.integer)) else self.row_shape
        try:
            shape = tuple(int(n) for n in shape)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"DynamicRows: row_shape must be an int or a tuple of ints, "
                                       f"got {self.row_shape!r}") from None
        if not shape or min(shape) < 1:
            raise InvalidArgumentError(f"DynamicRows: row_shape must hold sizes >= 1, got {shape}")
        object.__setattr__(self, "row_shape", shape)
        object.__setattr__(self, "dtype", np.dtype(self.dtype).name)
        if not (isinstance(self.init, (tuple, list)) and len(self.init) == 2 and self.init[0] in KINDS):
            raise InvalidArgumentError(f"DynamicRows: init must be (kind, scale) with kind one of "
                                       f"{', '.join(KINDS)}, got {self.init!r}")
        object.__setattr__(self, "init", (str(self.init[0]), float(self.init[1])))
        object.__setattr__(self, "budget", _count(self.budget, "budget"))
        object.__setattr__(self, "evict_after", _count(self.evict_after, "evict_after"))
        if not isinstance(self.evict, bool):
            raise InvalidArgumentError(f"DynamicRows: evict must be True or False, got {self.evict!r}")
        self.rowinit()           # checks kind, scale, dtype and seed

    @property
    def shape(self) -> tuple:
        """The key's nominal shape: ``(2**63,) + row_shape`` (what a RowSparse of it says)."""
        return (ID_LIMIT,) + self.row_shape

    @property
    def width(self) -> int:
        """Elements per row."""
        return math.prod(self.row_shape)      # Python ints: a declared row shape cannot wrap

    def rowinit(self) -> RowInit:
        """The rows' initial values: row ``id`` starts as RowInit's row ``id``."""
        return RowInit(self.init[0], self.init[1], self.shape, self.dtype, self.seed)

    def to_wire(self) -> dict:
        return {"row_shape": list(self.row_shape), "dtype": self.dtype, "init": list(self.init),
                "seed": int(self.seed), "budget": self.budget, "evict_after": self.evict_after,
                "evict": self.evict}

    @classmethod
    def from_wire(cls, spec) -> "DynamicRows":
        fields = {"row_shape", "dtype", "init", "seed", "budget", "evict_after", "evict"}
        if not isinstance(spec, dict) or set(spec) != fields:
            raise InvalidArgumentError(f"bad dynamic rows spec {spec!r}")
        if not isinstance(spec["row_shape"], list) or not isinstance(spec["init"], list):
            raise InvalidArgumentError(f"bad dynamic rows spec {spec!r}")
        return cls(tuple(spec["row_shape"]), spec["dtype"], tuple(spec["init"]), spec["seed"],
                   spec["budget"], spec["evict_after"], spec["evict"])

    def describe(self) -> str:
        budget = "no budget" if self.budget is None else \
            f"budget {self.budget} rows per server ({'evicting' if self.evict else 'refusing'} past it)"
        age = "" if self.evict_after is None else f", evicted after {self.evict_after} rounds unused"
        return f"dynamic rows of {self.row_shape} {self.dtype}, {budget}{age}"


def owner(ids: np.ndarray, servers: int) -> np.ndarray:
    """The server of each id: ``splitmix64(id) % servers`` (int64)."""
    return (_splitmix64(np.asarray(ids, dtype=np.int64).astype(np.uint64)) % np.uint64(servers)).astype(np.int64)


def split(ids: np.ndarray, servers: int) -> list[np.ndarray]:
    """Positions in ``ids`` of each server's ids, in order (as :func:`kvstore.rows.layout.split`;
    sorted ids stay sorted within each server)."""
    who = owner(ids, servers)
    order = np.argsort(who, kind="stable")
    bounds = np.searchsorted(who[order], np.arange(servers + 1))
    return [order[bounds[s]:bounds[s + 1]] for s in range(servers)]

