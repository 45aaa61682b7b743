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

Without a usable GPU (see :mod:`kvstore.devices.gpu`) both behave exactly like ``local``
and ``dist_sync`` on the CPU, and the first store of each type logs one INFO
line: ``no GPU found: the 'device' store aggregates on the CPU (<reason>)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..devices import arrays, gpu
from .. import devices
from .. import optimizer as _optimizer
from .store import KeyInfo
from ..devices.staging import device_sum
from .dist import DistStore
from ..errors import InvalidArgumentError, KVStoreError
from .local import LocalStore


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
        acc = self._acc = devices.worker_accelerators()
        self._home = acc.current() if acc is not None else None
        self._read: list = []               # values a push's kernels read (settled after it)
        self._init_devices: dict = {}       # key -> device of its initial value, during init()
        if acc is None:
            gpu.log_cpu_fallback(name)

    @property
    def device_id(self) -> int | None:
        """The default GPU: it holds the keys whose initial value was not on a GPU.
        None when the store works on the CPU."""
        return self._home

    def init(self, key, value) -> None:
        # base.init hands _do_init host copies: note first where GPU values live
        self._init_devices = self._devices_of(key, value)
        try:
            super().init(key, value)
        finally:
            self._init_devices = {}

    def _devices_of(self, keys, values) -> dict:
        """{key: device} for the keys whose (first) value is on a device."""
        acc = self._acc
        if acc is None:
            return {}
        try:
            pairs = self._args.pairs(keys, values, "init")
        except KVStoreError:
            return {}            # base.init raises the same error
        return {k: acc.index_of(vals[0]) for k, vals in pairs if acc.holds(vals[0])}

    def _on_device(self, key) -> bool:
        """Whether ``key``'s value lives on a device (row-sparse tables stay on the host)."""
        return self._acc is not None and key in self._store and self._acc.holds(self._store[key])

    def _merged(self, info: KeyInfo, vals: list, what: str):
        acc = self._acc
        if acc is None or self._compressor is not None or not self._on_device(info.key):
            return super()._merged(info, vals, what)
        total = device_sum(acc, vals, info.dtype, what, lambda v: arrays.to_numpy(v, what))
        if total is None:
            return super()._merged(info, vals, what)
        self._read.extend(vals)
        return total

    def _do_init(self, items) -> None:
        acc = self._acc
        if acc is None:
            return super()._do_init(items)
        for key, shape, dtype, value in items:
            device = self._init_devices.get(key, self._home)
            assert device is not None                 # a GPU store has a home device
            self._keys[key] = KeyInfo(key, shape, dtype)
            self._store[key] = acc.to_device(np.ascontiguousarray(value, dtype=dtype), device)

    def _apply(self, info: KeyInfo, merged, rows=None) -> None:
        acc = self._acc
        if acc is None or not self._on_device(info.key):
            return super()._apply(info, merged, rows)
        stored: Any = self._store[info.key]
        index = acc.index_of(stored)
        # on the key's device: the optimizer allocates its state on the current one
        with acc.on(index):
            if not acc.holds(merged):
                merged = acc.to_device(np.ascontiguousarray(merged).reshape(-1), index)
            elif acc.index_of(merged) != index:
                moved = acc.empty(index, merged.size, merged.dtype)
                acc.peer_copy(moved, acc.contiguous(merged).reshape(-1))
                merged = moved
            if self._updater is None:
                acc.copy(stored, merged.reshape(info.shape))
            elif rows is not None and isinstance(self._updater, _optimizer.Updater):
                # the row ids go to the key's device with the gather (Updater._on_rows)
                self._updater.update_lazy(info.key, merged.reshape(info.shape), stored, rows)
            else:
                self._updater(info.key, merged.reshape(info.shape), stored)

    def _do_push(self, items, wait_sent: bool = True, rows: dict | None = None) -> None:
        try:
            super()._do_push(items, wait_sent, rows=rows)
        finally:
            # merged sums may be views of the callers' values: the callers must not
            # overwrite them before the kernels that read them have run
            read, self._read = self._read, []
            if read and self._acc is not None:
                self._acc.settle(read)

    def _do_pull_start(self, items, paced: bool = False) -> None:
        acc = self._acc
        outs: list = []
        values: list = []
        for info, targets in items:
            stored = self._store[info.key]
            if acc is None or not acc.holds(stored):
                super()._do_pull_start([(info, targets)])
                continue
            outs += targets
            values += [stored] * len(targets)
        if outs:
            assert acc is not None
            acc.write_many(outs, values)  # device to device (one kernel per GPU), peer copies, or to the host

    def _get_states(self) -> dict:
        acc = self._acc
        if acc is None:
            return super()._get_states()
        if not isinstance(self._updater, _optimizer.Updater):
            return {}

        def on_host(a) -> np.ndarray:
            if not acc.holds(a):
                return np.array(a)
            host = acc.pinned_empty(a.size, a.dtype)
            acc.wait([acc.download(acc.contiguous(a).reshape(-1), host)])
            return np.array(host)
        # the key's shape, as the local store saves it (a row-sparse key's state is flat in the updater)
        return {key: {"t": entry["t"], "state": [on_host(s).reshape(self._keys[key].shape)
                                                 for s in entry["state"]]}
                for key, entry in self._updater.get_states().items()}

    def _set_states(self, states: dict) -> None:
        acc = self._acc
        if acc is None:
            return super()._set_states(states)
        by_device: dict[int | None, dict] = {}   # load_optimizer_states validated every entry
        for key, entry in states.items():
            stored: Any = self._store[self._args.check_key(key, "load_optimizer_states")]
            # row-sparse tables stay in host memory
            device = acc.index_of(stored) if acc.holds(stored) else None
            by_device.setdefault(device, {})[key] = entry
        for device, group in by_device.items():
            if device is None:
                super()._set_states(group)
                continue
            with acc.on(device):           # restored states go to their key's device
                super()._set_states(group)


class DistDeviceStore(DistStore):
    """``dist_sync`` with GPU-side aggregation (``kvstore.create("dist_device_sync")``).

    Each worker sums its per-device list on the GPU (kvstore.devices.staging's
    ``device_sum``); a call's sums are packed on the GPU and copied to host memory
    in one transfer and pushed; the replies for GPU outputs land in one pinned
    buffer that goes to the GPU in one transfer and is spread to every listed
    output (the exchange's staging). One code path on any accelerators: CUDA, or
    the host emulation in CI. Without a usable GPU: exactly ``dist_sync``.
    """

    def __init__(self, name: str, config):
        accelerators = devices.worker_accelerators()
        if accelerators is None:
            gpu.log_cpu_fallback(name)
        super().__init__(name, config, accelerators=accelerators)
        self._accelerators = accelerators

    @property
    def device_memory(self) -> bool:
        """Whether :meth:`empty` can make device memory (this store works on GPUs)."""
        return self._accelerators is not None

    def empty(self, shape, dtype=np.float32, device: int | None = None):
        """:meth:`DistStore.empty` (``device=None``: host memory) or, with a GPU ordinal
        (this store's accelerators' device index), an uninitialised device array (a
        cupy array on a GPU) that co-located GPU servers read in place over cuda_ipc
        instead of a copy into a slot (kvstore/devices/arena.py), where this worker
        has such links; elsewhere an ordinary device array. As with host memory, leave
        it unchanged until the pushpull that sends it has filled its outputs."""
        if device is None:
            return super().empty(shape, dtype)
        self._check_open("empty")
        acc = self._accelerators
        if acc is None:
            raise InvalidArgumentError(f"empty(device={device}): this dist_device_sync store has no usable GPU")
        if type(device) is not int or not 0 <= device < acc.count:
            raise InvalidArgumentError(f"empty(device={device!r}): expected a device ordinal of this worker, "
                                       f"0 to {acc.count - 1}")
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        size = int(np.prod(shape, dtype=np.int64))
        with acc.on(device):
            flat = self._client.shared_device_empty(device, size, dtype)
            if flat is None:
                flat = acc.empty(device, size, dtype)
        return flat.reshape(shape)

    def _merged(self, info: KeyInfo, vals: list, what: str):
        acc = self._accelerators
        if (acc is not None and len(vals) == 1 and self._args.low_precision and acc.holds(vals[0])
                and arrays.dtype_name(vals[0]) == arrays.BFLOAT16):
            # one bfloat16 device value (multi-precision): its 2-byte patterns on its device, on
            # the wire as they are (kvstore.precision), not the float32 copy the layer reads
            return arrays.flat_view(acc.view(arrays.bits_view(vals[0]), what)).view(np.uint16)
        total = None if acc is None else device_sum(acc, vals, info.dtype, what,
                                                    lambda v: arrays.to_numpy(v, what))
        # a flat device sum: the exchange brings a call's sums to the host at once
        return total if total is not None else super()._merged(info, vals, what)
