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

import numpy as np

from ..errors import InvalidArgumentError
from ..fileio import read_versioned, write_versioned
from ..protocol.codec import ALLOWED_DTYPES

FORMAT = "kvstore.optimizer_states"
VERSION = 1


def dump(path: str, optimizer: dict | None, states: dict) -> None:
    """Write ``states`` ({key: {"t": int, "state": [arrays]}}) to ``path`` atomically."""
    body = {
        "optimizer": optimizer,
        "states": [[key, int(entry["t"]),
                    [[a.dtype.str, list(a.shape), np.ascontiguousarray(a).tobytes()]
                     for a in entry["state"]]]
                   for key, entry in states.items()],
    }
    write_versioned(path, FORMAT, VERSION, body)


def load(path: str) -> tuple[dict | None, dict]:
    """Read a file written by :func:`dump`. Raises InvalidArgumentError if it is not one."""
    body = read_versioned(path, FORMAT, VERSION, "optimizer-state file")
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
