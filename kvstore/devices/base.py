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
