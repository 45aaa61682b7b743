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


class Accelerators(Protocol):
    """The accelerators of a worker process as the GPU stores use them
    (kvstore/devices/staging.py): the caller's values that live on them (torch
    CUDA tensors, cupy arrays), memory on each, and the copies between them and
    the host. Every copy either returns once its source may be reused, or returns
    a token that :meth:`wait` completes."""

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

    def on(self, index: int) -> ContextManager:
        """Make device ``index`` current for array calls inside."""
        ...

    def empty(self, index: int, size: int, dtype) -> Any:
        """A new flat array on device ``index``."""
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

    def settle(self, values: list) -> None:
        """After kernels that read the caller's ``values`` were queued: the caller's
        later work on them waits for those kernels (no host synchronisation)."""
        ...
