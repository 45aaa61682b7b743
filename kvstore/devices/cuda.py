"""The device interface on one NVIDIA GPU through CuPy (kvstore/devices/__init__.py).

CI has no GPU: this file only runs on GPU hosts (`pytest -m gpu`,
`python -m benchmarks.gpu_check`). Keep it thin: logic belongs above the layer.
"""

from __future__ import annotations

import contextlib

import numpy as np

from .. import gpu


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
