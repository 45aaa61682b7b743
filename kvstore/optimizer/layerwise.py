"""What LARS, LAMB and LBSGD share: their step depends on norms over the whole key
(a layer), not over the values at hand.

An :class:`~kvstore.optimizer.Optimizer` whose ``needs_whole_keys()`` is true
must see a key's every value in one update: the stores refuse what would show it
part of a key (a row-sparse key's lazy row updates; a dist key cut into chunks
over the servers, unless the optimizer ``splits_norms`` and the job is
dist_sync), and :func:`check_whole` refuses it here too, naming the key, where a
server is handed a chunk other than a key's first in one update. LARS and LAMB
(their base: kvstore.optimizer.layerwise_optimizer) split their update in two: each server computes its chunks' sums of squares
(``Optimizer.norm_terms``), the job's leading worker adds them up per key and
sends the sums back, and each server steps with them (``Optimizer.apply_norms``;
docs/architecture.md §9). MXNet's own LARS on a dist kvstore takes the norms of
each server's slice; here the update is the one-process formula or an error.
"""

from __future__ import annotations

import numpy

__all__ = ["check_whole", "key_name", "norm", "root", "sum_sq"]

# MXNet's LARS leaves parameters named so alone (batch norm's gamma and beta, biases)
EXCLUDED_SUFFIXES = ("gamma", "beta", "bias")


def key_name(index) -> str:
    """The name MXNet gives the weight of updater index ``index``: ``str(key)``; a
    server's index is ``(key, chunk)``."""
    key = index[0] if isinstance(index, tuple) else index
    return "" if key is None else str(key)


def check_whole(owner: str, index, rows) -> None:
    """Raise ValueError where the update would see only part of a key."""
    if rows is not None:
        raise ValueError(f"{owner} scales each key's step by norms over the whole key; a lazy "
                         f"update of some rows (row-sparse key {key_name(index)!r}) cannot")
    if isinstance(index, tuple) and len(index) == 2 and index[1] != 0:
        raise ValueError(f"{owner} needs key {key_name(index)!r} whole, but it is cut into chunks on "
                         "several servers: raise KVSTORE_CHUNK_BYTES above its size")


def sum_sq(a, xp) -> float:
    """The sum of squares of ``a``, accumulated in float64 (a float, on the host)."""
    flat = a.reshape(-1).astype(xp.float64)
    return float(xp.dot(flat, flat)) if flat.size else 0.0


def root(total: float) -> float:
    """The norm from a sum of squares (of one array, or added up over a key's chunks)."""
    return float(numpy.sqrt(total))


def norm(a, xp) -> float:
    return root(sum_sq(a, xp))

