"""The device layer's :class:`~kvstore.devices.base.Sharing` on NVIDIA GPUs: CUDA IPC.

CI has no GPU: this file runs only on GPU hosts (``pytest -m gpu``,
``python -m benchmarks.gpu_check``); its logic's twin on the host devices is
kvstore/devices/host_sharing.py, which CI runs. Keep it thin.

CuPy's memory pool hands out pieces of larger ``cudaMalloc`` allocations, and an
IPC handle names a whole allocation: a reference is the allocation's handle (64
bytes as 8 words), its size, and the piece's offset from its base
(``cuMemGetAddressRange``). Measured on an H100 (benchmarks/gpu_check/ipc.py,
2026-11-27): opening a handle once took 149 ms; reading the peer's 102 MB after it
0.08 ms. Ordering: the exporter synchronises the stream that wrote the memory
before it sends a reference (:meth:`CudaSharing.publish`: one stream, not the
device), and a reader finishes its reads before it answers.
"""

from __future__ import annotations

import ctypes
import math

from ..errors import ProtocolError
from ..transport.shm import fits
from .references import Exported, Opened

HANDLE_WORDS = 8          # cudaIpcMemHandle_t: 64 bytes
LAZY_PEER_ACCESS = 1      # cudaIpcMemLazyEnablePeerAccess: a peer GPU's memory opens too


class CudaSharing:
    def __init__(self):
        import cupy
        self._cupy = cupy
        self._rt = cupy.cuda.runtime
        self._driver = ctypes.CDLL("libcuda.so.1")
        self._exported: dict[tuple, tuple[int, ...]] = {}   # (allocation base, size) -> its segment
        self._opened: dict[tuple, tuple[int, int]] = {}      # (handle, device) -> (mapped base, real size)
        self._arrays = Opened()        # the same reference again: the same array (kvstore/devices/references.py)
        self._places = Exported()

    def empty(self, index: int, size: int, dtype):
        with self._cupy.cuda.Device(index):
            return self._cupy.empty(size, dtype)

    def export(self, a):
        place = self._places.get(a)
        if place is not None:
            return place
        if not isinstance(a, self._cupy.ndarray) or not a.flags.c_contiguous:
            return None
        ptr = int(a.data.ptr)
        # under its device: the driver call needs a current context (a fresh thread,
        # e.g. the Trainer's communication thread, has none until a runtime call)
        with a.device:
            base, size = self._range(ptr)
        segment = self._exported.get((base, size))
        if segment is None:
            with a.device:
                handle = bytes(self._rt.ipcGetMemHandle(base))
            words = tuple(int.from_bytes(handle[i:i + 8], "little") for i in range(0, 64, 8))
            segment = self._exported[(base, size)] = (*words, size)
        return self._places.keep(a, (segment, ptr - base))

    def _range(self, ptr: int) -> tuple[int, int]:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        err = self._driver.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
        if err:
            raise RuntimeError(f"cuMemGetAddressRange failed (CUresult {err})")
        return base.value, size.value

    def open(self, index: int, segment, offset: int, dtype, shape):
        key = (index, tuple(segment), offset, dtype, tuple(shape))
        a = self._arrays.get(key)
        if a is None:
            a = self._arrays.keep(key, self._open(index, segment, offset, dtype, shape))
        return a

    def _open(self, index: int, segment, offset: int, dtype, shape):
        cupy = self._cupy
        if not (len(segment) == HANDLE_WORDS + 1 and all(type(v) is int and 0 <= v < 1 << 64 for v in segment)):
            raise ProtocolError(f"bad device-memory segment {list(segment)!r}: expected 8 handle words and a size")
        nbytes = math.prod(shape) * dtype.itemsize
        key = (tuple(segment[:HANDLE_WORDS]), index)     # the handle, whatever size it is said to have
        opened = self._opened.get(key)
        if opened is None:
            handle = b"".join(w.to_bytes(8, "little") for w in segment[:HANDLE_WORDS])
            try:
                with cupy.cuda.Device(index):
                    base = self._rt.ipcOpenMemHandle(handle, LAZY_PEER_ACCESS)
                    # the allocation's real size, not the one the sender declares
                    real = self._range(base)[1]
            except (cupy.cuda.runtime.CUDARuntimeError, RuntimeError) as e:
                raise ProtocolError(f"cannot open a peer's device memory: {e}") from None
            opened = self._opened[key] = (base, real)
        base, real = opened
        if not fits(offset, nbytes, dtype.alignment, real):
            raise ProtocolError(f"device buffer at offset {offset} ({nbytes} bytes) does not fit its "
                                f"allocation of {real} bytes")
        memory = cupy.cuda.UnownedMemory(base + offset, nbytes, self, index)
        return cupy.ndarray(tuple(shape), dtype, cupy.cuda.MemoryPointer(memory, 0))

    def allow(self, pids) -> None:
        pass      # an IPC handle is opened only by processes its exporter sent it to

    def owner(self, segment) -> int | None:
        return None   # a handle does not say whose it is: the data plane holds it for its first sender

    def publish(self, index: int) -> None:
        with self._cupy.cuda.Device(index):
            self._cupy.cuda.get_current_stream().synchronize()

    def close(self) -> None:
        self._arrays.clear()
        self._places.clear()
        for (_, index), (base, _) in self._opened.items():
            try:
                with self._cupy.cuda.Device(index):
                    self._rt.ipcCloseMemHandle(base)
            except Exception:   # a context torn down at exit: nothing left to close
                pass
        self._opened.clear()
        self._exported.clear()
