"""Shared memory with a co-located server; control messages on ZeroMQ over tcp.

Handshake: a ``hello`` whose 16-byte random probe travels by reference into
our shared memory; the server answers with its own probe by reference. Only if
both read back is shared memory used (otherwise the client falls back to the
next link: ipc, or tcp where the server has no ipc endpoint).

Then a request's large buffers are copied into this worker's staging slots (one
per server and chunk, busy until the reply: the server may read it in place until
its round completes) and the message carries only references; gradients already
in our shared memory (``kv.empty()``) are sent by reference without a copy.
Replies point into the server's shared memory and are copied from there straight
into the caller's arrays. Buffers under ``KVSTORE_ZERO_COPY_BYTES`` travel in the
message: for a small key that is faster than a reference. Where the server keeps
its sums in shared memory, sync pushpulls may be written straight into them
(:mod:`.write_in`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .client_seam import LinkClient

import os

import numpy as np

from ...protocol import decode, ops
from ...protocol.layouts import Layout, LayoutMemo
from .. import shm
from .base import Link, LinkUnavailable
from .options import RequestOptions
from .write_in import Writer


class ShmLink(Link):
    kind = "shm"
    frames = False

    @classmethod
    def reach(cls, advert, config, colocated: bool) -> str | None:
        # control messages go to the tcp endpoint; the server says it serves shm
        return advert.url("tcp") if colocated and advert.offers(cls.kind) else None

    def __init__(self, client: LinkClient, server: int, url: str, advert):
        super().__init__(client, server, url, advert)
        # no link transfer to overlap: fewer, larger messages cost fewer round trips
        self.pipeline_bytes = self.config.shm_pipeline_bytes
        # one arena per worker, shared by its shm links: kv.empty() memory is read in
        # place by every co-located server
        self.arena = client.shared("shm arena", lambda: shm.Arena(f"w{client.rank}"))
        self._slots = shm.Slots(self.arena)
        self._mapper = shm.Mapper(writable=self.config.write_in)   # sums it may write into
        self._probe: np.ndarray | None = None
        self._answer: dict | None = None
        self._layouts: LayoutMemo[Layout] = LayoutMemo()     # the server's replies' layouts decoded (kvstore/protocol/layouts.py)

    def hello(self) -> list[int]:
        place = None
        if shm.available():
            self._probe = probe = self.arena.alloc(16, np.uint8)
            probe[:] = np.frombuffer(os.urandom(16), np.uint8)
            place = self.arena.locate(probe)
        if place is None:
            raise LinkUnavailable(self._failed("no shared memory in this process"))
        if self.advert.pid is not None:
            self._mapper.allow([self.advert.pid])

        def keep(header, values):
            ok = (header.get("shm_ok") is True and isinstance(header.get("shm"), dict)
                  and len(values) == 1 and values[0].tobytes() == header.get("nonce"))
            self._answer = {"ok": ok, "sums_writable": header.get("sums_writable") is not False}
        # unsequenced: if the server cannot map our probe, the error must not hold
        # back the requests that follow on this connection
        return [self.client.request(self.server, ops.HELLO, f"shared-memory handshake with server "
                                    f"{self.server}", [probe],
                                    RequestOptions(on_reply=keep, shared=[place], sequenced=False,
                                                   on_error=self.refused),
                                    nonce=probe.tobytes())[0]]

    def ready(self) -> None:
        answer = self._answer or {}
        if not answer.get("ok"):
            raise LinkUnavailable(self._failed("the probe did not read back"))
        # a GPU server's sums are not in its shared memory: it says so
        if self.config.write_in and answer["sums_writable"]:
            self.writer = Writer(self)

    def _failed(self, why: str) -> str:
        return f"server {self.server} is on this host but shared memory with it failed ({why})"

    def prepare(self, req_id, arrays, fields, options):
        if options.replied:
            fields["shm_reply"] = True     # values may come back as references
        if options.stage is None or not arrays:
            return arrays, options.shared, False
        big = [a.nbytes >= self.config.zero_copy_bytes for a in arrays]
        located = [self.arena.locate(a) if b else None for a, b in zip(arrays, big)] \
            if options.in_place else None
        if located is not None and all(p is not None for p, b in zip(located, big) if b):
            return arrays, located, False    # the caller's own shared memory: no copy
        return (*self._stage(req_id, options.stage, arrays, big), False)

    def _stage(self, req_id: int, keys, arrays, big):
        """Copy the ``big`` ones of ``arrays`` into our slots (held for ``req_id``):
        (arrays with those replaced by their slots, the slots' places (None: sent
        inline)), or the arrays unchanged and None when nothing is big or a slot is
        still busy (ZeroMQ copies them then, as it copies small ones anyway)."""
        index = [i for i, b in enumerate(big) if b]
        if not index:
            return arrays, None
        slot_keys = [_hashable(keys[i]) for i in index]
        staged = self._slots.fill(slot_keys, [arrays[i] for i in index])
        if staged is None:
            return arrays, None
        self._slots.hold(slot_keys, req_id)
        arrays, shared = list(arrays), [None] * len(arrays)
        for i, slot in zip(index, staged):
            arrays[i], shared[i] = slot, self.arena.locate(slot)
        return arrays, shared

    def release(self, req_id: int) -> None:
        self._slots.release(req_id)     # the server has finished with our slots

    def decode(self, frames) -> tuple[dict, list]:
        return decode(frames, self.config.max_message_bytes, resolve={"shm": self._mapper.view},
                      memo=self._layouts)

    def forget(self) -> None:
        self._layouts.clear()

    def empty(self, size: int, dtype) -> np.ndarray:
        return self.arena.alloc(size, dtype)

    def close(self) -> None:
        self._mapper.close()


def _hashable(key):
    if type(key) is list and len(key) == 2 and type(key[0]) in (int, str) and type(key[1]) is int:
        return (key[0], key[1])       # a chunk's wire id, the common case (once per chunk and call)
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key
