"""The optimizer-state file: msgpack, no pickle, written atomically.

Layout (a msgpack map)::

    {"format": "kvstore.optimizer_states", "version": 1,
     "optimizer": null | {"name": ..., "params": {...}, "lr_scheduler": ...},
     "states": [[key, t, [[dtype, shape, bytes], ...]], ...]}

``t`` is the number of updates the key has received (it drives learning-rate
schedules and Adam's bias correction). Every store type reads and writes the same
format, so states saved by a ``dist_sync`` job load into a ``local`` store.
"""

from __future__ import annotations

import msgpack
import numpy as np

from .errors import InvalidArgumentError
from .fileio import atomic_write
from .protocol.codec import ALLOWED_DTYPES

FORMAT = "kvstore.optimizer_states"
VERSION = 1


def dump(path: str, optimizer: dict | None, states: dict) -> None:
    """Write ``states`` ({key: {"t": int, "state": [arrays]}}) to ``path`` atomically."""
    body = {
        "format": FORMAT, "version": VERSION, "optimizer": optimizer,
        "states": [[key, int(entry["t"]),
                    [[a.dtype.str, list(a.shape), np.ascontiguousarray(a).tobytes()]
                     for a in entry["state"]]]
                   for key, entry in states.items()],
    }
    with atomic_write(path) as f:
        msgpack.pack(body, f, use_bin_type=True)


def load(path: str) -> tuple[dict | None, dict]:
    """Read a file written by :func:`dump`. Raises InvalidArgumentError if it is not one."""
    try:
        with open(path, "rb") as f:
            body = msgpack.unpack(f, raw=False, strict_map_key=False)
    except (OSError, ValueError, msgpack.UnpackException) as e:
        raise InvalidArgumentError(f"cannot read optimizer states from {path!r}: {e}") from e
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise InvalidArgumentError(f"{path!r} is not a kvstore optimizer-state file")
    if body.get("version") != VERSION:
        raise InvalidArgumentError(f"{path!r} has format version {body.get('version')!r}; "
                                   f"this kvstore reads version {VERSION}")
    states = {}
    try:
        for key, t, arrays in body["states"]:
            parsed = []
            for dtype, shape, data in arrays:
                if dtype not in ALLOWED_DTYPES:
                    raise ValueError(f"dtype {dtype!r} not allowed")
                parsed.append(np.frombuffer(data, dtype=dtype).reshape(shape).copy())
            states[key] = {"t": int(t), "state": parsed}
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"{path!r} is corrupt: {e}") from e
    return body.get("optimizer"), states
