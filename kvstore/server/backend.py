"""Where a server keeps its arrays: host memory (numpy) or one GPU (cupy).

:class:`~kvstore.server.state.ServerState` is one code path over an array
module; the backend is the only part that knows where the memory is. It
allocates values, sums and (through the optimizer's ``create_state``) optimizer
state, moves request buffers in (:meth:`upload`) and reply values out
(:meth:`download`), and gives the state a scope (:meth:`scope`) in which every
array operation runs on the right device and stream.

``HostBackend`` is what every CPU server uses: uploads are no-ops (a push is
kept as the view on the message it came in), downloads return the values
themselves, so the CPU path is exactly what it was before GPUs existed.

``GpuBackend`` (``KVSTORE_SERVER_DEVICE=gpu``) keeps everything on one GPU. It is
``DeviceBackend`` on a CUDA device of the device layer (kvstore/devices); CI runs
the same ``DeviceBackend`` on the layer's host device:

- a request buffer is copied into a pinned host buffer and sent to the device
  by an asynchronous copy on the server's CUDA stream, so the server goes back to
  receiving the next message while the DMA runs; the pinned buffer returns to
  the pool once an event says the copy has read it;
- sums and optimizer updates are queued on the same stream (the optimizer runs
  one fused kernel per chunk, kvstore.optimizer.fused);
- replies are copied device-to-host on that stream, one synchronisation per
  reply: a sync round's values into one mirror per value in the node's shared
  memory, which co-located workers read in place as they read a CPU server's
  values (pinned memory where the node has no shared memory); async replies into
  fresh pinned buffers.

Example::

    backend = GpuBackend(device=0)           # raises ServerDeviceError without a GPU
    state = ServerState(name="server 0", backend=backend)
"""

from __future__ import annotations

import contextlib
from collections import deque

import numpy as np

from ..errors import ConfigError


class ServerDeviceError(ConfigError):
    """A GPU server was asked for where no GPU is usable (the message says why)."""


class HostBackend:
    """Values in host memory (numpy), allocated by ``alloc`` (shared memory on a node)."""

    name = "cpu"
    xp = np

    def __init__(self, alloc=None, shared=None):
        self.alloc = alloc or (lambda size, dtype: np.empty(size, dtype))
        # whether co-located workers can map an array (alloc may fall back to private memory)
        self.shared = shared or (lambda a: True)

    def scope(self):
        return contextlib.nullcontext()

    def upload(self, host: np.ndarray, out=None):
        """``host`` as an array of this backend: itself (no copy), or copied into ``out``."""
        if out is None:
            return host
        np.copyto(out, host)
        return out

    def download(self, arrays: list, copy: bool = False) -> list:
        """Host arrays holding ``arrays``' values: the arrays themselves unless ``copy``."""
        return [np.array(a, order="C", copy=True) for a in arrays] if copy else list(arrays)

    def to_numpy(self, a) -> np.ndarray:
        """A host array with ``a``'s values (``a`` itself when it is on the host)."""
        return np.asarray(a)

    def describe(self) -> str:
        return "host memory"


class DeviceBackend:
    """Values, sums and optimizer state on one device (kvstore.devices), one stream.

    The GPU server's code path: :class:`GpuBackend` runs it on a CUDA device; CI
    runs it on :class:`kvstore.devices.HostDevice`, whose "device" memory is
    distinct from the host's, so shapes, copies and method names are checked there."""

    name = "gpu"

    def __init__(self, device, host=None):
        self.dev = device
        self.xp = device.xp
        self._in_flight: deque = deque()    # (event, pinned buffer) of uploads still reading it
        # host: an allocator of shared memory (the node's shm.Arena) for reply mirrors,
        # which co-located workers read in place
        self._host = host
        self._mirrors: dict = {}            # (device address, bytes) -> host mirror

    def scope(self):
        """Make our device and stream current for every array call inside."""
        return self.dev.scope()

    def alloc(self, size: int, dtype):
        return self.dev.empty(size, dtype)

    def shared(self, a) -> bool:
        return False      # device memory: co-located workers cannot write into it (no write-in)

    def upload(self, host: np.ndarray, out=None):
        """Copy ``host`` to the device through a pinned buffer, asynchronously on our
        stream; returns the device array (``out``, or a new one of ``host``'s shape).
        Later work on the stream sees the data; ``host`` may be reused at once."""
        self._release_done()
        if out is None:
            out = self.alloc(host.size, host.dtype).reshape(host.shape)
        if host.size == 0:
            return out
        pinned = self.dev.pinned_empty(host.size, host.dtype)
        np.copyto(pinned, host.reshape(-1))
        event = self.dev.upload(out, pinned)
        self._in_flight.append((event, pinned))   # keeps the pinned block out of the pool
        return out

    def _release_done(self) -> None:
        while self._in_flight and self._in_flight[0][0].done:
            self._in_flight.popleft()

    def _on_host(self, a) -> bool:
        return isinstance(a, np.ndarray) and not self.dev.is_device_array(a)

    def download(self, arrays: list, copy: bool = False) -> list:
        """Host copies of ``arrays``: every device-to-host copy is queued on our
        stream, then one synchronisation. With ``copy`` each is a fresh pinned
        array; without (a sync round's values, which cannot change before the
        reader pushes again, as on the CPU) each value has one mirror in shared
        memory, rewritten by every download, so co-located workers read replies in
        place. Host arrays are copied."""
        out = []
        for a in arrays:
            if self._on_host(a):
                out.append(np.array(a, order="C", copy=True))
                continue
            host = self.dev.pinned_empty(a.size, a.dtype) if copy else self._mirror(a)
            host = host.reshape(a.shape)
            if a.size:
                self.dev.download(a, host)
            out.append(host)
        self.dev.synchronize()
        return out

    def _mirror(self, a) -> np.ndarray:
        key = (self.dev.address(a), a.nbytes)
        mirror = self._mirrors.get(key)
        if mirror is None or mirror.dtype != a.dtype:
            # Shared memory is not page-locked: cudaHostRegister on it broke CUDA in a
            # process that also maps it as a worker (cudaErrorAlreadyMapped, seen on an
            # H100), so the copy goes through the driver's staging; pinned without it.
            mirror = (self.dev.pinned_empty(a.size, a.dtype) if self._host is None
                      else self._host.alloc(a.size, a.dtype))
            self._mirrors[key] = mirror
        return mirror

    def to_numpy(self, a) -> np.ndarray:
        return a if self._on_host(a) else self.download([a], copy=True)[0]

    def describe(self) -> str:
        return self.dev.describe()


class GpuBackend(DeviceBackend):
    """:class:`DeviceBackend` on GPU ``device`` (cupy); ServerDeviceError without one."""

    def __init__(self, device: int, host=None):
        from .. import gpu
        if not gpu.available():
            raise ServerDeviceError(f"KVSTORE_SERVER_DEVICE=gpu, but no GPU is usable: {gpu.reason()}")
        count = gpu.device_count()
        if not 0 <= device < count:
            raise ServerDeviceError(f"KVSTORE_SERVER_DEVICE=gpu: GPU {device} does not exist "
                                    f"(this host has {count}; see KVSTORE_SERVER_GPUS)")
        from ..devices.cuda import CudaDevice
        super().__init__(CudaDevice(device), host)


def for_config(config, rank: int, alloc=None, shared=None, host=None):
    """The backend a server of rank ``rank`` uses under ``config``: host memory, or
    GPU ``KVSTORE_SERVER_GPUS[rank % len]`` (default: every GPU of the host, in
    order). Raises ServerDeviceError when a GPU was asked for and none is usable."""
    if config.server_device != "gpu":
        return HostBackend(alloc, shared)
    from .. import gpu
    gpus = list(config.server_gpus) if config.server_gpus else list(range(gpu.device_count()))
    if not gpus:
        raise ServerDeviceError(f"KVSTORE_SERVER_DEVICE=gpu, but no GPU is usable: {gpu.reason()}")
    return GpuBackend(gpus[rank % len(gpus)], host)
