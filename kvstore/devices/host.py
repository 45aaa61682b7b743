"""The device interface on numpy (kvstore/devices/__init__.py): what CI runs the
GPU code path on.

"Device" arrays are numpy arrays of their own, tagged as device memory: an
upload or download is an explicit copy between memory that never aliases the
caller's (a missing copy shows as a shared buffer or an untagged array, which
tests check with :meth:`HostDevice.is_device_array`), and the stream is ordered
by construction (each copy completes when queued; events are done at once).
"""

from __future__ import annotations

import contextlib

import numpy as np


class _Done:
    done = True


class _DeviceArray(np.ndarray):
    """A numpy array that stands for device memory (a tag; it computes as numpy)."""


class HostDevice:
    """Example::

        dev = HostDevice()
        d = dev.empty(4, np.float32)
        dev.upload(d, np.ones(4, np.float32)).done     # True
    """

    xp = np
    index = 0

    def describe(self) -> str:
        return "host emulation of a GPU (numpy)"

    def scope(self):
        return contextlib.nullcontext()

    def empty(self, size: int, dtype):
        return np.empty(size, dtype).view(_DeviceArray)

    def pinned_empty(self, size: int, dtype) -> np.ndarray:
        return np.empty(size, dtype)

    def upload(self, dst, src: np.ndarray) -> _Done:
        self.copy_in(dst, src)
        return _Done()

    def copy_in(self, dst, src: np.ndarray) -> None:
        if not self.is_device_array(dst):
            raise TypeError("upload: the destination is not device memory")
        if self.is_device_array(src):
            raise TypeError("upload: the source is device memory, not the host's")
        if dst.size != src.size:
            raise ValueError(f"upload: {src.size} values into a device array of {dst.size}")
        np.copyto(dst.reshape(-1), src.reshape(-1), casting="no")

    def download(self, src, dst: np.ndarray) -> None:
        if not self.is_device_array(src):
            raise TypeError("download: the source is not device memory")
        if self.is_device_array(dst) or dst.shape != src.shape:
            raise ValueError(f"download: into {type(dst).__name__} of shape {dst.shape} from {src.shape}")
        np.copyto(dst, src, casting="no")

    def synchronize(self) -> None:
        pass

    def is_device_array(self, a) -> bool:
        # device arrays, and views of them (a kernel's result on device arrays is one too)
        return isinstance(a, _DeviceArray)

    def address(self, a) -> int:
        return int(a.__array_interface__["data"][0])
