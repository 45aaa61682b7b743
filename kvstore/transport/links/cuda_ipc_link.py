"""Device memory with a co-located GPU server (CUDA IPC); host memory as the shm link.

The GPU twin of :mod:`.shm_link`, and built on it: control messages on the
server's tcp endpoint, host arrays through shared memory exactly as there. What it
adds is device arrays (the sums of ``dist_device_sync``) without a host copy:

- **Requests**: a device array is copied on its device into this link's slot for
  that chunk (exportable memory of the device layer's
  :class:`~kvstore.devices.base.Sharing`, allocated once, busy until the request's
  reply), the device's stream is synchronised once per request, and the message
  carries ``dev`` references (docs/protocol.md 2.7). The server sums straight
  from the slots (one kernel over the workers' buffers) and answers only when it
  has stopped reading them. A pushpull's values that lie in memory from
  ``kv.empty(..., device=i)`` (kvstore/devices/arena.py: the flat-bucket Trainer's
  gradients) are referenced as they are, with no slot and no copy.
- **Replies**: a request whose outputs are device arrays says ``dev_reply``; a
  GPU server then answers with references to its values (made final before it
  replies), which this link opens once per allocation and copies device to
  device into the outputs (:meth:`CudaIpcLink.deliver`). In sync mode a value
  cannot change before this worker pushes again, and that push is ordered after
  the copy on the device's stream. Values the server sends as host memory
  (copies: async replies, a sync reply whose worker is ahead) are uploaded.

Handshake: the shm link's ``hello``, then ``device_hello``: a 16-byte device probe
each way by reference, each side reading the other's. Only if both read back is
the link used; otherwise the client goes on to shm. It applies only to a worker
whose store works on GPUs (``Client.accelerators`` with sharing), and only a server
with its values on a GPU offers it (kvstore/transport/endpoints/cuda_ipc_endpoint.py).
On the host devices CI runs (kvstore/devices/host_sharing.py) the same protocol
runs over shared memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .client_seam import LinkClient

import os

import numpy as np

from ...errors import InvalidArgumentError
from ...protocol import decode, ops
from ...devices.arena import DeviceArena
from ...devices.arrays import flat_view
from ...devices.slots import DeviceSlots
from ...devices.staging import copy_into
from .base import LinkUnavailable
from .options import RequestOptions
from .shm_link import ShmLink, _hashable


class CudaIpcLink(ShmLink):
    kind = "cuda_ipc"
    reads_device = True

    @classmethod
    def applies(cls, client: LinkClient) -> bool:
        acc = client.accelerators
        return acc is not None and acc.sharing is not None

    def __init__(self, client: LinkClient, server: int, url: str, advert):
        super().__init__(client, server, url, advert)
        acc = client.accelerators
        assert acc is not None and acc.sharing is not None   # applies() chose this link only then
        self._acc = acc
        self._sharing = acc.sharing
        self._index = self._acc.current()       # the device peers' memory is opened on
        self._device_slots = DeviceSlots(self._acc)   # held by request id until its reply
        # kv.empty(..., device=i) memory, read by the servers in place (shared by the client's links)
        self._arena = client.shared("device arena", lambda: DeviceArena(self._acc))
        self._device_probe = None
        self._device_answer: dict | None = None

    # -- handshake -------------------------------------------------------------------------
    def hello(self) -> list[int]:
        ids = super().hello()
        acc, sharing = self._acc, self._sharing
        if self.advert.pid is not None:
            sharing.allow([self.advert.pid])
        nonce = os.urandom(16)
        with acc.on(self._index):
            probe = self._device_probe = sharing.empty(self._index, 16, np.uint8)
            acc.upload(probe, np.frombuffer(nonce, np.uint8).copy())
            sharing.publish(self._index)
        place = sharing.export(probe)
        if place is None:
            raise LinkUnavailable(self._failed_device("its device memory cannot be exported"))

        def keep(header, values):
            ok = (header.get("dev_ok") is True and isinstance(header.get("dev"), dict)
                  and len(values) == 1 and self._acc.holds(values[0])
                  and self._read(values[0]) == header.get("nonce"))
            self._device_answer = {"ok": ok}
        return ids + [self.client.request(self.server, ops.DEVICE_HELLO, f"device-memory handshake with "
                                          f"server {self.server}", [probe],
                                          RequestOptions(on_reply=keep, shared=[(*place, "dev")],
                                                         sequenced=False, on_error=self.refused),
                                          nonce=nonce, dev_reply=True)[0]]

    def _read(self, value) -> bytes:
        host = np.empty(value.size, value.dtype)
        with self._acc.on(self._index):
            self._acc.wait([self._acc.download(value.reshape(-1), host)])
        return host.tobytes()

    def ready(self) -> None:
        super().ready()
        if not (self._device_answer or {}).get("ok"):
            raise LinkUnavailable(self._failed_device("the device probe did not read back"))

    def _failed_device(self, why: str) -> str:
        return f"server {self.server} is on this host but device memory with it failed ({why})"

    # -- requests --------------------------------------------------------------------------
    def prepare(self, req_id, arrays, fields, options):
        stage, into = options.stage, options.into
        if into is not None and any(self._acc.holds(a) for a in into):
            fields["dev_reply"] = True          # its values may come back as device references
        on_device = [i for i, a in enumerate(arrays) if self._acc.holds(a)]
        # placed by the caller already (the handshakes' probes), or host arrays only
        if options.shared is not None or not on_device:
            return super().prepare(req_id, arrays, fields, options)
        if options.replied:
            fields["shm_reply"] = True
        # host arrays beside them (keys whose values are on the host) travel as frames
        keys = [_hashable(k) for k in stage] if stage is not None else [("buffer", i) for i in range(len(arrays))]
        # values in our arena (kv.empty(..., device=i)) go as they are, once their devices'
        # queued work is done; the others are copied into slots held until the reply
        if len(on_device) == len(arrays) and not (options.in_place and self._arena):
            # every value a device array to copy into a slot (a step's gradients, the common case)
            return arrays, self._device_slots.stage(req_id, keys, arrays), False
        located = [self._arena.locate(arrays[i]) for i in on_device] if options.in_place and self._arena \
            else [None] * len(on_device)
        rest = [i for i, place in zip(on_device, located) if place is None]
        places: list = [None] * len(arrays)
        for i, place in zip(rest, self._device_slots.places(req_id, [keys[i] for i in rest],
                                                            [arrays[i] for i in rest])):
            places[i] = place
        lent = [(i, place) for i, place in zip(on_device, located) if place is not None]
        for index in sorted({self._acc.index_of(arrays[i]) for i, _ in lent}):
            self._sharing.publish(index)
        for i, place in lent:
            places[i] = (*place, "dev")
        return arrays, places, False

    def device_empty(self, index: int, size: int, dtype):
        """A flat array on device ``index`` that co-located GPU servers read in place."""
        return self._arena.alloc(index, size, dtype)

    def release(self, req_id: int) -> None:
        self._device_slots.release(req_id)      # the server has stopped reading those slots
        super().release(req_id)

    # -- replies ---------------------------------------------------------------------------
    def decode(self, frames) -> tuple[dict, list]:
        return decode(frames, self.config.max_message_bytes,
                      resolve={"shm": self._mapper.view, "dev": self._open}, memo=self._layouts)

    def _open(self, segment, offset: int, dtype, shape):
        return self._sharing.open(self._index, segment, offset, dtype, shape)

    def deliver(self, values: list, into: list) -> None:
        """Copy each reply value into its output: device to device (across devices by a
        peer copy), host to device by an upload, and to host outputs as the shm link."""
        acc = self._acc
        holds, index_of = acc.holds, acc.index_of
        if len(values) != len(into):
            raise InvalidArgumentError(f"reply carries {len(values)} arrays for {len(into)} chunks")
        within: dict[int, tuple[list, list]] = {}     # device -> copies within it (one kernel each)
        for dest, value in zip(into, values):
            if value.size != dest.size:
                raise InvalidArgumentError(f"reply carries {value.size} values for a chunk of {dest.size}")
            on_dest, on_value = holds(dest), holds(value)
            if on_dest and on_value and dest.dtype == value.dtype and index_of(dest) == (index := index_of(value)):
                copies = within.get(index)
                if copies is None:
                    copies = within[index] = ([], [])
                copies[0].append(flat_view(dest))
                copies[1].append(flat_view(value))
            elif on_dest or on_value:
                copy_into(acc, dest, value)
            else:
                super().deliver([value], [dest])
        for index, (dsts, srcs) in within.items():
            with acc.on(index):
                acc.copy_many(dsts, srcs)

    def forget(self) -> None:
        super().forget()
        self._device_slots.forget()

    def close(self) -> None:
        self._device_slots.clear()
        super().close()
