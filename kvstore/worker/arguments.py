"""Argument handling every store type shares: keys, values, MXNet's call forms.

:class:`Keys` turns what a user passes to ``init``/``push``/``pull``/...
(a key or a list of keys; an array, a list of arrays per key) into validated
``(KeyInfo, [values])`` groups, and raises the typed errors that name the call
and the key. The stores' ``_do_*`` hooks see only what came through here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .. import precision
from ..devices import arrays
from ..rows import sparse
from ..errors import ArgumentTypeError, InvalidArgumentError

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass(frozen=True)
class KeyInfo:
    """What init() fixed for a key: its shape and dtype (and, in dist mode, chunks);
    ``sparse``: a row-sparse key (kvstore.rows.sparse), pushed as rows, read by row_sparse_pull;
    ``dynamic``: its :class:`~kvstore.DynamicRows` spec when its rows are made by pushes
    and evicted (kvstore.rows.dynamic; shape ``(2**63,) + row_shape``), else None."""
    key: object
    shape: tuple
    dtype: np.dtype
    chunks: tuple = ()
    sparse: bool = False
    dynamic: object = None

    @cached_property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @cached_property
    def dtype_name(self) -> str:
        return self.dtype.name      # (numpy's name property is slow, and checked on every value)


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def check_priority(priority, what: str) -> None:
    if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
        raise ArgumentTypeError(f"{what}: priority must be an int, got {type(priority).__name__}")


class Keys:
    """The keys a store holds and the checks of call arguments against them; a
    collaborator of :class:`kvstore.worker.store.KVStore`, which owns its state: ``infos``
    (key -> KeyInfo, filled by the store's init), ``dtype_names`` (what values must
    be: "bfloat16" keys hold float32) and ``kind`` (int or str, fixed by the first
    init).

    Example::

        keys = Keys()
        pairs = keys.pairs(["w", "b"], [w, b], "push")       # [(key, [values]), ...]
        groups = keys.grouped_pairs(pairs, "push")             # [(KeyInfo, [values]), ...]
    """

    def __init__(self) -> None:
        self.infos: dict[object, KeyInfo] = {}
        self.dtype_names: dict[object, str] = {}
        self.kind: type | None = None
        # kv.set_multi_precision(True): float32 keys also take float16/bfloat16 values
        # and outputs (kvstore.precision); off, a value's dtype must be its key's
        self.low_precision = False

    def check_key(self, key, what: str):
        if isinstance(key, (bool, np.bool_)):
            raise ArgumentTypeError(f"{what}: a key must be an int or a str, not a bool")
        if isinstance(key, np.integer):
            key = int(key)
        kind: type
        if isinstance(key, int):
            if not INT64_MIN <= key <= INT64_MAX:
                raise InvalidArgumentError(f"{what}: int key {key} does not fit in 64 bits")
            kind = int
        elif isinstance(key, str):
            kind = str
        else:
            raise ArgumentTypeError(f"{what}: a key must be an int or a str, got "
                                    f"{type(key).__name__} {key!r}")
        if self.kind is not None and kind is not self.kind:
            raise ArgumentTypeError(f"{what}: key {key!r} is a {kind.__name__} but this store uses "
                                    f"{self.kind.__name__} keys; do not mix int and str keys")
        return key

    def pairs(self, keys, values, what: str, values_name: str = "value") -> list[tuple]:
        """[(key, [values...])] from MXNet's forms: key + value, key + [values],
        [keys] + [values], [keys] + [[values], ...]."""
        if isinstance(keys, (list, tuple)):
            if not isinstance(values, (list, tuple)) or len(values) != len(keys):
                got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
                raise InvalidArgumentError(f"{what}: {len(keys)} keys need a list of {len(keys)} "
                                           f"{values_name}s, got {got}")
            pairs = [(self.check_key(k, what), _as_list(v)) for k, v in zip(keys, values)]
        else:
            pairs = [(self.check_key(keys, what), _as_list(values))]
        kinds = {type(k) for k, _ in pairs}
        if len(kinds) > 1:
            raise ArgumentTypeError(f"{what}: do not mix int and str keys in one call")
        for key, vals in pairs:
            if not vals:
                raise InvalidArgumentError(f"{what}: key {key!r} got an empty list of {values_name}s")
        return pairs

    def info(self, key, what: str) -> KeyInfo:
        info = self.infos.get(key)
        if info is None:
            raise InvalidArgumentError(f"{what}: key {key!r} has not been initialised; call init() first")
        return info

    def check_value(self, info: KeyInfo, value, what: str) -> None:
        if (type(value) is np.ndarray and value.shape == info.shape and value.dtype == info.dtype
                and self.dtype_names.get(info.key) != arrays.BFLOAT16):
            return      # the common case, without the general helpers (~10 us a key)
        if (arrays.is_array(value) and tuple(value.shape) == info.shape
                and arrays.dtype_name(value) == self.dtype_names.get(info.key, info.dtype_name)
                and not sparse.is_sparse_value(value)):
            return      # a torch tensor or cupy array as the key wants (dtype names cached)
        if sparse.is_sparse_value(value):   # push and pushpull make them dense first (_densify)
            raise InvalidArgumentError(f"{what}: key {info.key!r} is dense (initialised with an array); "
                                       "a row-sparse value cannot be an output of a dense key")
        shape, _ = arrays.shape_dtype(value, what)
        if shape != info.shape:
            raise InvalidArgumentError(f"{what}: key {info.key!r} has shape {info.shape}, "
                                       f"got an array of shape {shape}")
        want, got = self.dtype_names.get(info.key, info.dtype.name), arrays.dtype_name(value)
        if got != want and not (self.low_precision and got in precision.WIRE_DTYPES
                                and info.dtype == precision.MASTER):
            hint = (" (float16/bfloat16 values for float32 keys: kv.set_multi_precision(True))"
                    if got in precision.WIRE_DTYPES and info.dtype == precision.MASTER else "")
            raise InvalidArgumentError(f"{what}: key {info.key!r} has dtype {want}, got {got}{hint}")

    def grouped(self, keys, values, what: str) -> list[tuple[KeyInfo, list]]:
        """Validated (info, values) per distinct key; a key listed twice gets both lists."""
        return self.grouped_pairs(self.pairs(keys, values, what), what)

    def grouped_pairs(self, pairs, what: str) -> list[tuple[KeyInfo, list]]:
        """:meth:`grouped` of (key, [values]) pairs from :meth:`pairs`."""
        groups: dict = {}
        for key, vals in pairs:
            info = self.info(key, what)
            if info.sparse:
                raise InvalidArgumentError(f"{what}: key {key!r} is row-sparse: push rows to it and read "
                                           "it with row_sparse_pull")
            for v in vals:
                self.check_value(info, v, what)
            groups.setdefault(key, (info, []))[1].extend(vals)
        return list(groups.values())

    def densify(self, pairs: list[tuple], what: str, written_back: bool = False) -> list[tuple]:
        """``pairs`` (from :meth:`pairs`) with each row-sparse value for a dense key
        made dense, as MXNet sums it (:func:`kvstore.rows.sparse.densified`); the values of
        row-sparse keys stay as they are. ``written_back``: the values are also the
        outputs (pushpull without ``out``), which a row-sparse value cannot be."""
        result = []
        for key, vals in pairs:
            info = self.infos.get(key)
            if info is None or info.sparse or not any(sparse.is_sparse_value(v) for v in vals):
                result.append((key, vals))
                continue
            if written_back:
                raise InvalidArgumentError(f"{what}: key {key!r} got a row-sparse value and no out=; the "
                                           "result cannot be written back into it: pass out=")
            result.append((key, [sparse.densified(v, info.shape, info.dtype, f"{what} of key {key!r}")
                                 if sparse.is_sparse_value(v) else v for v in vals]))
        return result
