"""Is there a usable GPU? One cached probe of CuPy, and pinned host staging.

The probe runs on first use (never at import): it imports ``cupy``, counts the
devices and runs a tiny kernel on the current one, so a wheel that imports but
cannot work (no driver, a driver too old for the wheel's CUDA, no NVRTC) counts
as "no GPU" instead of failing in the middle of training. The result is kept
for the life of the process; :func:`reason` says why the answer is no.

We code against the ``cupy`` module, not one wheel: ``cupy-cuda12x`` and
``cupy-cuda13x`` both provide it.

Example::

    from kvstore import gpu
    if gpu.available():
        xp = gpu.xp_for(value)        # cupy for cupy arrays and torch CUDA tensors
    else:
        log.info("CPU only: %s", gpu.reason())
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import warnings
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Probe:
    """What the probe found. ``reason`` explains a ``False``; ``devices`` counts GPUs."""
    ok: bool
    reason: str
    devices: int = 0
    cupy_version: str | None = None


_lock = threading.Lock()
_probe_result: Probe | None = None    # the process-wide cache (a GPU is a process-wide fact)
_fallbacks_logged: set[str] = set()   # store types whose CPU fallback was already logged


def _run_probe() -> Probe:
    """Probe without caching (tests call this with a fake ``cupy`` module)."""
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install raising anything
        return Probe(False, f"cupy cannot be imported ({type(e).__name__}: {e}); install "
                            "cupy-cuda12x or cupy-cuda13x to match the CUDA driver")
    version = getattr(cupy, "__version__", None)
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
        if count < 1:
            return Probe(False, "cupy found no CUDA device (check CUDA_VISIBLE_DEVICES)",
                         0, version)
        # a real allocation, an elementwise kernel (NVRTC) and a reduction, as the stores use
        x = cupy.arange(4, dtype=cupy.float32)
        if float((x + x).sum()) != 12.0:
            return Probe(False, "a test kernel on the GPU gave a wrong result", count, version)
    except Exception as e:  # noqa: BLE001 - CUDA runtime/driver/compiler errors have no common base
        return Probe(False, f"cupy {version} is installed but the GPU is not usable "
                            f"({type(e).__name__}: {e})", 0, version)
    return Probe(True, f"cupy {version} with {count} CUDA device(s)", count, version)


def probe() -> Probe:
    """The cached probe result (probes on the first call; thread-safe)."""
    global _probe_result
    result = _probe_result
    if result is None:
        with _lock:
            if _probe_result is None:
                _probe_result = _run_probe()
                log.debug("GPU probe: %s", _probe_result.reason)
            result = _probe_result
    return result


def available() -> bool:
    """True when cupy is importable and a GPU runs kernels (probed once per process)."""
    return probe().ok


def reason() -> str:
    """Why :func:`available` says what it says (e.g. the CUDA error)."""
    return probe().reason


def device_count() -> int:
    """Number of usable CUDA devices (0 without a usable GPU)."""
    result = probe()
    return result.devices if result.ok else 0


def log_cpu_fallback(store_type: str) -> None:
    """Log once per process and store type that ``store_type`` aggregates on the CPU."""
    with _lock:
        if store_type in _fallbacks_logged:
            return
        _fallbacks_logged.add(store_type)
    log.info("no GPU found: the %r store aggregates on the CPU (%s)", store_type, reason())


def cupy_module():
    """The ``cupy`` module; raises RuntimeError naming the probe's reason when unusable."""
    if not available():
        raise RuntimeError(f"no usable GPU: {reason()}")
    import cupy
    return cupy


_DLPACK_CUDA = (2, 13)   # DLPack's kDLCUDA and kDLCUDAManaged device types


def xp_for(value):
    """The array module for computing on ``value``: cupy for cupy arrays and torch
    CUDA tensors when a GPU is usable, numpy otherwise (a host copy is needed).

    The value's DLPack device says where it lives, so this module needs no
    knowledge of array families (that is kvstore.devices.arrays, which builds on this one)."""
    where = getattr(value, "__dlpack_device__", None)
    if where is not None and int(where()[0]) in _DLPACK_CUDA and available():
        import cupy
        return cupy
    return np


# -- pinned host staging ----------------------------------------------------------------
def pinned_empty(size: int, dtype) -> np.ndarray:
    """A flat numpy array of ``size`` elements in page-locked (pinned) host memory.

    It comes from CuPy's pinned-memory pool and goes back to it when the array is
    garbage collected, so steady-state staging allocates nothing new. Without a
    usable GPU this is a plain ``np.empty``.
    """
    dtype = np.dtype(dtype)
    if size == 0 or not available():
        return np.empty(size, dtype)
    import cupy
    mem = cupy.cuda.alloc_pinned_memory(size * dtype.itemsize)
    return np.frombuffer(mem, dtype, size)   # the array keeps ``mem`` (and the block) alive


def is_pinned(host: np.ndarray) -> bool:
    """True when ``host``'s memory is page-locked (False without a usable GPU)."""
    if not available() or host.size == 0:
        return False
    import cupy
    try:
        attrs = cupy.cuda.runtime.pointerGetAttributes(host.ctypes.data)
    except Exception:  # noqa: BLE001 - older CUDA raises for memory it does not know
        return False
    return attrs.type == cupy.cuda.runtime.memoryTypeHost


def to_host(value, out: np.ndarray | None = None) -> np.ndarray:
    """Copy a cupy array to the host through pinned memory; returns ``out`` (or a
    fresh pinned array) shaped like ``value``. Blocks until the copy is done."""
    import cupy
    with value.device:
        src = value if value.flags.c_contiguous else cupy.ascontiguousarray(value)
        if out is None:
            out = pinned_empty(src.size, src.dtype)
        out = out.reshape(src.shape)
        src.get(out=out)          # synchronous; a DMA transfer when ``out`` is pinned
    return out


def copy_from_host(dst, host: np.ndarray) -> None:
    """``dst[...] = host`` for a C-contiguous cupy ``dst`` and a numpy ``host`` of the
    same shape and dtype, on the current stream of dst's device.

    Returns once ``host`` may be changed or freed. From pinned memory the copy is a
    DMA that runs after the stream's earlier work, and ``ndarray.set`` does not wait
    for it: a staging buffer handed back to the pinned pool (which reuses the last
    freed block first) would feed the next key's values into this copy. So we wait
    for the copy's event; pageable sources are staged by the driver before
    ``set`` returns and need no wait."""
    import cupy
    with dst.device:
        stream = cupy.cuda.get_current_stream()
        dst.set(host, stream)
        if is_pinned(host):
            stream.record().synchronize()


def to_device(host: np.ndarray, device: int):
    """A new cupy array on ``device`` holding a copy of numpy ``host``; ``host`` may
    be changed or freed as soon as this returns (see :func:`copy_from_host`)."""
    import cupy
    host = np.ascontiguousarray(host).reshape(host.shape)   # (0-d stays 0-d)
    with cupy.cuda.Device(device):
        dst = cupy.empty(host.shape, host.dtype)
        copy_from_host(dst, host)
    return dst


def join_streams(device: int) -> None:
    """Order torch's and cupy's current streams on ``device`` after each other's
    work so far (GPU-side event waits, no host sync; nothing when both use the
    same stream, as with the default streams).

    DLPack already makes a consumer wait for the producer; this covers the other
    direction: neither library may overwrite or free memory the other still reads.
    """
    torch = sys.modules.get("torch")
    if torch is None or not available() or not torch.cuda.is_initialized():
        return
    import cupy
    with cupy.cuda.Device(device):
        ours = cupy.cuda.get_current_stream()
        theirs = torch.cuda.current_stream(device)
        if int(theirs.cuda_stream) == int(ours.ptr):
            return
        other = _cupy_stream_of(cupy, theirs, device)
        theirs_done, ours_done = other.record(), ours.record()
        ours.wait_event(theirs_done)
        other.wait_event(ours_done)


@contextlib.contextmanager
def on_stream(stream, device: int):
    """Make torch stream ``stream`` current on ``device`` for torch and, where a GPU
    is usable through CuPy, for cupy too, so that both libraries queue the work
    inside on it (the Trainer's exchanges during backward: a non-blocking stream
    does not queue behind the backward kernels on the default stream)."""
    import torch  # the caller handed us a torch stream: torch is imported already
    with torch.cuda.device(device), torch.cuda.stream(stream):
        if not available():
            yield
            return
        import cupy
        with cupy.cuda.Device(device), _cupy_stream_of(cupy, stream, device):
            yield


def _cupy_stream_of(cupy, theirs, device: int):
    """A cupy handle on torch stream ``theirs`` (for recording and waiting on events)."""
    # from_external (cupy >= 14) needs the CUDA stream protocol, which only recent
    # torch streams implement; ExternalStream works everywhere but cupy 14 deprecates it
    if hasattr(cupy.cuda.Stream, "from_external") and hasattr(theirs, "__cuda_stream__"):
        return cupy.cuda.Stream.from_external(theirs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(int(theirs.cuda_stream), device)


def copy_between_devices(dst, src) -> None:
    """``dst[...] = src`` for cupy arrays (same shape) on different devices.

    A peer copy runs on the destination's stream; events order it after the work
    already queued on the source device's stream and keep that stream from
    changing ``src`` before the copy has read it. No host synchronisation.

    Every stream call runs under its stream's device: the legacy default stream
    (cupy's and torch's default) is a per-device handle that CUDA resolves against
    the *current* device, so a wait issued under another device would order the
    wrong stream."""
    import cupy
    with src.device:
        src_stream = cupy.cuda.get_current_stream()
        src_ready = src_stream.record()
    with dst.device:
        dst_stream = cupy.cuda.get_current_stream()
        dst_stream.wait_event(src_ready)
        cupy.copyto(dst, src)
        copied = dst_stream.record()
    with src.device:
        src_stream.wait_event(copied)
