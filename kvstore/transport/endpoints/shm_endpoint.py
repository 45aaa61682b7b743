"""The server's side of shared memory (:mod:`kvstore.transport.links.shm_link`).

The server keeps its values and sums in its own shared memory (:attr:`memory`,
an ``shm.Arena``), so that co-located workers read replies in place; it maps the
workers' memory read-only to read their requests' buffers by reference
(:attr:`resolves`), from the job's worker processes only (:meth:`joined`). It binds
nothing: its control messages use the tcp endpoint, and it advertises only its
name. Handshake: ``hello``, a probe each way by reference. Replies to requests
that asked for it (``shm_reply``) carry their large values as references, and a
write-in grant always points into our memory (workers write into it).
"""

from __future__ import annotations

import os

import numpy as np

from ...protocol import encode, error_header, ops
from ...protocol.layouts import Described, LayoutMemo
from .. import shm
from .base import Endpoint


class ShmEndpoint(Endpoint):
    kind = "shm"
    answers = frozenset({ops.HELLO})

    def __init__(self, config):
        super().__init__(config)
        self.memory: shm.Arena | None = None
        self._mapper = shm.Mapper()
        self.resolves = {"shm": self._mapper.view}
        self._replies: set = set()   # (peer, request id) whose reply may point into our memory
        self._probe: np.ndarray | None = None
        self._sent: LayoutMemo[Described] = LayoutMemo()   # data replies' layouts, packed once (kvstore/protocol/layouts.py)

    def bind(self, sock) -> dict[str, str] | None:
        if not shm.available():
            return None
        self.memory = shm.Arena(f"s{self.config.rank}")
        # kept for the server's lifetime: a worker reads it after our hello reply
        self._probe = self.memory.alloc(16, np.uint8)
        self._probe[:] = np.frombuffer(os.urandom(16), np.uint8)
        self.write_in = True
        return {}

    def joined(self, pids: list[int]) -> None:
        self._mapper.allow(pids)

    def serving(self, backend) -> None:
        # a GPU server's sums are not in our memory: workers cannot write into them
        self.write_in = self.memory is not None and backend.name == "cpu"

    def owner(self, kind: str, segment) -> int | None:
        return shm.owner(segment)

    def note(self, peer: bytes, header: dict) -> None:
        if header.get("shm_reply") is True and self.memory is not None:
            self._replies.add((peer, header["id"]))

    def answer(self, peer: bytes, header: dict, arrays: list) -> tuple[dict, list]:
        nonce = header.get("nonce")
        # the worker's probe must have come through shared memory and read back right
        ok = (self._probe is not None and isinstance(header.get("shm"), dict) and len(arrays) == 1
              and isinstance(nonce, bytes) and arrays[0].tobytes() == nonce)
        if not ok or self._probe is None:
            return {"op": ops.OK, "id": header["id"], "shm_ok": False}, []
        return {"op": ops.OK, "id": header["id"], "shm_ok": True, "nonce": self._probe.tobytes(),
                "sums_writable": self.write_in}, [self._probe]

    def encode(self, peer: bytes, header: dict, arrays: list) -> list | None:
        key = (peer, header.get("id"))
        if header.get("write_in") is True:
            # a grant must point into our memory: a copy would swallow the worker's writes
            self._replies.discard(key)
            shared = [self._locate(a) for a in arrays]
            if any(place is None for place in shared):
                return encode(error_header(header.get("id"), "InternalError",
                                           "cannot grant a write: the sum is not in shared memory"))
            return encode(header, arrays, shared)
        if key not in self._replies:
            return None
        self._replies.discard(key)
        if not arrays:
            return None
        # small values travel in the message (cheaper than a reference), except the
        # hello reply's probe, which must prove the shared memory works
        least = 0 if header.get("shm_ok") is True else self.config.zero_copy_bytes
        # (the small ones packed into one frame, and a data reply's buffers' fields in a layout
        # frame, which the worker decodes once per content: this reply never goes to a data channel)
        return encode(dict(header, pack=True), arrays,
                      [self._locate(a) if a.nbytes >= least else None for a in arrays], layout=least > 0,
                      sent=self._sent)

    def forget(self) -> None:
        self._sent.clear()

    def _locate(self, a: np.ndarray):
        return self.memory.locate(a) if self.memory is not None else None

    def close(self) -> None:
        if self.memory is not None:
            self.memory.close()
        self._mapper.close()
