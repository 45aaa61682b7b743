"""The GPU stores: ``device`` and ``dist_device_sync`` (MXNet's names).

A list of values pushed for one key (one per GPU: torch CUDA tensors or cupy
arrays) is summed on a GPU, on the device of the first GPU value, without a
trip through the host: torch tensors are viewed as cupy arrays through DLPack,
values on other GPUs arrive by peer copy. Then:

- ``device`` keeps each key on one GPU: the device of its initial value when that
  is a GPU value, else the store's default device (CuPy's current device when the
  store was created); it applies the optimizer there, and a pull copies the value
  to every listed output, device to device.
- ``dist_device_sync`` copies the GPU sum once to pinned host memory and sends it
  to the servers as ``dist_sync`` does; a pull lands in pinned memory and is
  copied to every listed device.

Without a usable GPU (see :mod:`kvstore.gpu`) both behave exactly like ``local``
and ``dist_sync`` on the CPU, and the first store of each type logs one INFO
line: ``no GPU found: the 'device' store aggregates on the CPU (<reason>)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import arrays, gpu
from . import optimizer as _optimizer
from .store import KeyInfo
from .dist import DistStore
from .errors import KVStoreError
from .protocol import ops
from .local_store import LocalStore


def gpu_sum(vals: list, dtype, what: str, torch_devices: set | None = None):
    """The sum of ``vals`` as a flat cupy array on the device of the first GPU value
    (a view of that value when it is the only one), or None when no value is on a GPU.

    Host values in the list are uploaded. The devices of torch inputs are added to
    ``torch_devices``: the caller joins torch's and cupy's streams there once the
    result has been used (:func:`kvstore.gpu.join_streams`)."""
    device = next((arrays.device_of(v) for v in vals if arrays.is_gpu(v)), None)
    if device is None:
        return None
    cupy = gpu.cupy_module()
    with cupy.cuda.Device(device):
        terms = [_flat_on(v, device, dtype, what, torch_devices) for v in vals]
        if len(terms) == 1:
            return terms[0]
        total = cupy.add(terms[0], terms[1])      # a new array: callers' values stay intact
        for term in terms[2:]:
            total += term
        return total


def _flat_on(value, device: int, dtype, what: str, torch_devices: set | None):
    """``value`` as a flat cupy array on ``device``: a view when it already is one there."""
    import cupy
    if not arrays.is_gpu(value):
        host = np.ascontiguousarray(arrays.to_numpy(value, what), dtype=dtype).reshape(-1)
        return gpu.to_device(host, device)
    if torch_devices is not None and arrays.is_torch(value):
        torch_devices.add(arrays.device_of(value))
    view = arrays.as_cupy(value, what)
    if int(view.device.id) == device:
        return view.reshape(-1)                  # a copy only if the value is not contiguous
    with view.device:
        contiguous = cupy.ascontiguousarray(view)
    local = cupy.empty(contiguous.shape, contiguous.dtype)
    gpu.copy_between_devices(local, contiguous)
    return local.reshape(-1)


class DeviceStore(LocalStore):
    """In-process store that aggregates on a GPU (``kvstore.create("device")``).

    Same semantics as ``local``. A key lives on the GPU of its initial value when
    that is a torch CUDA tensor or a cupy array, else on the store's default device,
    CuPy's current device when the store was created (:attr:`device_id`); its
    optimizer update and state stay there. So a process per GPU may create the
    store before ``torch.cuda.set_device(local_rank)``: keys initialised with that
    GPU's tensors live on it. A custom updater (``_set_updater``) receives cupy
    arrays. With gradient compression on, values are compressed and summed on the
    host (the compressor is numpy), then uploaded. Without a usable GPU: exactly
    ``local``.

    Example (two GPUs)::

        kv = kvstore.create("device")
        kv.init(0, torch.zeros(3))
        kv.push(0, [torch.ones(3, device="cuda:0"), torch.ones(3, device="cuda:1")])
        outs = [torch.empty(3, device="cuda:0"), torch.empty(3, device="cuda:1")]
        kv.pull(0, out=outs)                         # both hold [2, 2, 2]
    """

    def __init__(self, name: str = "device"):
        super().__init__(name)
        self._gpu = gpu.available()
        self._home: int | None = None
        self._torch_devices: set[int] = set()   # devices whose torch stream to join after a push
        self._init_devices: dict = {}           # key -> GPU of its initial value, during init()
        if self._gpu:
            import cupy
            self._home = int(cupy.cuda.Device().id)
        else:
            gpu.log_cpu_fallback(name)

    @property
    def device_id(self) -> int | None:
        """The default GPU: it holds the keys whose initial value was not on a GPU.
        None when the store works on the CPU."""
        return self._home

    def init(self, key, value) -> None:
        # base.init hands _do_init host copies: note first where GPU values live
        self._init_devices = self._gpu_devices(key, value) if self._gpu else {}
        try:
            super().init(key, value)
        finally:
            self._init_devices = {}

    def _gpu_devices(self, keys, values) -> dict:
        """{key: device} for the keys whose (first) value is on a GPU."""
        try:
            pairs = self._args.pairs(keys, values, "init")
        except KVStoreError:
            return {}            # base.init raises the same error
        return {k: arrays.device_of(vals[0]) for k, vals in pairs if arrays.is_gpu(vals[0])}

    def _merged(self, info: KeyInfo, vals: list, what: str):
        if not self._gpu or self._compressor is not None:
            return super()._merged(info, vals, what)
        total = gpu_sum(vals, info.dtype, what, self._torch_devices)
        return total if total is not None else super()._merged(info, vals, what)

    def _do_init(self, items) -> None:
        if not self._gpu:
            return super()._do_init(items)
        for key, shape, dtype, value in items:
            device = self._init_devices.get(key, self._home)
            assert device is not None                 # a GPU store has a home device
            self._keys[key] = KeyInfo(key, shape, dtype)
            self._store[key] = gpu.to_device(np.ascontiguousarray(value, dtype=dtype), device)

    def _apply(self, info: KeyInfo, merged) -> None:
        if not self._gpu:
            return super()._apply(info, merged)
        import cupy
        stored: Any = self._store[info.key]         # a CuPy array
        # on the key's device: the optimizer allocates its state on the current one
        with stored.device:
            if isinstance(merged, np.ndarray):
                merged = gpu.to_device(merged, int(stored.device.id))
            elif merged.device.id != stored.device.id:
                moved = cupy.empty(merged.shape, merged.dtype)
                gpu.copy_between_devices(moved, merged)
                merged = moved
            if self._updater is None:
                cupy.copyto(stored, merged.reshape(info.shape))
            else:
                self._updater(info.key, merged.reshape(info.shape), stored)

    def _do_push(self, items, wait_sent: bool = True) -> None:
        try:
            super()._do_push(items, wait_sent)
        finally:
            # merged sums may be views of the callers' tensors: torch must not
            # overwrite them before cupy's kernels that read them have run
            devices, self._torch_devices = self._torch_devices, set()
            for d in devices:
                gpu.join_streams(d)

    def _do_pull(self, items) -> None:
        if not self._gpu:
            return super()._do_pull(items)
        for info, targets in items:
            stored = self._store[info.key]
            for t in targets:
                arrays.write(t, stored)     # device to device (peer copies), or to the host

    def _get_states(self) -> dict:
        if not self._gpu:
            return super()._get_states()
        if not isinstance(self._updater, _optimizer.Updater):
            return {}
        what = "save_optimizer_states"
        # the key's shape, as the local store saves it (a row-sparse key's state is flat in the updater)
        return {key: {"t": entry["t"], "state": [np.array(arrays.to_numpy(s, what)).reshape(self._keys[key].shape)
                                                 for s in entry["state"]]}
                for key, entry in self._updater.get_states().items()}

    def _set_states(self, states: dict) -> None:
        if not self._gpu:
            return super()._set_states(states)
        by_device: dict[int | None, dict] = {}   # load_optimizer_states validated every entry
        for key, entry in states.items():
            stored: Any = self._store[self._args.check_key(key, "load_optimizer_states")]
            # row-sparse tables stay in host memory (numpy: no GPU to upload to)
            device = int(stored.device.id) if arrays.is_gpu(stored) else None
            by_device.setdefault(device, {})[key] = entry
        for device, group in by_device.items():
            if device is None:
                super()._set_states(group)
                continue
            with gpu.cupy_module().cuda.Device(device):   # restored states go to their key's GPU
                super()._set_states(group)


class DistDeviceStore(DistStore):
    """``dist_sync`` with GPU-side aggregation (``kvstore.create("dist_device_sync")``).

    Each worker sums its per-device list on the GPU, copies the sum once to pinned
    host memory and pushes it; a pull is received into pinned memory and copied
    to every listed device. Without a usable GPU: exactly ``dist_sync``.
    """

    def __init__(self, name: str, config):
        super().__init__(name, config)
        self._gpu = gpu.available()
        if not self._gpu:
            gpu.log_cpu_fallback(name)

    def _merged(self, info: KeyInfo, vals: list, what: str):
        if self._gpu:
            total = gpu_sum(vals, info.dtype, what)
            if total is not None:
                return total         # a flat cupy sum; _on_host brings a call's sums over at once
        return super()._merged(info, vals, what)

    @staticmethod
    def _on_host(items: list, merged_at: int, alloc=None) -> list:
        """``items`` with the cupy sums at tuple index ``merged_at`` replaced by host
        copies: one buffer for the whole call (pinned, or from ``alloc(bytes)``),
        every device-to-host copy queued, one synchronisation per device (not one
        allocation and one wait per key). Once it returns, cupy has read every
        caller's tensor."""
        sums = [item[merged_at] for item in items if not isinstance(item[merged_at], np.ndarray)]
        if not sums:
            return items
        block, views = _carved_views([(a.size, a.dtype) for a in sums], alloc)
        if len({int(a.device.id) for a in sums}) == 1:
            _download_packed(sums, block, views)
        else:
            _download_each(sums, views)
        hosts = {id(a): host for a, host in zip(sums, views)}
        return [item if isinstance(item[merged_at], np.ndarray) else
                (*item[:merged_at], hosts[id(item[merged_at])], *item[merged_at + 1:]) for item in items]

    def _do_push(self, items, wait_sent: bool = True) -> None:
        return super()._do_push(self._on_host(items, 1), wait_sent)

    def _do_pushpull(self, items) -> None:
        # The sums go to shared memory that co-located servers read in place (no
        # staging copy into slots); it may be reused once this call returns, which a
        # pushpull does only after every server answered. push returns earlier: pinned.
        return super()._do_pushpull(self._on_host(items, 1, self._shared_bytes))

    def _do_pushpull_start(self, items):
        """The sums go out now; the replies are filled into the (GPU) outputs by
        :meth:`_do_pushpull_finish`, so the Trainer overlaps the exchange with backward."""
        if not self._gpu:
            return super()._do_pushpull_start(items)
        items = self._on_host(items, 1, self._shared_bytes)
        what, sources, targets = self._pushpull_args(items)
        staged, upload = self._staged(targets)
        self._check_can_push()
        # ``items`` keeps the sums' shared memory alive until the servers answered
        return self._send(ops.PUSHPULL, what, sources, staged), upload, items

    def _do_pushpull_finish(self, handle) -> None:
        if not self._gpu:
            return super()._do_pushpull_finish(handle)
        sent, upload, _ = handle
        super()._do_pushpull_finish(sent)
        upload()

    def _shared_bytes(self, nbytes: int) -> np.ndarray:
        return self._client.shared_empty(nbytes, np.uint8)

    def _send_and_fill(self, op: str, what: str, sources, targets) -> None:
        if not self._gpu:
            return super()._send_and_fill(op, what, sources, targets)
        staged, upload = self._staged(targets)
        super()._send_and_fill(op, what, sources, staged)
        upload()

    @staticmethod
    def _staged(targets: list) -> tuple:
        """``(staged targets, upload)``: replies for GPU outputs land in one pinned
        buffer; ``upload()`` then sends it to the GPU in one copy and spreads it to
        the outputs from there, device to device."""
        gpu_keys = [(info, outs) for info, outs in targets if any(arrays.is_gpu(o) for o in outs)]
        block, views = _carved_views([(info.size, info.dtype) for info, _ in gpu_keys])
        hosts = dict(zip((info.key for info, _ in gpu_keys), views))
        staged = [(info, [hosts[info.key]]) if info.key in hosts else (info, outs) for info, outs in targets]

        def upload() -> None:
            if not gpu_keys:
                return
            device = next(arrays.device_of(o) for _, outs in gpu_keys for o in outs if arrays.is_gpu(o))
            assert device is not None                 # of a GPU output
            for (info, outs), on_gpu in zip(gpu_keys, _upload_views(block, views, device)):
                for out in outs:
                    arrays.write(out, on_gpu)
        return staged, upload


def _download_packed(sums: list, block: np.ndarray, views: list) -> None:
    """Copy cupy ``sums`` (all on one GPU) into ``views`` of ``block``: packed into
    one device buffer laid out like ``block`` (device-to-device, fast), then one
    device-to-host copy of it; returns when it is done. One large copy runs at the
    link's speed where 161 small ones into pageable memory did not."""
    import cupy
    with sums[0].device:
        stream = cupy.cuda.get_current_stream()
        flat = cupy.empty(block.size, np.uint8)
        start = block.ctypes.data
        for a, host in zip(sums, views):
            offset = host.ctypes.data - start
            cupy.copyto(flat[offset:offset + a.nbytes].view(a.dtype), a)
        if block.size:
            flat.get(stream=stream, out=block, blocking=False)
        stream.synchronize()


def _download_each(sums: list, views: list) -> None:
    """Copy cupy ``sums`` on several GPUs into ``views``: every copy queued on its
    device's current stream, then one synchronisation per stream."""
    import cupy
    streams = {}
    for a, host in zip(sums, views):
        with a.device:
            stream = cupy.cuda.get_current_stream()
            if a.size:
                a.get(stream=stream, out=host, blocking=False)
            streams[(int(a.device.id), stream.ptr)] = stream
    for stream in streams.values():
        stream.synchronize()


def _carved_views(specs: list, alloc=None) -> tuple:
    """``(block, views)``: flat numpy arrays of the given (size, dtype), carved out of
    one uint8 buffer ``block`` (pinned, or ``alloc(bytes)``; each view 64-byte
    aligned); the buffer lives as long as any of them."""
    offsets, total = [], 0
    for size, dtype in specs:
        offsets.append(total)
        total += -(-int(size) * np.dtype(dtype).itemsize // 64) * 64
    block = gpu.pinned_empty(total, np.uint8) if alloc is None else alloc(total)
    return block, [block[off:off + int(size) * np.dtype(dtype).itemsize].view(dtype)
                   for off, (size, dtype) in zip(offsets, specs)]


def _upload_views(block: np.ndarray, views: list, device: int) -> list:
    """Cupy copies on ``device`` of ``views`` (of ``block``, from :func:`_carved_views`):
    one host-to-device copy of the whole block."""
    import cupy
    with cupy.cuda.Device(device):
        flat = cupy.empty(block.size, np.uint8)
        gpu.copy_from_host(flat, block)       # returns once the pinned block may be reused
        start = block.ctypes.data
        return [flat[h.ctypes.data - start:h.ctypes.data - start + h.nbytes].view(h.dtype)
                for h in views]
