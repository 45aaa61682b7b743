"""The server's side of CUDA IPC (:mod:`kvstore.transport.links.cuda_ipc_link`).

Offered by a server whose values live on a GPU (``KVSTORE_SERVER_DEVICE=gpu``); it
binds nothing (control messages use the tcp endpoint) and advertises its name.
Once the server's backend is known (:meth:`CudaIpcEndpoint.serving`) it:

- resolves ``dev`` references in pushes into the co-located workers' device
  memory, opened once per allocation through the device layer's
  :class:`~kvstore.devices.base.Sharing` (the job's worker processes only); the
  server sums straight from them (its backend takes a device array as it is);
- before replying to a request whose buffers it read that way, waits for its
  stream (``backend.publish``): the worker reuses its slots once answered;
- answers sync replies that asked for it (``dev_reply``) with references to its
  values (left on the device by ``backend.values``), published first, instead of
  downloading them; every other reply is downloaded as before;
- answers the ``device_hello`` handshake: the worker's probe read back, and its own
  probe by reference.

A server whose values are in host memory refuses the handshake (``dev_ok: false``)
and co-located workers use shared memory. On the host devices CI runs
(kvstore/devices/host_sharing.py) the same code runs over shared memory.
"""

from __future__ import annotations

import os

import numpy as np

from ...errors import ProtocolError
from ...protocol import encode, ops
from ...protocol.layouts import Described, LayoutMemo
from .base import Endpoint


class CudaIpcEndpoint(Endpoint):
    kind = "cuda_ipc"
    answers = frozenset({ops.DEVICE_HELLO})
    device_replies = True

    def __init__(self, config):
        super().__init__(config)
        self._backend = None
        self._sharing = None
        self._pids: list[int] = []
        self._probe = None
        self._nonce = os.urandom(16)
        self._reads: set = set()       # (peer, request id) whose buffers are workers' device memory
        self._replies: set = set()     # (peer, request id) whose values may go by device reference
        self.resolves = {"dev": self._open}
        self._sent: LayoutMemo[Described] = LayoutMemo()    # data replies' layouts, packed once (kvstore/protocol/layouts.py)

    def bind(self, sock) -> dict[str, str] | None:
        return {} if self.config.server_device == "gpu" else None

    def joined(self, pids: list[int]) -> None:
        self._pids = list(pids)
        if self._sharing is not None:
            self._sharing.allow(self._pids)

    def serving(self, backend) -> None:
        sharing = backend.sharing
        if sharing is None:
            return                     # values in host memory: nothing to share
        self._backend, self._sharing = backend, sharing
        sharing.allow(self._pids)
        with backend.scope():
            self._probe = sharing.empty(backend.dev.index, 16, np.uint8)
            backend.upload(np.frombuffer(self._nonce, np.uint8), out=self._probe)
        backend.publish()

    def _open(self, segment, offset: int, dtype, shape):
        if self._sharing is None:
            raise ProtocolError("this server's values are not on a device: it takes no device-memory buffers")
        return self._sharing.open(self._backend.dev.index, segment, offset, dtype, shape)

    def owner(self, kind: str, segment) -> int | None:
        return None if self._sharing is None else self._sharing.owner(segment)

    def note(self, peer: bytes, header: dict) -> None:
        key = (peer, header["id"])
        if header.get("dev") is not None:
            self._reads.add(key)
        if header.get("dev_reply") is True and self._sharing is not None:
            self._replies.add(key)

    def answer(self, peer: bytes, header: dict, arrays: list) -> tuple[dict, list]:
        nonce = header.get("nonce")
        ok = (self._probe is not None and isinstance(header.get("dev"), dict) and len(arrays) == 1
              and isinstance(nonce, bytes) and self._backend.to_numpy(arrays[0]).tobytes() == nonce)
        if not ok:
            return {"op": ops.OK, "id": header["id"], "dev_ok": False}, []
        return {"op": ops.OK, "id": header["id"], "dev_ok": True, "nonce": self._nonce}, [self._probe]

    def encode(self, peer: bytes, header: dict, arrays: list) -> list | None:
        key = (peer, header.get("id"))
        if key in self._reads:
            # the worker reuses the buffers we read once it is answered: finish reading
            self._reads.discard(key)
            self._backend.publish()
        if header.get("dev_ok") is True:       # the handshake's probe, by reference
            return encode(header, arrays, [self._place(a) for a in arrays])
        if key not in self._replies:
            return None
        self._replies.discard(key)
        # values left on the device (the data plane offers those first), not host copies
        if not arrays or not self._backend.on_device(arrays):
            return None
        places = [self._place(a) for a in arrays]
        if any(place is None for place in places):
            return None
        self._backend.publish()            # the values are final before the worker reads them
        # (the buffers' fields in a layout frame, which the worker decodes once per content)
        return encode(header, list(arrays), places, layout=True, sent=self._sent)

    def forget(self) -> None:
        self._sent.clear()

    def _place(self, a):
        place = self._sharing.export(a) if self._sharing is not None else None
        return None if place is None else (*place, "dev")

    def close(self) -> None:
        # the sharing is the device's (its backend's), which outlives the endpoint
        self._sharing = self._backend = self._probe = None
