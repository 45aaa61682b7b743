"""The GPU stores' work above the device layer, one code path on any
:class:`~kvstore.devices.base.Accelerators` (CUDA in production, the host
emulation in CI):

- :func:`device_sum`: a key's list of values summed on the device of the first
  device value (host values uploaded, values on other devices peer-copied);
- :class:`Staging`: how a call's device values cross to the host and back for the
  dist stores' :class:`~kvstore.worker.exchange.Exchange`: the sums of a call packed on
  the device and downloaded in one copy into one host block, and the replies for
  device outputs received into one host block that goes to the device in one
  copy and is spread to the outputs from there (:class:`Staged`).

Example (on the emulation)::

    acc = HostAccelerators()
    total = device_sum(acc, [acc.to_device(np.ones(4, np.float32), 0)] * 2, np.float32, "push")
    items, keep = Staging(acc).to_host([(info, total)], alloc=None)   # host copies
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .arrays import bits_view, flat_view
from .base import Accelerators


def device_sum(acc: Accelerators, vals: list, dtype, what: str, host_flat: Callable | None = None):
    """The sum of ``vals`` as a flat device array on the device of the first device
    value (a view of that value when it is the only one), or None when no value is
    on a device. ``host_flat(value)``: a host value as a flat numpy array of
    ``dtype`` (it is uploaded)."""
    if len(vals) == 1 and acc.holds(vals[0]):
        # one device value (a key's gradient, every call): its flat view, made without
        # switching devices when it needs no copy (a contiguous view is no kernel)
        view = acc.view(vals[0], what)
        if view.ndim == 1 or view.flags.c_contiguous:
            return flat_view(view)
    index = next((acc.index_of(v) for v in vals if acc.holds(v)), None)
    if index is None:
        return None
    with acc.on(index):
        terms = [_flat_on(acc, v, index, dtype, what, host_flat) for v in vals]
        if len(terms) == 1:
            return terms[0]
        # several terms are summed in ``dtype`` (multi-precision: float16 values of a float32
        # key are widened first, exactly, on their device, rather than summed in float16)
        terms = [t if t.dtype == dtype else t.astype(dtype) for t in terms]
        total = acc.add(terms[0], terms[1])      # a new array: callers' values stay intact
        for term in terms[2:]:
            acc.add_into(total, term)
        return total


def _flat_on(acc: Accelerators, value, index: int, dtype, what: str, host_flat: Callable | None):
    """``value`` as a flat array on device ``index``: a view when it already is one there."""
    if not acc.holds(value):
        host = host_flat(value) if host_flat is not None else np.asarray(value, dtype)
        return acc.to_device(np.ascontiguousarray(host, dtype=dtype).reshape(-1), index)
    view = acc.view(value, what)
    if acc.index_of(view) == index:
        return flat_view(view)                   # a copy only if the value is not contiguous
    contiguous = acc.contiguous(view)
    local = acc.empty(index, contiguous.size, contiguous.dtype)
    acc.peer_copy(local, contiguous.reshape(-1))
    return local


def copy_into(acc: Accelerators, out, value) -> None:
    """``out[...] = value`` where either may be on a device or on the host: device to
    device (a peer copy across devices), host to device by an upload, device to host
    by a download (the caller's output of any family, kvstore.devices.arrays)."""
    if acc.holds(value):
        acc.write(out, value.reshape(out.shape))
    elif acc.holds(out):
        with acc.on(acc.index_of(out)):
            acc.upload(out, np.ascontiguousarray(value).reshape(-1))
    else:
        from . import arrays
        arrays.write(out, value.reshape(-1))


def carved_views(specs: list, alloc: Callable[[int], np.ndarray]) -> tuple[np.ndarray, list]:
    """``(block, views)``: flat host arrays of the given (size, dtype), carved out of
    one uint8 buffer ``alloc(bytes)`` (each view 64-byte aligned); the buffer
    lives as long as any of them."""
    offsets, total = [], 0
    for size, dtype in specs:
        offsets.append(total)
        total += -(-int(size) * np.dtype(dtype).itemsize // 64) * 64
    block = alloc(total)
    return block, [block[off:off + int(size) * np.dtype(dtype).itemsize].view(dtype)
                   for off, (size, dtype) in zip(offsets, specs)]


class Staging:
    """Moves a dist call's device values to the host and its replies back."""

    def __init__(self, acc: Accelerators):
        self._acc = acc

    def _pinned(self, nbytes: int) -> np.ndarray:
        return self._acc.pinned_empty(nbytes, np.uint8)

    def to_host(self, items: list, alloc: Callable[[int], np.ndarray] | None) -> tuple[list, list]:
        """``(items, keep)``: ``items`` [(info, flat)] with every device array replaced
        by a host copy: one buffer for the whole call (pinned, or from
        ``alloc(bytes)``), the copies queued and waited for once (a sum packed on
        its device first when they all share one). ``keep``: the host copies, which
        must stay alive while the servers may read them. Once it returns, the
        devices have read every caller's value."""
        acc = self._acc
        sums = [flat for _, flat in items if acc.holds(flat)]
        if not sums:
            return items, []
        block, views = carved_views([(a.size, a.dtype) for a in sums], alloc or self._pinned)
        devices = {acc.index_of(a) for a in sums}
        if len(devices) == 1:
            self._download_packed(sums, block, views, devices.pop())
        else:
            acc.wait([acc.download(a, host) for a, host in zip(sums, views)])
        hosts = {id(a): host for a, host in zip(sums, views)}
        staged = [(info, hosts[id(flat)]) if acc.holds(flat) else (info, flat) for info, flat in items]
        return staged, views

    def _download_packed(self, sums: list, block: np.ndarray, views: list, index: int) -> None:
        """Pack ``sums`` (all on device ``index``) into one device buffer laid out like
        ``block`` (device to device, fast), then one copy of it to the host: one
        large copy runs at the link's speed where 161 small ones did not."""
        acc = self._acc
        with acc.on(index):
            flat = acc.empty(index, block.size, np.uint8)
            start = block.ctypes.data
            for a, host in zip(sums, views):
                offset = host.ctypes.data - start
                acc.copy(flat[offset:offset + a.nbytes].view(a.dtype), a.reshape(-1))
            if block.size:
                acc.wait([acc.download(flat, block)])

    def outputs(self, targets: list, on_device: bool = False,
                dtypes: dict | None = None) -> tuple[list, Staged | None]:
        """``(targets, staged)``: ``targets`` [(info, outs)] where a key with a device
        output is answered into one block instead: pinned host memory, or (``on_device``:
        the links deliver device to device, the cuda_ipc transport) device memory on
        that output's device. ``staged.deliver()``, once the replies are in, copies a
        host block to the device in one copy and spreads it to the outputs from
        there. None when no output is on a device, or (``on_device``) when every
        key's replies go into its output itself (:meth:`_direct`). ``dtypes``: {key: the dtype its
        reply comes in} where it is not the key's (multi-precision: float16, or
        ``uint16`` for bfloat16 patterns, which go into bfloat16 outputs as patterns)."""
        acc = self._acc
        devices = [(info, outs) for info, outs in targets if any(acc.holds(o) for o in outs)]
        if not devices:
            return targets, None
        dtypes = dtypes or {}
        index = next(acc.index_of(o) for _, outs in devices for o in outs if acc.holds(o))
        if on_device:
            direct = self._direct(devices, dtypes, index)
            if direct:
                devices = [(info, outs) for info, outs in devices if info.key not in direct]
                targets = [(info, [direct[info.key]]) if info.key in direct else (info, outs)
                           for info, outs in targets]
                if not devices:
                    return targets, None
        alloc = (lambda nbytes: acc.empty(index, nbytes, np.uint8)) if on_device else self._pinned
        block, views = carved_views([(info.size, dtypes.get(info.key, info.dtype)) for info, _ in devices], alloc)
        # a bfloat16 output takes its reply's patterns through its 2-byte integer view
        bits = {i for i, (info, _) in enumerate(devices) if dtypes.get(info.key) == np.uint16}
        devices = [(info, [bits_view(o) for o in outs]) if i in bits else (info, outs)
                   for i, (info, outs) in enumerate(devices)]
        blocks = dict(zip((info.key for info, _ in devices), views))
        staged = [(info, [blocks[info.key]]) if info.key in blocks else (info, outs) for info, outs in targets]
        return staged, Staged(acc, devices, block, views, index, bits)

    def _direct(self, devices: list, dtypes: dict, index: int) -> dict:
        """{key: a flat view of its output} for the keys whose replies the links can
        deliver into the output itself (device to device, no block and no copy after):
        one output, the device layer's own array (a cupy array, not a torch tensor,
        whose stream the copies after the block join), on device ``index``,
        C-contiguous, of the key's dtype and size and not rounded on the wire, and no
        output of the call given twice (whose last write would then depend on which
        server answered first)."""
        acc = self._acc
        given = [id(o) for _, outs in devices for o in outs]
        twice = set() if len(set(given)) == len(given) else {i for i in given if given.count(i) > 1}
        found = {}
        for info, outs in devices:
            if len(outs) != 1 or info.key in dtypes:
                continue
            o = outs[0]
            if (acc.native(o) and o.size == info.size and o.dtype == info.dtype and id(o) not in twice
                    and acc.index_of(o) == index and o.flags.c_contiguous):
                found[info.key] = flat_view(o)
        return found

    def holds(self, value) -> bool:
        """Whether ``value`` is device memory (e.g. a block of :meth:`outputs`)."""
        return self._acc.holds(value)


class Staged:
    """Replies for device outputs waiting in a host block (:meth:`Staging.outputs`)."""

    def __init__(self, acc: Accelerators, targets: list, block: np.ndarray, views: list, index: int,
                 bits: set | None = None):
        self._acc, self._targets, self._block, self._views, self._index = acc, targets, block, views, index
        self._bits = bits or set()        # targets whose values are bfloat16 patterns (int16 views)

    def deliver(self) -> None:
        """A host block to device ``index`` in one copy, then into every output (a
        device block: from there at once)."""
        acc, block = self._acc, self._block
        with acc.on(self._index):
            if acc.holds(block):
                values = self._views
            else:
                flat = acc.empty(self._index, block.size, np.uint8)
                acc.upload(flat, block)         # returns once the pinned block may be reused
                start = block.ctypes.data
                values = [flat[host.ctypes.data - start:host.ctypes.data - start + host.nbytes].view(host.dtype)
                          for host in self._views]
            values = [v.view(np.int16) if i in self._bits else v for i, v in enumerate(values)]
            pairs = [(out, value) for (_, outs), value in zip(self._targets, values) for out in outs]
            acc.write_many([out for out, _ in pairs], [value for _, value in pairs])
