"""Replies in the precision a read asked for (``reply_precision``, kvstore.precision).

A ``pull`` or ``pushpull`` of a worker with ``kv.set_multi_precision(True)`` whose
outputs are float16 or bfloat16 names, per chunk, the precision its reply's values
come in (docs/protocol.md §4, ``reply_precision``). The server's values stay float32;
each reply value of a named chunk is rounded once, to nearest even, into that
precision (:func:`kvstore.precision.narrow`) before it leaves: half the bytes on the
wire, and the worker receives straight into its outputs.

:class:`ReplyPrecision` is the server state's one owner of it: :meth:`expect` checks
a request's field before anything changes (refusals name the chunk) and remembers
it by (peer, request id); :meth:`narrowed` rounds the values of the replies to such
requests, whichever event answers them (a sync round completed by another worker's
push, a member leaving). A reply of a sync round whose values are the chunks
themselves (sent without a copy, read by reference over shared memory) is rounded
into one buffer per chunk and precision, kept (in the server's memory, counted in
its budget), which co-located workers read in place as they read float32 values;
any other reply (a copy made for it) is rounded into fresh memory. The replies of one
event (a sync round's, one per worker) round each kept buffer once.

Example::

    rp = ReplyPrecision(table, budget)
    rp.expect(peer, {"op": "pull", "id": 7, "reply_precision": ["bfloat16"]}, [("w", 0)], chunks)
    replies = rp.narrowed(strategy.pull(peer, 7, worker, ids, chunks))   # values as uint16 patterns
"""

from __future__ import annotations

import numpy as np

from .. import precision
from ..errors import InvalidArgumentError, ProtocolError
from ..protocol import chunk_label, ops
from .budget import MemoryBudget
from .chunks import ChunkTable
from .rounds import Reply, StoredChunk

FIELD = "reply_precision"


class ReplyPrecision:
    """The reads waiting for replies in low precision, and the rounded buffers of sync replies."""

    def __init__(self, table: ChunkTable, budget: MemoryBudget):
        self._table, self._budget = table, budget
        self._asked: dict = {}       # (peer, request id) -> (chunk ids, names: None or a precision per chunk)
        self._kept: dict = {}        # (chunk id, precision) -> its rounded buffer (sync replies)

    @property
    def waiting(self) -> bool:
        """Whether some request's reply is still to be rounded."""
        return bool(self._asked)

    def expect(self, peer, header: dict, ids: list, chunks: list[StoredChunk]) -> None:
        """Check ``header``'s ``reply_precision`` (a ``pull`` or ``pushpull`` of chunks
        ``ids``) and remember it for the reply. ProtocolError for a malformed field or
        one on another op; InvalidArgumentError for a named chunk that is not float32,
        or rounded buffers past the server's budget. Nothing is remembered then."""
        field = header.get(FIELD)
        if field is None:
            return
        if header["op"] not in (ops.PULL, ops.PUSHPULL):
            raise ProtocolError(f"'{FIELD}' is for pull and pushpull, whose replies carry values; "
                                f"not {header['op']!r}")
        names = precision.parse(field, len(ids), FIELD)
        fresh = []
        for cid, chunk, name in zip(ids, chunks, names):
            if name is None:
                continue
            if np.dtype(chunk.value.dtype) != precision.MASTER:
                raise InvalidArgumentError(f"{chunk_label(cid)} holds {np.dtype(chunk.value.dtype).name}: "
                                           f"{name} replies are of float32 keys only")
            kept = self._kept.get((cid, name))
            if kept is None or kept.size != chunk.value.size:
                fresh.append((cid, chunk.value.size, name))
        if fresh:
            nbytes = sum(size * precision.WIRE_DTYPES[name].itemsize for _, size, name in fresh)
            self._budget.take(nbytes, f"{name} replies of {len(fresh)} chunk(s) ({chunk_label(fresh[0][0])}, ...)")
            for cid, size, name in fresh:
                old = self._kept.pop((cid, name), None)
                if old is not None:
                    self._budget.give(old.nbytes)
                self._kept[(cid, name)] = self._table.alloc(size, precision.WIRE_DTYPES[name])
        self._asked[(peer, header["id"])] = (ids, names)

    def narrowed(self, replies: list[Reply]) -> list[Reply]:
        """``replies`` with the values of those to remembered requests rounded as they
        asked (an error reply just forgets its request). Inside the backend's scope:
        a GPU server rounds on its device."""
        if not self._asked:
            return replies
        chunks, backend = self._table.chunks, self._table.backend
        done: set = set()      # kept buffers rounded in this event (a sync round's W replies: once)
        for reply in replies:
            asked = self._asked.pop((reply.peer, reply.header.get("id")), None)
            if asked is None or reply.header.get("op") != ops.OK:
                continue
            ids, names = asked
            if len(reply.arrays) != len(ids):       # (a bug's reply: sent as it is, and loud)
                raise InvalidArgumentError(f"a reply of {len(reply.arrays)} values to a read of {len(ids)} chunks")
            values = []
            for cid, name, value in zip(ids, names, reply.arrays):
                if name is None:
                    values.append(value)
                    continue
                chunk, kept = chunks.get(cid), self._kept.get((cid, name))
                if chunk is not None and value is chunk.value and kept is not None and kept.size == value.size:
                    if (cid, name) not in done:     # (the value cannot change within one event)
                        backend.settle(value)       # (a GPU server's batched update of it runs first)
                        precision.narrow(name, value, kept)
                        done.add((cid, name))
                    values.append(kept)
                else:
                    values.append(precision.narrow(name, value))
            reply.arrays = values
        return replies
