"""Row-sparse keys on the worker side, for every store: what ``init``, ``push`` and
``row_sparse_pull`` turn their arguments into, and how a pull's rows reach the
caller's ``out``. Checks happen here, before anything is sent or stored, and
every error names the key."""

from __future__ import annotations

import numpy as np

from ..devices import arrays
from . import sparse
from .dynamic import DynamicRows
from ..errors import ArgumentTypeError, InvalidArgumentError
from .rowinit import RowInit
from .sparse import RowSparse


def is_rows_init(value) -> bool:
    """Does ``init`` with this value make a row-sparse key?"""
    return isinstance(value, (RowSparse, RowInit, DynamicRows))


def init_parts(value, what: str):
    """``(shape, dtype, initializer or None, rows, data)`` for ``init``; a
    :class:`DynamicRows` is its own initializer (no rows: pushes make them)."""
    if isinstance(value, DynamicRows):
        return (value.shape, np.dtype(value.dtype), value, np.zeros(0, np.int64),
                np.zeros((0,) + value.row_shape, value.dtype))
    if isinstance(value, RowInit):
        width = value.shape[1:]
        return value.shape, np.dtype(value.dtype), value, np.zeros(0, np.int64), np.zeros((0,) + width, value.dtype)
    rows, data = sparse.gradient_rows(value, value.shape, value.dtype, what)
    if len(np.unique(rows)) != len(rows):
        raise InvalidArgumentError(f"{what}: an initial value names a row twice")
    order = np.argsort(rows)
    return value.shape, np.dtype(data.dtype), None, rows[order], np.ascontiguousarray(data[order])


def push_parts(values: list, shape: tuple, dtype, what: str) -> tuple[np.ndarray, np.ndarray]:
    """One worker's push (a value or a list, summed) as unique sorted ``(rows, data)``."""
    parts = [sparse.gradient_rows(v, shape, dtype, f"{what}[{i}]" if len(values) > 1 else what)
             for i, v in enumerate(values)]
    return sparse.merge(parts, shape[1:], dtype)


def assign_parts(value, shape: tuple, dtype, what: str) -> tuple[np.ndarray, np.ndarray]:
    """New values for some rows (a :class:`RowSparse`) as unique sorted ``(rows, data)``;
    a row named twice is an error (which value would win?)."""
    if not isinstance(value, RowSparse):
        raise ArgumentTypeError(f"{what}: expected a RowSparse (the rows and their new values), "
                                f"got {type(value).__name__}")
    rows, data = sparse.gradient_rows(value, shape, dtype, what)
    if len(np.unique(rows)) != len(rows):
        raise InvalidArgumentError(f"{what}: the row ids name a row twice")
    order = np.argsort(rows)
    return rows[order], np.ascontiguousarray(data[order]).reshape((len(rows),) + tuple(shape[1:]))


def per_output(row_ids, outputs: int) -> list:
    """``row_ids`` as one entry per output: a list of arrays is one per output; one
    array, or a list of numbers (ints, or whole floats), serves every output."""
    if isinstance(row_ids, (list, tuple)) and row_ids and \
            not all(isinstance(i, (int, float, np.integer, np.floating)) and not isinstance(i, bool)
                    for i in row_ids):
        return list(row_ids)
    return [row_ids] * outputs


def pull_requests(outs: list, row_ids: list, shape: tuple, dtype, what: str):
    """Check each ``out`` against the key and return the unique sorted rows to fetch
    (the union of every ``row_ids``) and, per out, its rows."""
    if len(outs) != len(row_ids):
        raise InvalidArgumentError(f"{what}: {len(outs)} outputs but {len(row_ids)} row_ids")
    wanted = []
    for i, (out, ids) in enumerate(zip(outs, row_ids)):
        label = f"{what} out[{i}]" if len(outs) > 1 else f"{what} out"
        if isinstance(out, RowSparse):
            if out.shape != tuple(shape):
                raise InvalidArgumentError(f"{label}: RowSparse of shape {out.shape}, the key has {tuple(shape)}")
        else:
            oshape, odtype = arrays.shape_dtype(out, label)
            if arrays.dtype_name(out) == arrays.BFLOAT16:    # (its shape_dtype says float32)
                raise InvalidArgumentError(f"{label}: a bfloat16 output; row-sparse keys are pulled in their dtype "
                                           f"({np.dtype(dtype).name}), also with set_multi_precision (which "
                                           "covers dense keys): pass an output of that dtype")
            if oshape != tuple(shape) or odtype != dtype:
                raise InvalidArgumentError(f"{label}: {odtype}{oshape}, the key holds {np.dtype(dtype)}{tuple(shape)}")
        if ids is None:
            raise ArgumentTypeError(f"{what}: row_ids is required")
        wanted.append(sparse.unique_rows(ids, shape[0], f"{what} row_ids"))
    if len(wanted) == 1:
        union = wanted[0]                   # unique and sorted already
    else:
        union = np.unique(np.concatenate(wanted)) if wanted else np.zeros(0, np.int64)
    return union, wanted


def fill(out, rows: np.ndarray, data: np.ndarray) -> None:
    """Put pulled ``rows`` (unique, sorted) with ``data`` into ``out``: a RowSparse
    then holds exactly them (tensors when it held tensors); a dense array gets them
    and every other row zeroed, as in MXNet."""
    if isinstance(out, RowSparse):
        if arrays.is_torch(out.data) or arrays.is_torch(out.indices):
            import torch  # out holds tensors: torch is imported already
            out.indices, out.data = torch.from_numpy(rows), torch.from_numpy(data)
        else:
            out.indices, out.data = rows, data
        return
    if arrays.is_torch(out):
        import torch
        out.zero_()
        out[torch.from_numpy(rows)] = torch.from_numpy(data).to(out.device)
    else:
        out[...] = 0
        out[rows] = data


def select(rows: np.ndarray, data: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """The data of ``wanted`` (a sorted subset of the sorted ``rows``)."""
    return data[np.searchsorted(rows, wanted)]
