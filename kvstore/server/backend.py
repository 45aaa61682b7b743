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

- a request buffer is sent to the device by an asynchronous copy on the
  server's CUDA stream (the driver stages pageable memory), so the server goes
  back to receiving the next message while the DMA runs;
- sums and optimizer updates are queued on the same stream: the updates of one
  event (the chunks a push completes) in one multi-tensor kernel per optimizer
  kernel and dtype (:meth:`DeviceBackend.batched`, kvstore.optimizer.multi_tensor),
  the others in one fused kernel per chunk (kvstore.optimizer.fused);
- a reply's values are packed into one device buffer and copied device-to-host
  at once on that stream, one synchronisation per reply: a sync round's values
  into one block of the node's shared memory per list of values, which
  co-located workers read in place as they read a CPU server's values (pinned
  memory where the node has no shared memory); async replies into fresh pinned
  blocks.

Example::

    backend = GpuBackend(device=0)           # raises ServerDeviceError without a GPU
    state = ServerState(name="server 0", backend=backend)
"""

from __future__ import annotations

import contextlib

import numpy as np

from ..devices.staging import carved_views
from ..errors import ConfigError
from ..optimizer.multi_tensor import MultiTensorBatch


class ServerDeviceError(ConfigError):
    """A GPU server was asked for where no GPU is usable (the message says why)."""


class HostBackend:
    """Values in host memory (numpy), allocated by ``alloc`` (shared memory on a node)."""

    name = "cpu"
    xp = np
    sharing = None        # host memory: co-located peers map it through the shm endpoint instead

    def __init__(self, alloc=None, shared=None):
        self.alloc = alloc or (lambda size, dtype: np.empty(size, dtype))
        # whether co-located workers can map an array (alloc may fall back to private memory)
        self.shared = shared or (lambda a: True)

    def scope(self):
        return contextlib.nullcontext()

    def batched(self):
        """One event's optimizer updates (see :meth:`DeviceBackend.batched`): on the host,
        each runs when it is asked for."""
        return contextlib.nullcontext()

    def settle(self, a) -> None:
        """Nothing waits here (see :meth:`DeviceBackend.settle`)."""

    def upload(self, host: np.ndarray, out=None):
        """``host`` as an array of this backend: itself (no copy), or copied into ``out``."""
        if out is None:
            return host
        np.copyto(out, host)
        return out

    def download(self, arrays: list, copy: bool = False) -> list:
        """Host arrays holding ``arrays``' values: the arrays themselves unless ``copy``."""
        return [np.array(a, order="C", copy=True) for a in arrays] if copy else list(arrays)

    def download_own(self, arrays: list) -> list:
        """Host arrays of ``arrays`` made for one reply alone (a gather): themselves."""
        return list(arrays)

    # a reply's arrays (DeviceBackend.values): on the host, what download returns (there
    # is nothing to leave on a device), the same method rather than a call through
    values = download

    def on_device(self, arrays: list) -> bool:
        """Whether a reply's arrays include device memory: never, here."""
        return False

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
        # device memory co-located workers open (CUDA IPC; kvstore.devices.Sharing), or None
        self.sharing = device.sharing
        # host: an allocator of shared memory (the node's shm.Arena) for reply mirrors,
        # which co-located workers read in place
        self._host = host
        self._mirrors: dict = {}            # (address, size, dtype) of each value -> (block, views)
        # the optimizer updates of one event, run as one multi-tensor launch per kernel
        self.updates = MultiTensorBatch(device)

    def scope(self):
        """Make our device and stream current for every array call inside."""
        return self.dev.scope()

    def batched(self):
        """A context (one server event, inside :meth:`scope`) whose optimizer updates
        are planned as they come and run together when it closes: one multi-tensor
        kernel per optimizer kernel and dtype for every chunk the event completes,
        instead of one launch each (kvstore.optimizer.multi_tensor). A download, and
        :meth:`settle`, run them first where they must."""
        return self.updates.collect()

    def settle(self, a) -> None:
        """The caller is about to read chunk value ``a``, or to reuse the sum its last
        update read (the chunk's spare): a batched update of it runs first."""
        self.updates.settle(a)

    def alloc(self, size: int, dtype):
        return self.dev.empty(size, dtype)

    def shared(self, a) -> bool:
        return False      # device memory: co-located workers cannot write into it (no write-in)

    def upload(self, host: np.ndarray, out=None):
        """Copy ``host`` to the device, asynchronously on our stream; returns the
        device array (``out``, or a new one of ``host``'s shape). Later work on the
        stream sees the data; ``host`` may be reused at once. A device array (a
        co-located worker's, opened through the cuda_ipc transport) is returned as it
        is, or copied into ``out`` on the device.

        A request buffer (shared memory or a received frame: pageable) goes straight
        to the device: the driver stages it in pieces while the DMA runs. On an H100,
        for ResNet-50's 102 MB of gradients, that took 15.0-15.6 ms against 17.0 ms to
        copy the buffer into pinned memory first and 2.0 ms to send that
        (benchmarks/gpu_check/phases.py)."""
        if self.dev.is_device_array(host):
            if out is None:
                return host
            with self.scope():
                self.xp.copyto(out, host.reshape(out.shape))
            return out
        if out is None:
            out = self.alloc(host.size, host.dtype).reshape(host.shape)
        if host.size:
            self.dev.copy_in(out, host)
        return out

    def _on_host(self, a) -> bool:
        return isinstance(a, np.ndarray) and not self.dev.is_device_array(a)

    def download(self, arrays: list, copy: bool = False) -> list:
        """Host copies of ``arrays``, in one device-to-host copy: the device arrays are
        packed into one device buffer (device to device), which is copied into one host
        block, then one synchronisation. (On an H100 a ResNet-50 reply into pageable
        shared memory took 13.3 ms so and 14.1 ms as 190 copies: the pageable copy's
        7-8 GB/s is the limit either way; CUDA IPC is the way past it.) With ``copy`` the block is fresh
        pinned memory; without (a sync round's values, which cannot change before the
        reader pushes again, as on the CPU) it is one block in shared memory per list
        of values, rewritten by every download of the same list, so co-located
        workers read replies in place. Host arrays are copied."""
        on_device = [a for a in arrays if not self._on_host(a)]
        block, views = self._block(on_device, fresh=copy)
        if on_device:
            with self.scope():
                self.updates.flush()            # batched updates of these values go first
                if len(on_device) == 1:
                    staged = on_device[0].reshape(-1).view(np.uint8) if on_device[0].size else None
                else:
                    staged = self._packed(on_device, block, views)
                if staged is not None:
                    self.dev.download(staged, block[:staged.size])
            self.dev.synchronize()
        hosts = iter(views)
        return [np.array(a, order="C", copy=True) if self._on_host(a) else next(hosts).reshape(a.shape)
                for a in arrays]

    def values(self, arrays: list, copy: bool = False) -> list:
        """A reply's ``arrays``: with ``copy``, host copies made now (:meth:`download`);
        without (a sync reply whose values cannot change before its reader pushes
        again), the device arrays themselves, until the data plane sends them
        (kvstore.server.dataplane): by reference to a worker that reads device memory
        (the cuda_ipc transport), downloaded (:meth:`download`) for any other."""
        return self.download(arrays, copy) if copy else list(arrays)

    def on_device(self, arrays: list) -> bool:
        """Whether a reply's arrays include device memory (left by :meth:`values`)."""
        return any(not self._on_host(a) for a in arrays)

    def publish(self) -> None:
        """Wait for the work queued on our stream: a peer may read what it wrote, and
        what it read (a worker's buffer) may change."""
        self.dev.synchronize()

    def download_own(self, arrays: list) -> list:
        """Host copies of ``arrays`` made for one reply alone (a gather, whose address
        the pool hands out again): fresh memory, never a cached mirror that the next
        such reply would overwrite while a worker reads this one."""
        return self.download(arrays, copy=True)

    def _packed(self, arrays: list, block: np.ndarray, views: list):
        """One flat device buffer laid out like ``block``, holding ``arrays``."""
        flat = self.dev.empty(block.size, np.uint8)
        start = block.ctypes.data
        for a, host in zip(arrays, views):
            if a.size:
                offset = host.ctypes.data - start
                self.xp.copyto(flat[offset:offset + a.nbytes].view(a.dtype), a.reshape(-1))
        return flat

    def _block(self, arrays: list, fresh: bool) -> tuple:
        """``(block, views)``: one uint8 host buffer holding a flat view per array (64-byte
        aligned); fresh pinned memory, or the list's cached mirror (shared memory where
        the node has it)."""
        specs = tuple((self.dev.address(a), a.size, np.dtype(a.dtype).str) for a in arrays)
        cached = None if fresh else self._mirrors.get(specs)
        if cached is not None:
            return cached
        # Shared memory is not page-locked: cudaHostRegister on it broke CUDA in a
        # process that also maps it as a worker (cudaErrorAlreadyMapped, seen on an
        # H100), so the copy goes through the driver's staging; pinned without it.
        pinned = fresh or self._host is None
        block, views = carved_views([(size, dtype) for _, size, dtype in specs],
                                    lambda total: self.dev.pinned_empty(total, np.uint8) if pinned
                                    else self._host.alloc(total, np.uint8))
        if not fresh:
            self._mirrors[specs] = (block, views)
        return block, views

    def to_numpy(self, a) -> np.ndarray:
        return a if self._on_host(a) else self.download([a], copy=True)[0]

    def describe(self) -> str:
        return self.dev.describe()


class GpuBackend(DeviceBackend):
    """:class:`DeviceBackend` on GPU ``device`` (cupy); ServerDeviceError without one."""

    def __init__(self, device: int, host=None):
        from ..devices import gpu
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
    from ..devices import gpu
    gpus = list(config.server_gpus) if config.server_gpus else list(range(gpu.device_count()))
    if not gpus:
        raise ServerDeviceError(f"KVSTORE_SERVER_DEVICE=gpu, but no GPU is usable: {gpu.reason()}")
    return GpuBackend(gpus[rank % len(gpus)], host)
