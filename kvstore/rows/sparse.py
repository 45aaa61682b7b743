"""Row-sparse values: MXNet's ``row_sparse`` storage, for embedding tables.

A :class:`RowSparse` of shape ``(R, ...)`` holds ``data[i]`` at row
``indices[i]``; every other row is zero. It is what a row-sparse key is
initialised with, what a push may carry and what ``row_sparse_pull`` fills.

The functions below are the worker-side arithmetic on rows, shared by every
store: turn any accepted gradient (RowSparse, torch sparse COO, dense array, a
list of these) into one ``(rows, data)`` pair with unique sorted rows and
duplicates summed, and check row ids. Everything is checked before anything is
sent or stored, and every error names the key (and the first bad row id).
"""

from __future__ import annotations

import numpy as np

from ..devices import arrays
from ..errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["RowSparse"]


class RowSparse:
    """Rows ``indices`` (int64, shape ``(k,)``) of a ``shape`` array hold ``data``
    (shape ``(k,) + shape[1:]``); every other row is zero. ``data`` and ``indices``
    are numpy arrays or torch CPU tensors, kept as given (no copy).

    Example::

        g = RowSparse(numpy.ones((2, 4), numpy.float32), numpy.array([3, 7]), (10, 4))
        g.todense()[3]        # array([1., 1., 1., 1.], dtype=float32)
    """

    __slots__ = ("data", "indices", "shape")

    def __init__(self, data, indices, shape):
        shape = tuple(int(n) for n in shape)
        if len(shape) < 1 or shape[0] < 0:
            raise InvalidArgumentError(f"RowSparse: shape must be (rows, ...), got {shape}")
        dshape, _ = arrays.shape_dtype(data, "RowSparse data")
        ishape, idtype = arrays.shape_dtype(indices, "RowSparse indices")
        if len(ishape) != 1 or idtype.kind not in "iu":
            raise InvalidArgumentError(f"RowSparse: indices must be a 1-d integer array, got "
                                       f"{idtype}{ishape}")
        if dshape[:1] != ishape or dshape[1:] != shape[1:]:
            raise InvalidArgumentError(f"RowSparse: data of shape {dshape} does not fit {ishape[0]} "
                                       f"rows of a {shape} array (expected {ishape + shape[1:]})")
        self.data, self.indices, self.shape = data, indices, shape

    @classmethod
    def zeros(cls, shape, dtype=np.float32) -> "RowSparse":
        """An all-zero table: no rows stored (initialises a key without materialising it)."""
        shape = tuple(int(n) for n in shape)
        return cls(np.zeros((0,) + shape[1:], dtype), np.zeros(0, np.int64), shape)

    @classmethod
    def from_dense(cls, value) -> "RowSparse":
        """The nonzero rows of a dense ``(R, ...)`` numpy array or torch CPU tensor
        (MXNet's ``tostype('row_sparse')``): e.g. to make a row-sparse key from a
        small table held here, ``kv.init(key, RowSparse.from_dense(w))``."""
        shape, dtype = arrays.shape_dtype(value, "RowSparse.from_dense")
        if len(shape) < 1:
            raise InvalidArgumentError(f"RowSparse.from_dense: needs an array of rows, got shape {shape}")
        rows, data = gradient_rows(value, shape, dtype, "RowSparse.from_dense")
        return cls(data, rows, shape)

    @property
    def dtype(self) -> np.dtype:
        return arrays.shape_dtype(self.data, "RowSparse data")[1]

    def todense(self):
        """The dense ``shape`` array (numpy, or torch when the data is a tensor);
        duplicate rows are summed."""
        rows, data = _host(self, "RowSparse")
        dense = np.zeros(self.shape, data.dtype)
        np.add.at(dense, rows, data)
        if arrays.is_torch(self.data):
            import torch  # the data is a tensor: torch is imported already
            return torch.from_numpy(dense)
        return dense

    def __repr__(self) -> str:
        return f"RowSparse({len(self.indices)} rows of {self.shape}, {self.dtype})"


def is_sparse_value(value) -> bool:
    """A RowSparse, or a torch sparse tensor (e.g. ``nn.Embedding(sparse=True)``'s gradient)."""
    return isinstance(value, RowSparse) or (arrays.is_torch(value) and value.layout != _strided())


def _host(value: RowSparse, what: str) -> tuple[np.ndarray, np.ndarray]:
    rows = arrays.to_numpy(value.indices, f"{what} indices")
    if rows.dtype != np.uint64:      # uint64 stays: check_rows names an id >= 2**63 as it is
        rows = rows.astype(np.int64, copy=False)
    return rows, arrays.to_numpy(value.data, f"{what} data")


def check_rows(rows: np.ndarray, num_rows: int, what: str) -> np.ndarray:
    """``rows`` as int64, after checking every id is an integer in [0, num_rows);
    a float array is taken when every id is a whole number (as MXNet does)."""
    rows = np.asarray(rows)
    if rows.dtype.kind == "f" and num_rows > 1 << 53:   # a dynamic table (kvstore.rows.dynamic): ids up to 2**63
        raise ArgumentTypeError(f"{what}: row ids must be integers, got {rows.dtype} (a float cannot hold "
                                f"every id below {num_rows} exactly)")
    if rows.dtype.kind == "f":      # MXNet's tests pass mx.nd.array ids (float32): whole numbers only
        flat = rows.reshape(-1)
        bad = np.flatnonzero(~np.isfinite(flat) | (flat != np.floor(flat)))
        if len(bad):
            raise ArgumentTypeError(f"{what}: row ids must be whole numbers; {float(flat[bad[0]])!r} is not "
                                    f"({len(bad)} such id(s) in a {rows.dtype} array)")
        out = np.flatnonzero((flat < 0) | (flat >= num_rows))    # before the cast: 1e30 stays 1e30
        if len(out):
            raise InvalidArgumentError(f"{what}: row id {float(flat[out[0]])!r} is out of range "
                                       f"[0, {num_rows}) ({len(out)} bad id(s))")
        rows = flat.astype(np.int64)
    elif rows.dtype.kind not in "iu":
        raise ArgumentTypeError(f"{what}: row ids must be integers, got {rows.dtype}")
    if rows.dtype == np.uint64:     # above 2**63 - 1 an int64 cast would wrap to a negative id
        big = np.flatnonzero(rows.reshape(-1) >= np.uint64(min(num_rows, 1 << 63)))
        if len(big):
            raise InvalidArgumentError(f"{what}: row id {int(rows.reshape(-1)[big[0]])} is out of range "
                                       f"[0, {num_rows}) ({len(big)} bad id(s))")
    rows = rows.astype(np.int64, copy=False).reshape(-1)
    bad = np.flatnonzero((rows < 0) | (rows >= num_rows))
    if len(bad):
        raise InvalidArgumentError(f"{what}: row id {int(rows[bad[0]])} is out of range "
                                   f"[0, {num_rows}) ({len(bad)} bad id(s))")
    return rows


def unique_rows(row_ids, num_rows: int, what: str) -> np.ndarray:
    """The unique sorted rows named by ``row_ids`` (an array or a list of ints; any
    shape, order, duplicates)."""
    ids = np.asarray(row_ids) if isinstance(row_ids, (list, tuple, range)) else arrays.to_numpy(row_ids, what)
    if ids.size == 0:
        ids = ids.astype(np.int64)          # np.asarray([]) is float64
    rows = check_rows(ids, num_rows, what)
    # already unique and sorted (a batch's torch.unique, a pull of a range): as they are;
    # np.unique would sort them again (9 ms for 58,000 ids here, twice a pull)
    return rows if _strictly_increasing(rows) else np.unique(rows)


def _strictly_increasing(rows: np.ndarray) -> bool:
    return rows.size < 2 or bool(np.all(rows[1:] > rows[:-1]))


_LAYERS = 8        # runs of up to this many contributions are summed in layers (see merge)


def merge(parts: list[tuple[np.ndarray, np.ndarray]], row_shape: tuple, dtype) -> tuple[np.ndarray, np.ndarray]:
    """One ``(rows, data)`` from many: the union of the rows, unique and sorted, each
    row the sum of its contributions in the order given (stable, so every store
    sums in the same order and agrees bit for bit)."""
    if not parts:
        return np.zeros(0, np.int64), np.zeros((0,) + tuple(row_shape), dtype)
    rows = np.concatenate([r for r, _ in parts])
    data = np.concatenate([d for _, d in parts]) if len(parts) > 1 else parts[0][1]
    if len(rows) == 0:
        return rows, data.astype(dtype, copy=False)
    if len(parts) == 1 and _strictly_increasing(rows):     # one push of unique sorted rows: itself
        return rows, np.ascontiguousarray(data, dtype=dtype)
    order = np.argsort(rows, kind="stable")
    rows = rows[order]
    starts = np.flatnonzero(np.concatenate(([True], rows[1:] != rows[:-1])))
    if len(starts) == len(rows):          # no duplicates: just the reordering
        return rows, np.ascontiguousarray(data[order], dtype=dtype)
    # Rows named a few times are summed in layers (each row's first contribution, then
    # every row's second, ...): far faster than np.add.reduceat over many short runs.
    # Rows named more often (Zipf's head) take one reduceat over their runs only.
    data = data[order]
    counts = np.diff(np.append(starts, len(rows)))
    out = data[starts].astype(dtype, copy=True)
    depth = np.arange(len(rows)) - np.repeat(starts, counts)      # position within its run
    group = np.repeat(np.arange(len(starts)), counts)
    short = np.repeat(counts <= _LAYERS, counts)
    for k in range(1, min(_LAYERS, int(counts.max()))):
        layer = np.flatnonzero(short & (depth == k))
        out[group[layer]] += data[layer]
    long = np.flatnonzero(counts > _LAYERS)
    if len(long):
        members = np.flatnonzero(~short)
        firsts = np.concatenate(([0], np.cumsum(counts[long])[:-1]))
        out[long] = np.add.reduceat(data[members], firsts, axis=0)
    return rows[starts], out


def gradient_rows(value, shape: tuple, dtype, what: str) -> tuple[np.ndarray, np.ndarray]:
    """One pushed value for a row-sparse key as ``(rows, data)`` host arrays, checked
    against the key's ``shape`` and ``dtype``: a :class:`RowSparse`, a torch sparse COO
    tensor (``nn.Embedding(sparse=True)``'s gradient, sparse_dim 1; uncoalesced
    entries are summed by :func:`merge`), or a dense array (its nonzero rows)."""
    if isinstance(value, RowSparse):
        if value.shape != tuple(shape):
            raise InvalidArgumentError(f"{what}: RowSparse of shape {value.shape}, the key has {tuple(shape)}")
        rows, data = _host(value, what)
    elif arrays.is_torch(value) and value.layout != _strided():
        if value.sparse_dim() != 1 or tuple(value.shape) != tuple(shape):
            raise InvalidArgumentError(f"{what}: sparse tensor of shape {tuple(value.shape)} with "
                                       f"sparse_dim {value.sparse_dim()}; the key needs {tuple(shape)}, sparse_dim 1")
        rows = value._indices()[0].cpu().numpy()
        data = arrays.to_numpy(value._values().detach(), what)
    else:
        vshape, _ = arrays.shape_dtype(value, what)
        if vshape != tuple(shape):
            raise InvalidArgumentError(f"{what}: shape {vshape}, the key has {tuple(shape)}")
        dense = arrays.to_numpy(value, what)
        rows = np.flatnonzero(dense.reshape(len(dense), -1).any(axis=1)) if dense.size else np.zeros(0, np.int64)
        data = dense[rows]
    if np.dtype(data.dtype) != np.dtype(dtype):
        raise InvalidArgumentError(f"{what}: dtype {data.dtype}, the key has {np.dtype(dtype)}")
    return check_rows(rows, shape[0], what), data


def densified(value, shape: tuple, dtype, what: str):
    """A row-sparse ``value`` pushed to a dense key, as MXNet sums it: the dense
    array (zeros outside its rows, duplicate rows summed). A torch sparse tensor
    becomes a dense tensor on its own device; a :class:`RowSparse` a numpy array,
    after the checks of :func:`gradient_rows` (shape, dtype, row ids)."""
    if arrays.is_torch(value):
        if tuple(value.shape) != tuple(shape):
            raise InvalidArgumentError(f"{what}: sparse tensor of shape {tuple(value.shape)}, the key has "
                                       f"{tuple(shape)}")
        return value.to_dense()
    rows, data = gradient_rows(value, shape, dtype, what)
    dense = np.zeros(tuple(shape), dtype)
    np.add.at(dense, rows, data)
    return dense


def named_rows(values: list, num_rows: int, what: str) -> np.ndarray:
    """The unique sorted ids of the rows that row-sparse ``values`` (RowSparse or torch
    sparse tensors) name, whatever their data (a row named with zeros is named: MXNet's
    lazy update moves it); each id checked as :func:`check_rows` does."""
    parts = []
    for v in values:
        if isinstance(v, RowSparse):
            ids = arrays.to_numpy(v.indices, f"{what} indices")
        else:                      # torch: the rows of its stored entries (COO, or made COO)
            import torch  # the value is a tensor: torch is imported already
            coo = v if v.layout == torch.sparse_coo else v.to_sparse_coo()
            ids = coo._indices()[0].cpu().numpy()
        parts.append(check_rows(ids, num_rows, what))
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)


def _strided():
    import torch  # only called with a tensor in hand: torch is imported already
    return torch.strided
