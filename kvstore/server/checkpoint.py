"""A server's checkpoint file: its chunks, the optimizer and its state, and the
worker-supplied metadata (e.g. the training step), written atomically.

Layout (msgpack, no pickle)::

    {"format": "kvstore.server_checkpoint", "version": 1, "server": "server 0",
     "mode": "sync", "num_workers": 2, "optimizer": null | {...}, "meta": {...},
     "chunks": [[key, index, dtype, value_bytes, t | null, [state_bytes, ...]], ...]}
"""

from __future__ import annotations

import os

import msgpack

from ..errors import InvalidArgumentError
from ..fileio import atomic_write

FORMAT = "kvstore.server_checkpoint"
VERSION = 1


def path_for(directory: str, rank: int) -> str:
    return os.path.join(directory, f"server-{rank}.ckpt")


def save(path: str, snapshot: dict) -> None:
    """Write ``snapshot`` (from ServerState.snapshot) to ``path``: temporary file,
    fsync, rename; a crash leaves the previous checkpoint intact."""
    with atomic_write(path) as f:
        msgpack.pack({"format": FORMAT, "version": VERSION, **snapshot}, f, use_bin_type=True)


def load(path: str) -> dict:
    """Read a checkpoint; InvalidArgumentError if it is missing or not one."""
    try:
        with open(path, "rb") as f:
            body = msgpack.unpack(f, raw=False, strict_map_key=False)
    except FileNotFoundError:
        raise InvalidArgumentError(f"no server checkpoint at {path}: cannot resume (was "
                                   "KVSTORE_CHECKPOINT_DIR the same, and did the job save one?)") from None
    except (OSError, ValueError, msgpack.UnpackException) as e:
        raise InvalidArgumentError(f"cannot read the server checkpoint {path}: {e}") from e
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise InvalidArgumentError(f"{path} is not a kvstore server checkpoint")
    if body.get("version") != VERSION:
        raise InvalidArgumentError(f"{path} has checkpoint version {body.get('version')!r}; "
                                   f"this kvstore reads version {VERSION}")
    return body
