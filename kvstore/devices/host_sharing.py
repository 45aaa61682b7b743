"""The device layer's :class:`~kvstore.devices.base.Sharing` on the host devices
(kvstore/devices/host.py): what CI runs the cuda_ipc transport on.

"Device" memory that peers may open is carved out of this process's shared-memory
segments (:class:`kvstore.transport.shm.Arena`) and tagged as device memory; a
reference is the segment's ``[pid, fd, size]`` and an offset, as for host shared
memory, and a peer opens it read-only through ``/proc/<pid>/fd`` (only processes
of the job, :meth:`HostSharing.allow`). So two processes exchange device values
by reference exactly as CUDA IPC lets them (kvstore/devices/cuda_sharing.py), and
a reader that writes into another's memory fails (the mapping is read-only).

Example::

    sharing = HostSharing("w0")
    a = sharing.empty(0, 4, np.float32)            # "on device 0", exportable
    segment, offset = sharing.export(a)
    peer = HostSharing("s0"); peer.allow([os.getpid()])
    b = peer.open(0, segment, offset, np.float32, (4,))     # the same memory, read-only
"""

from __future__ import annotations

import numpy as np

from ..transport import shm
from .host import _DeviceArray
from .references import Exported, Opened


class HostSharing:
    def __init__(self, label: str):
        self._arena = shm.Arena(f"dev-{label}")
        self._mapper = shm.Mapper()
        self._opened = Opened()        # the same reference again: the same array (kvstore/devices/references.py)
        self._exported = Exported()

    def empty(self, index: int, size: int, dtype):
        host = self._arena.alloc(size, dtype)
        if self._arena.locate(host) is None and host.nbytes:
            raise OSError("no shared memory for emulated device memory (memfd_create failed)")
        return _tagged(host, index)

    def export(self, a):
        place = self._exported.get(a)
        if place is not None:
            return place
        if not isinstance(a, _DeviceArray) or not a.flags.c_contiguous:
            return None
        located = self._arena.locate(a)
        return None if located is None else self._exported.keep(a, (tuple(located[0]), int(located[1])))

    def open(self, index: int, segment, offset: int, dtype, shape):
        dtype = np.dtype(dtype)
        key = (index, tuple(segment), offset, dtype, tuple(shape))
        a = self._opened.get(key)
        if a is None:
            a = self._opened.keep(key, _tagged(self._mapper.view(list(segment), offset, dtype, shape), index))
        return a

    def allow(self, pids) -> None:
        self._mapper.allow(pids)

    def owner(self, segment) -> int | None:
        return shm.owner(segment)

    def publish(self, index: int) -> None:
        pass                  # the host devices complete every operation when it is called

    def close(self) -> None:
        self._opened.clear()
        self._exported.clear()
        self._mapper.close()
        self._arena.close()


def _tagged(host: np.ndarray, index: int):
    a = host.view(_DeviceArray)
    a.device_index = index
    return a
