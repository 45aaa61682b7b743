"""Every chunk one server holds, in one table that the server's collaborators share.

A chunk is a piece of one key's value (``(key, index)``; a row-sparse table's rows
on this server are one flat chunk ``(key, server)``). The table owns the chunks
and the facts about them that more than one collaborator reads: where values live
(the backend), which chunks came from a checkpoint and wait for their init to
confirm them, which are row-sparse tables (dense ops refuse those), and which
workers finished (no push of theirs will ever come). The collaborators that act
on chunks own the rest: the sync rounds and write-in grants
(kvstore.server.sync, kvstore.server.write_in), the ssp clocks
(kvstore.server.ssp), the row tables (kvstore.server.tables).
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgumentError
from ..protocol import chunk_label
from .rounds import StoredChunk


class ChunkTable:
    """The chunks of the server called ``name``, their values in ``backend``
    (kvstore.server.backend).

    Example::

        table = ChunkTable("server 0", HostBackend())
        table.init([("w", 0)], [np.zeros(4, np.float32)])
        table.existing([("w", 0)])[0].value      # -> array([0., 0., 0., 0.], dtype=float32)
    """

    def __init__(self, name: str, backend):
        self.name = name
        self.backend = backend
        self.chunks: dict[tuple, StoredChunk] = {}
        self.restored: set = set()     # chunk ids restored from a checkpoint, not yet re-initialised
        self.row_tables: set = set()   # chunk ids holding a row-sparse table's rows
        self.gone: set = set()         # workers that finished: they push no more

    def alloc(self, size: int, dtype) -> np.ndarray:
        return self.backend.alloc(size, dtype)

    def restore(self, chunks: dict) -> None:
        """Start from a checkpoint's chunks: each waits for its init, which keeps the value."""
        self.chunks = chunks
        self.restored = set(chunks)

    def init(self, ids: list[tuple], arrays: list) -> None:
        """Dense init of ``ids`` with ``arrays`` (all checked first: none changes if one
        is refused). A restored chunk keeps the checkpoint's value if its size and
        dtype match."""
        for cid, a in zip(ids, arrays):
            if cid in self.restored:
                self.existing([cid], [a])
            elif cid in self.chunks:
                raise InvalidArgumentError(f"{chunk_label(cid)} is already initialised")
        for cid, a in zip(ids, arrays):
            if cid in self.restored:
                self.restored.discard(cid)
            else:
                value = self.alloc(a.size, a.dtype)
                self.backend.upload(a.reshape(-1), out=value)
                self.chunks[cid] = StoredChunk(value)

    def existing(self, ids: list[tuple], arrays: list | None = None, rows_too: bool = False) -> list[StoredChunk]:
        """The chunks ``ids`` (checked against ``arrays``' sizes and dtypes); dense
        chunks only, unless ``rows_too`` (optimizer states cover row-sparse tables)."""
        chunks = []
        for i, cid in enumerate(ids):
            chunk = self.chunks.get(cid)
            if chunk is None:
                raise InvalidArgumentError(f"{chunk_label(cid)} is not initialised on {self.name}; "
                                           "call init() first")
            if not rows_too and cid in self.row_tables:
                raise InvalidArgumentError(f"{chunk_label(cid)} belongs to a row-sparse key: use "
                                           "push with rows and row_sparse_pull")
            if arrays is not None:
                a = arrays[i]
                if a.dtype != chunk.value.dtype or a.size != chunk.value.size:
                    raise InvalidArgumentError(
                        f"{chunk_label(cid)}: got {a.size} x {a.dtype.name}, stored is "
                        f"{chunk.value.size} x {chunk.value.dtype.name}")
            chunks.append(chunk)
        return chunks
