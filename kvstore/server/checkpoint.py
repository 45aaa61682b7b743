"""A server's checkpoint file: its chunks, the optimizer and its state, and the
worker-supplied metadata (e.g. the training step), written atomically.

Layout (msgpack, no pickle)::

    {"format": "kvstore.server_checkpoint", "version": 1, "server": "server 0",
     "mode": "sync", "num_workers": 2, "optimizer": null | {...}, "meta": {...},
     "chunks": [[key, index, dtype, value_bytes, t | null, [state_bytes, ...]], ...]}
"""

from __future__ import annotations

import os

from ..fileio import read_versioned, write_versioned

FORMAT = "kvstore.server_checkpoint"
VERSION = 1


def path_for(directory: str, rank: int) -> str:
    return os.path.join(directory, f"server-{rank}.ckpt")


def save(path: str, snapshot: dict) -> None:
    """Write ``snapshot`` (from ServerState.snapshot) to ``path``: temporary file,
    fsync, rename; a crash leaves the previous checkpoint intact."""
    write_versioned(path, FORMAT, VERSION, snapshot)


def load(path: str) -> dict:
    """Read a checkpoint; InvalidArgumentError if it is missing or not one."""
    return read_versioned(path, FORMAT, VERSION, "server checkpoint",
                          missing=f"no server checkpoint at {path}: cannot resume (was "
                                  "KVSTORE_CHECKPOINT_DIR the same, and did the job save one?)")
