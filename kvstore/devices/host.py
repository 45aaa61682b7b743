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
    """A numpy array that stands for device memory (a tag; it computes as numpy) on
    emulated device ``device_index``; views and results keep their operand's."""

    device_index = 0

    def __array_finalize__(self, obj) -> None:
        self.device_index = getattr(obj, "device_index", 0)


class _HostArrayModule:
    """numpy as the host device's array module (``HostDevice.xp``), where copies of
    device arrays stay device arrays, as ``cupy.copy`` of a GPU array stays on the GPU
    (numpy's ``copy`` would return untagged host memory and hide where it goes)."""

    def __getattr__(self, name):
        value = getattr(np, name)
        setattr(self, name, value)        # (found as an attribute from then on: no call per use)
        return value

    @staticmethod
    def copy(a, order="K"):
        return np.array(a, copy=True, subok=True, order=order)


class HostDevice:
    """Example::

        dev = HostDevice()
        d = dev.empty(4, np.float32)
        dev.upload(d, np.ones(4, np.float32)).done     # True

    With ``sharing`` (a :class:`~kvstore.devices.host_sharing.HostSharing`) its
    memory is exportable, as a GPU's is through CUDA IPC: co-located peers open it.
    ``kernels``: what runs a group of batched optimizer updates
    (:meth:`run_updates`; tests give the multi-tensor kernel built for the host);
    by default each update's own numpy code, in turn."""

    xp = _HostArrayModule()
    index = 0

    def __init__(self, sharing=None, kernels=None):
        self.sharing = sharing
        self.kernels = kernels

    def describe(self) -> str:
        return "host emulation of a GPU (numpy)"

    def scope(self):
        return contextlib.nullcontext()

    def empty(self, size: int, dtype):
        if self.sharing is not None:
            return self.sharing.empty(self.index, size, dtype)
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

    def run_updates(self, group) -> None:
        """A GPU's one launch over the group (kvstore.optimizer.multi_tensor), as a loop."""
        if self.kernels is not None:
            self.kernels(group)
        else:
            group.run_each()


class HostAccelerators:
    """The worker stores' accelerators emulated on numpy (:class:`~kvstore.devices.base.Accelerators`):
    ``count`` devices whose arrays are tagged numpy arrays (:meth:`empty`,
    :meth:`to_device`); a value "on a GPU" is such an array. Every copy checks that
    it goes where it says (host to device, device to host, within one device,
    across two), so that CI runs the GPU stores' code path and a missing or
    misdirected copy fails there. Example::

        acc = HostAccelerators(2)
        g = acc.to_device(np.ones(3, np.float32), 1)     # "on GPU 1"
        acc.holds(g), acc.index_of(g)                    # True, 1

    With ``sharing`` (a :class:`~kvstore.devices.host_sharing.HostSharing`) their
    memory can be exported to co-located peers, as CUDA IPC exports a GPU's.
    """

    def __init__(self, count: int = 1, sharing=None):
        self.count = count
        self.sharing = sharing
        self.uploads = 0          # host-to-device copies made (tests count them)
        self.downloads = 0        # device-to-host copies queued
        self.batches = 0          # copy_many and write_many calls (one kernel each on a GPU)

    def holds(self, value) -> bool:
        return isinstance(value, _DeviceArray)

    def index_of(self, value) -> int:
        if not self.holds(value):
            raise TypeError(f"{type(value).__name__} is not on an emulated device")
        return int(value.device_index)

    def current(self) -> int:
        return 0

    def native(self, value) -> bool:
        return isinstance(value, _DeviceArray)

    def view(self, value, what: str):
        if not self.holds(value):
            raise TypeError(f"{what}: a {type(value).__name__} on the host is not a device value")
        return value

    def on(self, index: int):
        self._check_index(index)
        return contextlib.nullcontext()

    def empty(self, index: int, size: int, dtype):
        self._check_index(index)
        a = np.empty(size, dtype).view(_DeviceArray)
        a.device_index = index
        return a

    def address(self, a) -> int:
        self.index_of(a)
        return int(a.__array_interface__["data"][0])

    def contiguous(self, a):
        self.index_of(a)
        return a if a.flags.c_contiguous else np.array(a, order="C", subok=True)

    def to_device(self, host: np.ndarray, index: int):
        self._check_host(host, "to_device")
        self.uploads += 1
        dst = self.empty(index, host.size, host.dtype).reshape(host.shape)
        np.copyto(dst, host, casting="no")
        return dst

    def copy(self, dst, src) -> None:
        if self.index_of(dst) != self.index_of(src):
            raise ValueError(f"copy: from device {src.device_index} to device {dst.device_index} "
                             "needs a peer copy")
        np.copyto(dst, src, casting="no")

    def copy_many(self, dsts: list, srcs: list) -> None:
        if len(dsts) != len(srcs):
            raise ValueError(f"copy_many: {len(srcs)} sources for {len(dsts)} destinations")
        for dst, src in zip(dsts, srcs):
            if dst.shape != src.shape:
                raise ValueError(f"copy_many: {src.size} values into an array of {dst.size}")
            # copy()'s checks, inline: one kernel for them all on a GPU, so little Python each here
            if type(dst) is not _DeviceArray or type(src) is not _DeviceArray:
                self.copy(dst, src)               # (a subclass, or not device memory: its checks say)
                continue
            if dst.device_index != src.device_index:
                raise ValueError(f"copy: from device {src.device_index} to device {dst.device_index} "
                                 "needs a peer copy")
            np.copyto(dst, src, casting="no")
        self.batches += 1

    def peer_copy(self, dst, src) -> None:
        if self.index_of(dst) == self.index_of(src):
            raise ValueError(f"peer_copy: both arrays are on device {dst.device_index}")
        np.copyto(dst, src, casting="no")

    def add(self, a, b):
        self._same_device(a, b)
        return np.add(a, b)

    def add_into(self, total, term) -> None:
        self._same_device(total, term)
        total += term

    def pinned_empty(self, size: int, dtype) -> np.ndarray:
        return np.empty(size, dtype)

    def download(self, src, dst: np.ndarray):
        self.index_of(src)
        self._check_host(dst, "download")
        if dst.size != src.size:
            raise ValueError(f"download: {src.size} values into a host array of {dst.size}")
        self.downloads += 1
        np.copyto(dst.reshape(-1), src.reshape(-1), casting="no")
        return None

    def wait(self, tokens: list) -> None:
        pass

    def upload(self, dst, host: np.ndarray) -> None:
        self.index_of(dst)
        self._check_host(host, "upload")
        if dst.size != host.size:
            raise ValueError(f"upload: {host.size} values into a device array of {dst.size}")
        self.uploads += 1
        np.copyto(dst.reshape(-1), host.reshape(-1), casting="no")

    def settle(self, values: list) -> None:
        for v in values:          # what the store read must be the caller's device values
            if self.holds(v):
                self.index_of(v)

    def write(self, out, src) -> None:
        self.index_of(src)
        if not self.holds(out):
            # to a host output (numpy, torch): a download
            from . import arrays
            arrays.write(out, np.asarray(src).view(np.ndarray))
            self.downloads += 1
        elif out.device_index != src.device_index:
            self.peer_copy(out, src.reshape(out.shape))
        else:
            self.copy(out, src.reshape(out.shape))

    def write_many(self, outs: list, srcs: list) -> None:
        if len(outs) != len(srcs):
            raise ValueError(f"write_many: {len(srcs)} sources for {len(outs)} outputs")
        for out, src in zip(outs, srcs):
            # write()'s checks, inline for a device output on the source's device (one kernel on a GPU)
            if (type(out) is _DeviceArray and type(src) is _DeviceArray and out.device_index == src.device_index
                    and out.size == src.size):
                np.copyto(out, src.reshape(out.shape), casting="no")
            else:
                self.write(out, src)
        self.batches += 1

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.count:
            raise ValueError(f"no emulated device {index} (there are {self.count})")

    def _check_host(self, a, what: str) -> None:
        if self.holds(a):
            raise TypeError(f"{what}: device memory where host memory was expected")

    def _same_device(self, a, b) -> None:
        if self.index_of(a) != self.index_of(b):
            raise ValueError(f"arrays on devices {a.device_index} and {b.device_index} in one kernel")
