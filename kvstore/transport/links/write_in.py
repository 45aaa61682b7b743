"""Writing in: a worker's contribution goes straight into a co-located server's sums.

In dist_sync, instead of staging a large gradient chunk in a slot for the server
to add, the worker sends ``write``; the server grants it, per chunk, the round's
sum in its own shared memory (mapped read-write by its workers) to copy into (the
worker opens the round) or add into; then ``written``, answered as a pushpull
(docs/protocol.md section 4; the server's side is kvstore/server/writein.py).
That saves the staging copy and the server's pass over the data.
"""

from __future__ import annotations

import numpy as np

from ...errors import ProtocolError
from ...protocol import ops


class Writer:
    """Writes into the sums of the server that ``link`` (a ShmLink) reaches.

    Example (what the client does for ``Client.write_in``)::

        rest = link.writer.write("pushpull of key 3", chunk_ids, grads, outs, ids, later)
    """

    def __init__(self, link):
        self._link = link
        self._client = link.client
        self._config = link.config

    def write(self, what: str, keys, arrays, into, ids: list, later: list) -> list[int]:
        """Write the large ones of ``arrays`` (for the chunks ``keys``; their values
        after the round go to ``into``) into the server's sums, when they come to
        ``write_in_bytes`` at least. Appends the ``write`` request's id to ``ids``; its
        grant is handled whenever this worker next waits, and appends the id of the
        ``written`` request that follows to ``later``. Returns the indices of the
        arrays left to push as usual: small ones, and those already in our shared
        memory (which the server reads in place); all of them when nothing is written."""
        arena = self._link.arena
        chosen = [i for i, a in enumerate(arrays)
                  if a.nbytes >= self._config.zero_copy_bytes and arena.locate(a) is None]
        if not chosen or sum(arrays[i].nbytes for i in chosen) < self._config.write_in_bytes:
            return list(range(len(arrays)))
        written = [keys[i] for i in chosen]
        granted = self._granted(what, [arrays[i] for i in chosen], [into[i] for i in chosen], later, written)
        # reads: its `written` carries these chunks' values (the client's order of reads
        # and the next round's pushes: kvstore.worker.client)
        ids.append(self._client.request(self._link.server, ops.WRITE, what, on_reply=granted,
                                        urgent=True, chunks=written, values=True, reads=written)[0])
        # grants already here are written now: the other workers' turns wait on ours
        self._client.progress(what)
        return sorted(set(range(len(arrays))) - set(chosen))

    def _granted(self, what: str, arrays: list, into: list, later: list, chunks: list):
        """The handler of a grant: copy or add each array into the sum it names,
        then say ``written``."""
        server = self._link.server

        def granted(header, targets):
            modes = header.get("modes")
            refs = (header.get("shm") or {}).get("refs") or []
            if not (isinstance(modes, list) and len(modes) == len(targets) == len(arrays)
                    and len(refs) == len(targets) and all(r is not None for r in refs)):
                raise ProtocolError(f"{what}: server {server} granted a write that does not "
                                    "point into its shared memory chunk by chunk")
            for mode, target, a in zip(modes, targets, arrays):
                if target.dtype != a.dtype or target.size != a.size or mode not in ("copy", "add"):
                    raise ProtocolError(f"{what}: server {server} granted {mode!r} into "
                                        f"{target.size} x {target.dtype}, for {a.size} x {a.dtype}")
                if mode == "copy":
                    np.copyto(target, a.reshape(-1))
                else:
                    np.add(target, a.reshape(-1), out=target)
            # a late grant (its call gave up): the values of `written` go nowhere either
            later.append(self._client.request(server, ops.WRITTEN, what, into=into, reads=chunks,
                                              follows=header["id"], grant=header["id"])[0])
        return granted
