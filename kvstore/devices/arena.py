"""Device memory that co-located servers read in place: what ``kv.empty(shape, dtype,
device=i)`` hands out on ``dist_device_sync`` (the device twin of the host arena
behind ``kv.empty(shape, dtype)``, kvstore/transport/shm.py).

A pushpull of a device value copies it into the cuda_ipc link's slot for its chunk
first (kvstore/devices/slots.py): the caller may change its array as soon as the
call returns. A value that lies in this arena's memory is sent by reference as it
is instead: no copy and no slot (the slots would double the gradients' device
memory). The caller's side of the bargain is the host arena's: it leaves the array
unchanged until the pushpull's outputs are filled (``pushpull`` returns then;
``pushpull_async``: until ``wait``), which ``Trainer(flat_buckets=True)`` does with
its gradient buckets. Pushes, which return before the servers read, still copy.

Allocations live until :meth:`DeviceArena.close` (the store's close): a server may
have opened them, and an exported allocation must not be reused for other values.
Example (on the host devices)::

    arena = DeviceArena(HostAccelerators(1, sharing=HostSharing("w")))
    grads = arena.alloc(0, 1024, np.float32)
    arena.locate(grads[256:512])          # (segment, offset): sent in place
    arena.locate(acc.empty(0, 4, np.float32))   # None: copied into a slot
"""

from __future__ import annotations

import bisect

from .base import Accelerators


class DeviceArena:
    def __init__(self, acc: Accelerators):
        if acc.sharing is None:
            raise ValueError("DeviceArena needs accelerators whose memory can be exported")
        self._acc = acc
        self._sharing = acc.sharing
        self._spans: dict[int, list[tuple]] = {}    # device -> (start, end, array), sorted by start

    def alloc(self, index: int, size: int, dtype):
        """A new flat array of ``size`` values on device ``index``, in exportable memory."""
        a = self._sharing.empty(index, size, dtype)
        start = self._acc.address(a)
        bisect.insort(self._spans.setdefault(index, []), (start, start + a.nbytes, a), key=_start)
        return a

    def __bool__(self) -> bool:
        """Whether any memory was allocated here (none: no value can lie in it)."""
        return bool(self._spans)

    def locate(self, a) -> tuple | None:
        """``(segment, offset)`` of a device array that lies wholly in one of this arena's
        allocations (a peer opens it with the device layer's ``Sharing.open``), else None."""
        acc = self._acc
        if not acc.holds(a):
            return None
        spans = self._spans.get(acc.index_of(a))
        if not spans:
            return None
        start = acc.address(a)
        at = bisect.bisect(spans, start, key=_start) - 1
        if at < 0:
            return None
        lo, hi, _ = spans[at]
        if not (lo <= start and start + a.nbytes <= hi):
            return None
        return self._sharing.export(a)      # None when not C-contiguous

    def close(self) -> None:
        self._spans.clear()


def _start(span: tuple) -> int:
    return span[0]
