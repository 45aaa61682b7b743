"""The interface every device implements (kvstore/devices/__init__.py)."""

from __future__ import annotations

from typing import Any, ContextManager, Protocol

import numpy as np


class Event(Protocol):
    """A point in the device's stream; ``done`` once everything before it ran."""

    @property
    def done(self) -> bool: ...


class Device(Protocol):
    """One accelerator (or its host emulation) with one ordered stream of work.

    Arrays of the device are ``xp`` arrays; host arrays are numpy. Copies between
    the two are queued on the stream (``upload``, ``download``) and ordered by it;
    ``synchronize`` waits for everything queued."""

    xp: Any           # the array module kernels use (cupy, or numpy for the host device)
    index: int        # the device's ordinal (0 for the host device)
    sharing: Sharing | None   # its memory as co-located processes open it (None: they cannot)

    def describe(self) -> str: ...

    def scope(self) -> ContextManager:
        """Make this device and its stream current for array calls inside."""
        ...

    def empty(self, size: int, dtype) -> Any:
        """A new flat device array (memory of its own)."""
        ...

    def pinned_empty(self, size: int, dtype) -> np.ndarray:
        """A flat host array that copies to and from the device read asynchronously."""
        ...

    def upload(self, dst, src: np.ndarray) -> Event:
        """Queue a copy of host ``src`` (pinned, same size) into device array ``dst``;
        the returned event is done once the copy has read ``src``."""
        ...

    def copy_in(self, dst, src: np.ndarray) -> None:
        """Queue a copy of host ``src`` (any host memory, same size) into device array
        ``dst``; returns once ``src`` may be reused (pageable memory is staged by the
        driver), later work on the stream sees the values."""
        ...

    def download(self, src, dst: np.ndarray) -> None:
        """Queue a copy of device array ``src`` into host ``dst`` (same shape); its
        values are there after :meth:`synchronize`."""
        ...

    def synchronize(self) -> None: ...

    def is_device_array(self, a) -> bool: ...

    def address(self, a) -> int:
        """Where ``a``'s memory starts (identifies a device buffer)."""
        ...

    def run_updates(self, group) -> None:
        """Queue a group of planned optimizer updates of its arrays
        (kvstore.optimizer.multi_tensor.KernelGroup: one kernel, one dtype, many chunks): one
        multi-tensor kernel launch on a GPU; the host device's equivalent loop."""
        ...


class Accelerators(Protocol):
    """The accelerators of a worker process as the GPU stores use them
    (kvstore/devices/staging.py): the caller's values that live on them (torch
    CUDA tensors, cupy arrays), memory on each, and the copies between them and
    the host. Every copy either returns once its source may be reused, or returns
    a token that :meth:`wait` completes."""

    sharing: Sharing | None   # device memory co-located processes open (None: they cannot)
    count: int                # the devices, ordinals 0 to count - 1

    def holds(self, value) -> bool:
        """Whether ``value`` lives on one of these devices."""
        ...

    def index_of(self, value) -> int:
        """The ordinal of the device ``value`` lives on."""
        ...

    def current(self) -> int:
        """The device new work goes to by default (the process's current device)."""
        ...

    def view(self, value, what: str) -> Any:
        """An array of the device's array module over ``value``'s memory (no copy)."""
        ...

    def native(self, value) -> bool:
        """Whether ``value`` is an array of the device's array module itself (a cupy
        array, not a torch tensor): :meth:`view` returns it as it is, and copies into
        it need no other library's stream joined."""
        ...

    def on(self, index: int) -> ContextManager:
        """Make device ``index`` current for array calls inside."""
        ...

    def empty(self, index: int, size: int, dtype) -> Any:
        """A new flat array on device ``index``."""
        ...

    def address(self, a) -> int:
        """Where the device array ``a``'s memory starts."""
        ...

    def contiguous(self, a) -> Any:
        """``a`` itself when C-contiguous, else a contiguous copy on its device."""
        ...

    def to_device(self, host: np.ndarray, index: int) -> Any:
        """A new array on device ``index`` holding ``host``'s values; ``host`` may be
        reused once this returns."""
        ...

    def copy(self, dst, src) -> None:
        """``dst[...] = src`` for arrays on the same device."""
        ...

    def peer_copy(self, dst, src) -> None:
        """``dst[...] = src`` for arrays on different devices, ordered after the work
        queued on both (no host synchronisation)."""
        ...

    def copy_many(self, dsts: list, srcs: list) -> None:
        """:meth:`copy` of each pair (flat arrays of one size and dtype, each pair on one
        device), in as few kernels as the device allows (one on a GPU)."""
        ...

    def add(self, a, b) -> Any:
        """A new array ``a + b`` on their device (the operands stay intact)."""
        ...

    def add_into(self, total, term) -> None:
        """``total += term`` on their device."""
        ...

    def pinned_empty(self, size: int, dtype) -> np.ndarray:
        """Host memory that copies to and from the devices read asynchronously."""
        ...

    def download(self, src, dst: np.ndarray) -> Any:
        """Queue a copy of device array ``src`` into host ``dst`` (same size); returns
        a token: the values are in ``dst`` once :meth:`wait` returned for it."""
        ...

    def wait(self, tokens: list) -> None:
        """Wait for the copies of ``tokens``."""
        ...

    def upload(self, dst, host: np.ndarray) -> None:
        """``dst[...] = host`` for a contiguous device array ``dst``; ``host`` may be
        reused once this returns."""
        ...

    def write(self, out, src) -> None:
        """Write device array ``src`` into the caller's output ``out`` (on a device,
        across devices by a peer copy, or on the host)."""
        ...

    def write_many(self, outs: list, srcs: list) -> None:
        """:meth:`write` of each pair, those into outputs on their source's device in
        as few kernels as the device allows (a call's replies into its outputs)."""
        ...

    def settle(self, values: list) -> None:
        """After kernels that read the caller's ``values`` were queued: the caller's
        later work on them waits for those kernels (no host synchronisation)."""
        ...


class Sharing(Protocol):
    """Device memory that co-located processes open without a host copy: CUDA IPC
    (kvstore/devices/cuda_sharing.py) or, on the host devices CI runs, shared
    memory (kvstore/devices/host_sharing.py). The cuda_ipc transport
    (kvstore/transport/links/cuda_ipc_link.py and its endpoint) is built on it.

    A reference to exported memory is ``(segment, offset)``: ``segment`` a tuple of
    at most 16 ints naming one exported allocation (the codec's ``dev`` segments,
    docs/protocol.md 2.7), ``offset`` a byte offset into it. Ordering is the
    exporter's: it makes the memory's values complete (:meth:`publish`) before it
    sends a reference, and the reader finishes reading before it answers."""

    def empty(self, index: int, size: int, dtype) -> Any:
        """A new flat array on device ``index`` that :meth:`export` can name."""
        ...

    def export(self, a) -> tuple[tuple[int, ...], int] | None:
        """``(segment, offset)`` of a C-contiguous device array a peer can open, or
        None when it does not lie in exportable memory."""
        ...

    def open(self, index: int, segment, offset: int, dtype, shape) -> Any:
        """A peer's exported array, usable on device ``index``, read-only where the
        platform allows; ProtocolError (naming the segment) when it cannot be opened
        or the array does not fit it. Opened allocations are cached."""
        ...

    def allow(self, pids) -> None:
        """The processes whose memory :meth:`open` accepts (the job's peers)."""
        ...

    def owner(self, segment) -> int | None:
        """The process whose memory ``segment`` is, when the segment names it (the
        host devices' ``[pid, fd, size]``); None when it is opaque (a CUDA IPC handle)."""
        ...

    def publish(self, index: int) -> None:
        """Wait until the work queued on device ``index`` (its current stream) is
        done, so a peer that reads this process's exported memory sees its values."""
        ...

    def close(self) -> None:
        """Close what was opened and exported (arrays already handed out stay valid
        where the platform allows)."""
        ...
