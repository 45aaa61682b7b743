"""Shared memory between co-located processes of one job.

A **segment** is an anonymous memory file (Linux ``memfd_create``) owned by the
process that created it, which keeps its file descriptor open. A peer maps it
read-only through ``/proc/<owner pid>/fd/<fd>``: the kernel lets only processes
that may inspect the owner (same user, or privileged) open that path, and we
accept only segments whose name says they are ours (``memfd:kvstore-...``) and
owners that are processes of the job. Segments have no name in any filesystem:
there is nothing to unlink and nothing to guess, and the kernel frees the memory
when the last process that maps it unmaps it or exits, however it exits (a
``kill -9`` included). Nothing is left in ``/dev/shm``.

A worker stages its gradients in its own segments (:class:`Slots`), the server
reads them from its mapping and keeps its values in its own segments
(:class:`Arena`), from which workers copy results. Workers map their servers'
segments writable: in dist_sync a server may grant a worker a sum to copy or add
its gradient into (``write``, docs/protocol.md), which saves the staging copy.
Servers map workers' segments read-only.
Messages carry a segment as ``[pid, fd, size]`` and a buffer as (segment,
offset); see docs/protocol.md ("Shared-memory buffers").
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import weakref

import numpy as np

from ..errors import ProtocolError

log = logging.getLogger(__name__)

PREFIX = "kvstore-"
SEGMENT_BYTES = 256 << 20   # virtual size of a segment; pages are used only when touched
PAGE = 4096


def available() -> bool:
    """Whether this platform has anonymous memory files (Linux)."""
    return hasattr(os, "memfd_create")


class Segment:
    """``size`` bytes of shared memory owned by this process."""

    def __init__(self, size: int, label: str):
        self.fd = os.memfd_create(f"{PREFIX}{label}", getattr(os, "MFD_CLOEXEC", 0))
        try:
            os.ftruncate(self.fd, size)
            self.mm = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.size = size
        self.bytes = np.frombuffer(self.mm, np.uint8)
        self.base = self.bytes.ctypes.data
        self.desc = (os.getpid(), self.fd, size)   # what a peer needs to map it

    def close(self) -> None:
        """Close the descriptor: peers can no longer map it (those that did keep
        their mapping). The memory goes when the last mapping goes."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Arena:
    """1-D numpy arrays allocated in this process's segments.

    An array the caller drops returns its region to a free list (regions of one
    size are reused: chunks come in few sizes). When shared memory cannot be had,
    :meth:`alloc` returns ordinary memory, which :meth:`locate` does not find.

    Example::

        arena = Arena("s0")
        a = arena.alloc(1000, np.float32)
        desc, offset = arena.locate(a)     # send these to a co-located peer
    """

    def __init__(self, label: str, segment_bytes: int = SEGMENT_BYTES):
        self.label = label
        self.segment_bytes = segment_bytes
        self._segments: list[Segment] = []
        self._tops: list[int] = []
        self._free: dict[int, list] = {}
        self._broken: str | None = None if available() else "no memfd_create on this platform"

    def alloc(self, size: int, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(size) * dtype.itemsize
        if nbytes == 0 or self._broken is not None:
            return np.empty(size, dtype)
        padded = -(-nbytes // PAGE) * PAGE if nbytes >= PAGE else -(-nbytes // 64) * 64
        free = self._free.get(padded)
        if free:
            index, offset = free.pop()
        else:
            try:
                index, offset = self._carve(padded)
            except OSError as e:
                self._broken = f"{type(e).__name__}: {e}"
                log.warning("shared memory unavailable (%s); using private memory", self._broken)
                return np.empty(size, dtype)
        array = np.frombuffer(self._segments[index].mm, dtype, int(size), offset)
        weakref.finalize(array, self._free.setdefault(padded, []).append, (index, offset))
        return array

    def _carve(self, padded: int) -> tuple[int, int]:
        for index, top in enumerate(self._tops):
            if self._segments[index].fd >= 0 and top + padded <= self._segments[index].size:
                self._tops[index] = top + padded
                return index, top
        size = max(self.segment_bytes, padded)
        self._segments.append(Segment(size, f"{self.label}-{len(self._segments)}"))
        self._tops.append(padded)
        return len(self._segments) - 1, 0

    def locate(self, array: np.ndarray):
        """``(segment descriptor, byte offset)`` of a C-contiguous array that lies in
        one of our segments, else None."""
        if not self._segments or not array.flags.c_contiguous:
            return None
        addr = array.__array_interface__["data"][0]
        for seg in self._segments:
            if seg.base <= addr and addr + array.nbytes <= seg.base + seg.size and seg.fd >= 0:
                return seg.desc, addr - seg.base
        return None

    def close(self) -> None:
        for seg in self._segments:
            seg.close()


def fits(offset, nbytes: int, alignment: int, size: int) -> bool:
    """Whether ``nbytes`` at byte ``offset`` (aligned to ``alignment``) lie within
    memory of ``size`` bytes: the check of every reference opened, against the size
    of the memory really mapped (never a size the sender declares unchecked)."""
    return type(offset) is int and 0 <= offset and offset + nbytes <= size and offset % alignment == 0


def owner(desc) -> int | None:
    """The process a segment ``[pid, fd, size]`` belongs to (None if malformed: the
    mapper refuses it by name)."""
    if isinstance(desc, (list, tuple)) and len(desc) == 3 and type(desc[0]) is int:
        return desc[0]
    return None


class Mapper:
    """Mappings of other processes' segments, opened on first use: read-only, or
    (``writable``: a worker mapping its servers, which grant it sums to write into)
    read-write.

    ``allow(pids)`` says whose segments may be mapped (the job's peers)."""

    def __init__(self, writable: bool = False):
        self._maps: dict[tuple, tuple[mmap.mmap, int]] = {}
        self._pids: set = set()
        self._flags = os.O_RDWR if writable else os.O_RDONLY
        self._prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)

    def allow(self, pids) -> None:
        self._pids |= {int(p) for p in pids}

    def view(self, desc, offset: int, dtype: np.dtype, shape) -> np.ndarray:
        """The array at ``offset`` of the segment ``desc`` = [pid, fd, size].
        Raises ProtocolError if it is not a segment of a peer or out of bounds."""
        if not (isinstance(desc, (list, tuple)) and len(desc) == 3):
            raise ProtocolError(f"bad shared-memory segment {desc!r}: expected [pid, fd, size]")
        pid, fd, size = desc
        if not (type(pid) is int and type(fd) is int and type(size) is int and pid >= 0 and fd >= 0 and size >= 0):
            raise ProtocolError(f"bad shared-memory segment {desc!r}: expected [pid, fd, size]")
        entry = self._maps.get((pid, fd))
        if entry is None or entry[1] < size:
            entry = self._open(pid, fd, size)
        mm, mapped = entry
        nbytes = math.prod(shape) * dtype.itemsize
        if not fits(offset, nbytes, dtype.alignment, mapped):     # mapped: at most the file's real size
            raise ProtocolError(f"shared buffer at offset {offset!r} ({nbytes} bytes) does not fit "
                                f"segment {desc}")
        return np.frombuffer(mm, dtype, math.prod(shape), offset).reshape(shape)

    def _open(self, pid: int, fd: int, size: int):
        if pid not in self._pids:
            raise ProtocolError(f"shared memory of process {pid}, which is not a peer of this job")
        path = f"/proc/{pid}/fd/{fd}"
        try:
            f = os.open(path, self._flags | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise ProtocolError(f"cannot open the shared memory of process {pid}: {e}") from None
        try:
            name = os.readlink(f"/proc/self/fd/{f}")
            if not name.startswith(f"/memfd:{PREFIX}"):
                raise ProtocolError(f"{path} is not a kvstore segment ({name})")
            if os.fstat(f).st_size < size:
                raise ProtocolError(f"{path} is smaller than the {size} bytes announced")
            mm = mmap.mmap(f, size, prot=self._prot)
        except OSError as e:
            raise ProtocolError(f"cannot map the shared memory of process {pid}: {e}") from None
        finally:
            os.close(f)
        self._maps[(pid, fd)] = (mm, size)
        return mm, size

    def close(self) -> None:
        """Forget the mappings (each is unmapped once no array uses it)."""
        self._maps.clear()


class Slots:
    """Staging buffers in this process's arena, one per key (e.g. a server and a
    chunk), each busy from the request that filled it until that request's reply:
    the reader may use it in place until then.

    Example::

        slots = Slots(arena)
        staged = slots.fill(keys, arrays)      # None: one of them is still busy
        slots.hold(keys, request_id) ... slots.release(request_id)
    """

    def __init__(self, arena: Arena):
        self._arena = arena
        self._slots: dict = {}
        self._busy: dict = {}        # key -> request id
        self._held: dict = {}        # request id -> keys

    def fill(self, keys, arrays) -> list | None:
        """Copy ``arrays`` into the slots of ``keys``; None (nothing copied) if any
        of those slots is busy or lies outside shared memory."""
        if any(k in self._busy for k in keys):
            return None
        staged = []
        for key, a in zip(keys, arrays):
            slot = self._slots.get(key)
            if slot is None or slot.dtype != a.dtype or slot.size != a.size:
                slot = self._arena.alloc(a.size, a.dtype)
                if self._arena.locate(slot) is None:
                    return None
                self._slots[key] = slot
            np.copyto(slot, a.reshape(-1))
            staged.append(slot)
        return staged

    def hold(self, keys, request_id) -> None:
        for k in keys:
            self._busy[k] = request_id
        self._held[request_id] = keys

    def release(self, request_id) -> None:
        for k in self._held.pop(request_id, ()):
            if self._busy.get(k) == request_id:
                del self._busy[k]
