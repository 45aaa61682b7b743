"""Writing in: a worker's contribution goes straight into a co-located server's sums.

In dist_sync, instead of staging a large gradient chunk in a slot for the server
to add, the worker sends ``write``; the server grants it, per chunk, the round's
sum in its own shared memory (mapped read-write by its workers) to copy into (the
worker opens the round) or add into; then ``written``, answered as a pushpull
(docs/protocol.md section 4; the server's side is kvstore/server/write_in.py).
That saves the staging copy and the server's pass over the data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import ProtocolError
from ...protocol import ops
from .options import RequestOptions


@dataclass
class Writing:
    """One ``write`` on its way (:meth:`Writer.write` returns it): ``chosen``, the
    indices of the arrays it writes; ``request``, its id; ``written``, the id of the
    ``written`` request its grant sent (None until the grant is handled, and for a
    write that was refused). The values after the round come with ``written``'s reply."""
    chosen: list[int]
    request: int = 0
    written: int | None = None

    def requests(self) -> list[int]:
        """Its requests so far: ``write``, then ``written`` once granted."""
        return [self.request] if self.written is None else [self.request, self.written]


class Writer:
    """Writes into the sums of the server that ``link`` (a ShmLink) reaches.

    Example (what the exchange does for a sync pushpull's message)::

        writing = link.writer.write("pushpull of key 3", chunk_ids, grads, outs)
        if writing is not None:          # the others of grads go as a pushpull
            client.wait([writing.request], what)     # the grant: written into, `written` sent
            client.wait([writing.written], what)     # the round's values are in outs
    """

    def __init__(self, link):
        self._link = link
        self._client = link.client
        self._config = link.config

    def write(self, what: str, keys, arrays, into) -> Writing | None:
        """Write the large ones of ``arrays`` (for the chunks ``keys``; their values
        after the round go to ``into``) into the server's sums, when they come to
        ``write_in_bytes`` at least; None when nothing is written. The others are
        left to push as usual: small ones, and those already in our shared memory
        (which the server reads in place). The grant is handled whenever this worker
        next waits or hands on the replies already in (the exchange does, right after a
        write: ``client.progress``), and sends ``written``. Only sends: it drives no
        replies itself."""
        arena = self._link.arena
        chosen = [i for i, a in enumerate(arrays)
                  if a.nbytes >= self._config.zero_copy_bytes and arena.locate(a) is None]
        if not chosen or sum(arrays[i].nbytes for i in chosen) < self._config.write_in_bytes:
            return None
        written = [keys[i] for i in chosen]
        writing = Writing(chosen)
        granted = self._granted(what, [arrays[i] for i in chosen], [into[i] for i in chosen], written, writing)
        # reads: its `written` carries these chunks' values (the client's order of reads
        # and the next round's pushes: kvstore.worker.client)
        writing.request = self._client.request(
            self._link.server, ops.WRITE, what, (), RequestOptions(on_reply=granted, urgent=True, reads=written),
            chunks=written, values=True)[0]
        # written into the server's memory: counted as sent, as a push's arrays are
        self._client.traffic.sent(self._link.kind, sum(arrays[i].nbytes for i in chosen))
        return writing

    def _granted(self, what: str, arrays: list, into: list, chunks: list, writing: Writing):
        """The handler of a grant: copy or add each array into the sum it names,
        then say ``written`` (its id goes to ``writing``)."""
        server = self._link.server

        def granted(header, targets):
            modes = header.get("modes")
            refs = (header.get("shm") or {}).get("refs") or []
            if not (isinstance(modes, list) and len(modes) == len(targets) == len(arrays)
                    and len(refs) == len(targets) and all(r is not None for r in refs)):
                raise ProtocolError(f"{what}: server {server} granted a write that does not "
                                    "point into its shared memory chunk by chunk")
            for mode, target, a in zip(modes, targets, arrays):
                if target.dtype != a.dtype or target.size != a.size or mode not in (ops.COPY, ops.ADD):
                    raise ProtocolError(f"{what}: server {server} granted {mode!r} into "
                                        f"{target.size} x {target.dtype}, for {a.size} x {a.dtype}")
                if mode == ops.COPY:
                    np.copyto(target, a.reshape(-1))
                else:
                    np.add(target, a.reshape(-1), out=target)
            # a late grant (its call gave up): the values of `written` go nowhere either
            writing.written = self._client.request(
                server, ops.WRITTEN, what, (), RequestOptions(into=into, reads=chunks, follows=header["id"]),
                grant=header["id"])[0]
        return granted
