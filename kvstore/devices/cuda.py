"""The device interface on one NVIDIA GPU through CuPy (kvstore/devices/__init__.py).

CI has no GPU: this file only runs on GPU hosts (`pytest -m gpu`,
`python -m benchmarks.gpu_check`). Keep it thin: logic belongs above the layer.
"""

from __future__ import annotations

import contextlib

import numpy as np

from . import arrays, gpu
from .cuda_copies import BatchedCopy
from .cuda_sharing import CudaSharing


class CudaDevice:
    """GPU ``index`` with one non-blocking CUDA stream; pinned staging from CuPy's pool."""

    def __init__(self, index: int):
        import cupy
        self.xp = cupy
        self.index = index
        self._device = cupy.cuda.Device(index)
        with self._device:
            self.stream = cupy.cuda.Stream(non_blocking=True)
            self._label = cupy.cuda.runtime.getDeviceProperties(index)["name"].decode()
        self.sharing = CudaSharing()

    def describe(self) -> str:
        return f"GPU {self.index} ({self._label})"

    @contextlib.contextmanager
    def scope(self):
        with self._device, self.stream:
            yield

    def empty(self, size: int, dtype):
        with self._device:
            return self.xp.empty(size, dtype)

    def pinned_empty(self, size: int, dtype) -> np.ndarray:
        return gpu.pinned_empty(size, dtype)

    def upload(self, dst, src: np.ndarray):
        dst.reshape(-1).set(src.reshape(-1), stream=self.stream)
        return self.stream.record()

    def copy_in(self, dst, src: np.ndarray) -> None:
        dst.reshape(-1).set(src.reshape(-1), stream=self.stream)

    def download(self, src, dst: np.ndarray) -> None:
        src.get(stream=self.stream, out=dst, blocking=False)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def is_device_array(self, a) -> bool:
        return isinstance(a, self.xp.ndarray)

    def address(self, a) -> int:
        return int(a.data.ptr)

    def run_updates(self, group) -> None:
        group.launch()          # one multi-tensor kernel on the current stream (ours, in scope)


class CudaAccelerators:
    """The process's GPUs as the worker stores use them: torch CUDA tensors (viewed
    through DLPack) and cupy arrays; copies on each device's current stream (the
    callers' own streams, so DLPack orders them after the callers' work)."""

    def __init__(self):
        import cupy
        self._cupy = cupy
        self.sharing = CudaSharing()
        self.count = int(cupy.cuda.runtime.getDeviceCount())
        self._batched: BatchedCopy | None = None      # made (and compiled) at first use

    def holds(self, value) -> bool:
        return arrays.is_gpu(value)

    def index_of(self, value) -> int:
        index = arrays.device_of(value)
        assert index is not None                  # of a GPU value (holds)
        return index

    def current(self) -> int:
        return int(self._cupy.cuda.Device().id)

    def view(self, value, what: str):
        return arrays.as_cupy(value, what)

    def native(self, value) -> bool:
        return isinstance(value, self._cupy.ndarray)

    def on(self, index: int):
        return self._cupy.cuda.Device(index)

    def empty(self, index: int, size: int, dtype):
        with self._cupy.cuda.Device(index):
            return self._cupy.empty(size, dtype)

    def address(self, a) -> int:
        return int(a.data.ptr)

    def contiguous(self, a):
        with a.device:
            return self._cupy.ascontiguousarray(a)

    def to_device(self, host: np.ndarray, index: int):
        return gpu.to_device(host, index)

    def copy(self, dst, src) -> None:
        with dst.device:
            self._cupy.copyto(dst, src)

    def peer_copy(self, dst, src) -> None:
        gpu.copy_between_devices(dst, src)

    def copy_many(self, dsts: list, srcs: list) -> None:
        tasks: dict[int, list] = {}
        for dst, src in zip(dsts, srcs, strict=True):
            if dst.size != src.size or dst.dtype != src.dtype:
                raise ValueError(f"copy_many: {src.size} {src.dtype} values into {dst.size} {dst.dtype}")
            index = int(dst.device.id)
            if dst.flags.c_contiguous and src.flags.c_contiguous and index == int(src.device.id):
                tasks.setdefault(index, []).append((int(dst.data.ptr), int(src.data.ptr), int(dst.nbytes)))
            else:
                self.copy(dst, src)
        for index, part in tasks.items():
            with self._cupy.cuda.Device(index):
                self._copies()(part)

    def _copies(self) -> BatchedCopy:
        if self._batched is None:
            self._batched = BatchedCopy()
        return self._batched

    def add(self, a, b):
        with a.device:
            return self._cupy.add(a, b)

    def add_into(self, total, term) -> None:
        with total.device:
            total += term

    def pinned_empty(self, size: int, dtype) -> np.ndarray:
        return gpu.pinned_empty(size, dtype)

    def download(self, src, dst: np.ndarray):
        with src.device:
            stream = self._cupy.cuda.get_current_stream()
            if src.size:
                src.get(stream=stream, out=dst, blocking=False)
            return int(src.device.id), stream

    def wait(self, tokens: list) -> None:
        # under its device: the legacy default stream is resolved against the current one
        for (device, _), stream in {(device, s.ptr): s for device, s in tokens}.items():
            with self._cupy.cuda.Device(device):
                stream.synchronize()

    def upload(self, dst, host: np.ndarray) -> None:
        gpu.copy_from_host(dst, host)       # returns once a pinned ``host`` may be reused

    def write(self, out, src) -> None:
        arrays.write(out, src)

    def write_many(self, outs: list, srcs: list) -> None:
        batched: dict[int, list] = {}       # device -> (out, src, out's address) for one kernel
        plain: list = []
        for out, src in zip(outs, srcs, strict=True):
            place = arrays.device_address(out)
            if (place is not None and src.flags.c_contiguous and place[0] == int(src.device.id)
                    and place[2] == src.dtype and place[3] == src.size):
                batched.setdefault(place[0], []).append((out, src, place[1]))
            else:
                plain.append((out, src))
        for index, items in batched.items():
            if len({address for _, _, address in items}) < len(items):
                # an output listed twice: written in order, the last write wins (one kernel would race)
                plain += [(out, src) for out, src, _ in items]
                continue
            with self._cupy.cuda.Device(index):
                gpu.join_streams(index)     # our stream after torch's work on the outputs
                self._copies()([(address, int(src.data.ptr), int(src.nbytes)) for _, src, address in items])
                gpu.join_streams(index)     # torch's later work after the copies
        for out, src in plain:
            arrays.write(out, src)

    def settle(self, values: list) -> None:
        # torch and cupy may queue on different streams: join them where torch's
        # tensors were read (DLPack ordered the other direction)
        for index in {arrays.device_of(v) for v in values if arrays.is_torch(v) and arrays.is_gpu(v)}:
            assert index is not None
            gpu.join_streams(index)
