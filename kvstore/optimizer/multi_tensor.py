"""Multi-tensor optimizer updates: one kernel launch over every chunk that a server
event completes, instead of one fused kernel per chunk (kvstore/optimizer/fused.py).

A fused kernel costs one launch and ~40-60 us of Python whatever its chunk's size,
so a GPU server updating many small chunks is launch-bound: at 2 MB chunks an H100
server reached 0.06-0.20x of a device copy's bandwidth (docs/gpu.md §8). A
:class:`MultiTensorBatch` collects the updates planned while it is open (each
chunk's step count, rate, ``lr_mult``/``wd_mult`` and scalars are computed as the
per-chunk path computes them, by :func:`kvstore.optimizer.fused.plan_call`) and
runs them, when it closes, as one launch per (kernel, dtype) group: a table of
per-chunk pointers and sizes (``uint64``: size, gradient, weight, each state) and
a table of per-chunk scalars (``rescale, clip_g, wd, lr`` and the kernel's own, in
the scalar type the fused kernel takes: float for float32 weights, double for
float64) go to the device, and block row ``y`` of the grid runs chunk ``y`` with
the fused kernel's own loop body (:func:`source`). The bits are those of the
per-chunk kernels: same body, same preamble, same scalars, same ``--fmad=false``.

What a batch takes (:meth:`MultiTensorBatch.add`), and what stays per chunk:
float32 and float64 weights, C-contiguous, of an optimizer with an elementwise
fused kernel (:func:`kvstore.optimizer.fused.has_kernel`, not LARS or LAMB, whose
phases need reductions), a whole-chunk update (not a lazy one of some rows), the
device's own arrays. Everything else (float16 weights, lazy row updates,
LARS/LAMB, SGLD, LBSGD, the torch.optim twins, user subclasses, ``fused.ENABLED =
False`` or :data:`ENABLED` ``= False``) goes through
:meth:`~kvstore.optimizer.Optimizer.update`'s per-chunk path as before.
``multi_precision``'s float32 master copy is taken, and the batch run (:func:`settle`)
before the float16 weight is rounded from it.

The device runs a group (``device.run_updates(group)``, kvstore/devices): a GPU
with one launch (:meth:`KernelGroup.launch`); the host device that CI runs the GPU
server on with each update's own numpy code in turn (:meth:`KernelGroup.run_each`), or
with this kernel's source built for the host where a test gives it one
(tests/optimizer/host_kernels.py), so the batching (what is taken, when the batch
must run first, the tables) is exercised in CI. Example::

    batch = MultiTensorBatch(device)
    with batch.collect():              # e.g. one server event
        updater(("w", 0), grad0, value0)
        updater(("w", 1), grad1, value1)
    # closed: both chunks updated, by one launch on a GPU

CuPy is imported on first launch only; importing this module needs no GPU.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from . import fused

log = logging.getLogger(__name__)

__all__ = ["ENABLED", "KernelGroup", "MultiTensorBatch", "collecting", "settle", "source"]

ENABLED = True
"""When False, a batch takes nothing: every update runs per chunk, as before (to
compare the two paths, or to rule the multi-tensor kernels out when chasing a bug)."""

THREADS = 256
MAX_BLOCKS_PER_TASK = 512     # 512 x 256 threads: a 2 MB float32 chunk in 4 sweeps
MAX_TASKS = 65535             # the grid's y dimension: a longer group takes several launches
DTYPES = "fd"                 # float32 and float64 weights (float16 stays per chunk)

_OPEN: contextvars.ContextVar[MultiTensorBatch | None] = contextvars.ContextVar(
    "kvstore_multi_tensor_batch", default=None)


def collecting() -> MultiTensorBatch | None:
    """The batch open in this context (thread), if any: where
    :meth:`~kvstore.optimizer.Optimizer.update` hands the updates it can take."""
    return _OPEN.get()


def settle(a) -> None:
    """Run the open batch now if it holds an update of weight ``a`` (the caller is
    about to read it, or to reuse what that update reads); nothing when no batch is
    open."""
    batch = _OPEN.get()
    if batch is not None:
        batch.settle(a)


def source(name: str, dtype) -> str:
    """The CUDA source of the multi-tensor kernel ``kvstore_multi_<name>`` for weights
    of ``dtype`` (float32 or float64): fused kernel ``name``'s loop body and preamble
    in a loop over the elements of chunk ``blockIdx.y``, whose pointers and size are
    row ``y`` of ``tasks`` and whose scalars row ``y`` of ``scalars``."""
    params, states, body, preamble = fused.kernel_source(name)
    ctype = {"f": "float", "d": "double"}[np.dtype(dtype).char]
    width = 3 + len(states)
    loads = "\n".join(f"    const {ctype} {p} = kv_sc[{j}];" for j, p in enumerate(params))
    pointers = "\n".join(f"    T* const kv_p_{o} = (T*)kv_task[{2 + j}];" for j, o in enumerate(("weight",) + states))
    refs = "\n".join(f"        T& {o} = kv_p_{o}[kv_i];" for o in ("weight",) + states)
    return f"""typedef {ctype} T;
{preamble % ctype}
extern "C" __global__ void kvstore_multi_{name}(const unsigned long long* kv_tasks, const {ctype}* kv_scalars) {{
    const unsigned long long* kv_task = kv_tasks + {width} * (unsigned long long)blockIdx.y;
    const {ctype}* kv_sc = kv_scalars + {len(params)} * (unsigned long long)blockIdx.y;
    const long long kv_size = (long long)kv_task[0];
    const T* const kv_p_grad = (const T*)kv_task[1];
{pointers}
{loads}
    const long long kv_step = (long long)gridDim.x * blockDim.x;
    for (long long kv_i = (long long)blockIdx.x * blockDim.x + threadIdx.x; kv_i < kv_size; kv_i += kv_step) {{
        const T grad = kv_p_grad[kv_i];
{refs}
        {body}
    }}
}}
"""


def grid(sizes: list[int]) -> tuple[int, int]:
    """The launch grid for chunks of ``sizes`` elements (at most MAX_TASKS of them):
    enough blocks per row for the largest, at most MAX_BLOCKS_PER_TASK."""
    largest = max(sizes) if sizes else 0
    return int(min(MAX_BLOCKS_PER_TASK, max(1, -(-largest // THREADS)))), len(sizes)


class PlannedUpdate:
    """One planned update: fused kernel ``name``'s ``scalars`` for ``weight`` and
    ``state`` (in place) from ``grad`` (the weight's dtype); ``generic`` does the
    same update with the optimizer's own code (what the host device runs)."""

    __slots__ = ("name", "grad", "scalars", "weight", "state", "generic")

    def __init__(self, name: str, grad, scalars: list, weight, state: tuple, generic: Callable[[], None]):
        self.name, self.grad, self.scalars, self.weight, self.state = name, grad, scalars, weight, state
        self.generic = generic


class KernelGroup:
    """The updates of one batch that share a kernel and a dtype: one launch."""

    def __init__(self, name: str, dtype, entries: list[PlannedUpdate]):
        self.name, self.dtype, self.entries = name, np.dtype(dtype), entries

    def tables(self, address: Callable[[Any], int]) -> tuple[np.ndarray, np.ndarray]:
        """``(tasks, scalars)`` as the kernel reads them, host arrays: per entry a row
        ``[size, grad, weight, state...]`` of uint64 (``address(array)``: where its
        memory starts) and a row of its scalars in the kernel's scalar type."""
        tasks = np.array([[e.weight.size, address(e.grad), address(e.weight), *map(address, e.state)]
                          for e in self.entries], np.uint64).reshape(-1)
        scalars = np.array([e.scalars for e in self.entries], self.dtype).reshape(-1)
        return tasks, scalars

    def run_each(self) -> None:
        """Each update by the optimizer's own code, in order (the host device's loop)."""
        for e in self.entries:
            e.generic()

    def launch(self) -> None:
        """The updates on the current CUDA device and stream, one launch per
        MAX_TASKS of them; the tables are freed to CuPy's pool at once (it hands them
        out again only to work on this stream, which runs after the kernel)."""
        import cupy  # noqa: PLC0415 - lazy: importing kvstore must not import cupy
        kernel = _cuda_kernel(self.name, self.dtype)
        entries = [e for e in self.entries if e.weight.size]
        for lo in range(0, len(entries), MAX_TASKS):
            part = KernelGroup(self.name, self.dtype, entries[lo:lo + MAX_TASKS])
            tasks, scalars = part.tables(lambda a: a.data.ptr)
            kernel(grid([e.weight.size for e in part.entries]), (THREADS,),
                   (cupy.asarray(tasks), cupy.asarray(scalars)))


_kernels: dict = {}     # (name, dtype char) -> cupy.RawKernel


def _cuda_kernel(name: str, dtype):
    key = (name, dtype.char)
    kernel = _kernels.get(key)
    if kernel is None:
        import cupy  # noqa: PLC0415
        kernel = cupy.RawKernel(source(name, dtype), f"kvstore_multi_{name}", options=("--fmad=false",))
        _kernels[key] = kernel        # a race only builds the same kernel twice
    return kernel


class MultiTensorBatch:
    """The updates planned on ``device``'s arrays while :meth:`collect` is open, run
    together when it closes (or earlier, where :meth:`settle` or a second update of
    the same array needs them done). ``device``: ``is_device_array(a)`` and
    ``run_updates(group)`` (kvstore.devices.Device). Not
    thread-safe: one owner (a server's backend), one event at a time."""

    def __init__(self, device):
        self.device = device
        self._entries: list[PlannedUpdate] = []
        self._touched: set[int] = set()      # id() of the weights of the pending updates (held by them)
        self.launches = 0                    # groups run (one kernel each on a GPU; tests count them)
        self.updates = 0                     # updates run by this batch
        self.failed: str | None = None       # why a launch failed (the batch then takes nothing)

    @contextlib.contextmanager
    def collect(self) -> Iterator[MultiTensorBatch]:
        """Open the batch for this context (one server event); at the end, run what
        it holds, also when the block raised (the updates were planned: their steps
        are counted). Nested opens of the same batch are one."""
        if _OPEN.get() is self:
            yield self
            return
        token = _OPEN.set(self)
        try:
            yield self
        finally:
            _OPEN.reset(token)
            self.flush()

    def add(self, optimizer, weight, grad, state: tuple, t: int, lr: float,
            generic: Callable[[], None]) -> bool:
        """Take ``optimizer``'s update ``t`` (rate ``lr``, ``lr_mult`` applied; the
        arguments checked by :meth:`~kvstore.optimizer.Optimizer.update`) of a whole
        chunk, or return False, touching nothing, where it stays per chunk (see the
        module's docstring). Raises what the per-chunk path raises before anything
        changes (``plan_call``)."""
        if not self._takes(optimizer, weight, grad, state):
            return False
        if grad.dtype != weight.dtype:
            grad = grad.astype(weight.dtype)
        name, scalars = fused.plan_call(optimizer, weight.dtype, state, t, lr)
        if id(weight) in self._touched:   # the same chunk twice: the first update goes first
            self.flush()
        self._entries.append(PlannedUpdate(name, grad, scalars, weight, tuple(state), generic))
        self._touched.add(id(weight))
        return True

    def _takes(self, optimizer, weight, grad, state) -> bool:
        if not (ENABLED and fused.ENABLED) or self.failed is not None or optimizer.fused_norms \
                or not fused.has_kernel(type(optimizer)):
            return False
        if weight.dtype.char not in DTYPES:
            return False
        dev = self.device
        return all(dev.is_device_array(a) and a.flags.c_contiguous for a in (weight, grad, *state))

    def settle(self, a) -> None:
        """Run what the batch holds now if it updates weight ``a`` (the array object a
        chunk's value is, not a view of it: its state, and its round's sum that the
        update reads, go with it)."""
        if self._entries and id(a) in self._touched:
            self.flush()

    def flush(self) -> None:
        """Run every update the batch holds: one group per (kernel, dtype), in the
        order their first update came."""
        if not self._entries:
            return
        groups: dict[tuple, list[PlannedUpdate]] = {}
        for e in self._entries:
            groups.setdefault((e.name, e.weight.dtype.char), []).append(e)
        self._entries, self._touched = [], set()
        for (name, char), entries in groups.items():
            group = KernelGroup(name, np.dtype(char), entries)
            try:
                self.device.run_updates(group)
            except Exception as e:
                self._broken(group, e)
                continue
            self.launches += 1
            self.updates += len(entries)

    def _broken(self, group: KernelGroup, error: Exception) -> None:
        """A group failed to launch (its kernel did not build, say): its chunks' counts
        have moved and their replies are being made, so they are updated by their
        optimizer's own code now, and the batch takes nothing more (later updates go
        per chunk, where a failure fails its round): logged as an error, naming it."""
        self.failed = f"{type(error).__name__}: {error}"
        log.error("the multi-tensor update of %d chunk(s) (kernel %s, %s) failed; they are updated by "
                  "their optimizer's own code, and this batch hands every later update to the "
                  "per-chunk path: %s", len(group.entries), group.name, group.dtype.name, self.failed,
                  exc_info=error)
        group.run_each()
