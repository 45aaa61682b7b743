"""Many small device-to-device copies in one kernel launch (CUDA, through CuPy).

An exchange copies every chunk of a call on the device: a gradient into its
exportable slot, a server's value into the reply block, the block into each
output. One ``cupy.copyto`` per copy costs a kernel launch and ~20-30 us of
Python each; ResNet-50's 161 tensors in 190 chunks made ~540 of them per
pushpull (cProfile of the H100 run of 2026-11-28,
benchmarks/results/gpu/profile-f88885f/). :class:`BatchedCopy` does a list of
copies with one launch: a table of (destination, source, bytes) goes to the
device, and block row ``y`` of the grid copies task ``y`` in 16-, 4- or 1-byte
words, whichever its alignment allows.

CI has no GPU: :class:`BatchedCopy` runs only on GPU hosts (``pytest -m gpu``);
CI compiles :data:`SOURCE` for the host and runs it over numpy buffers of every
alignment (tests/devices/test_device_copies.py). The callers' logic runs in CI on the
host twin, :meth:`kvstore.devices.host.HostAccelerators.copy_many` (one copy per
pair). Keep it thin.
"""

from __future__ import annotations

import numpy as np

SOURCE = r"""
extern "C" __global__ void copy_many(const unsigned long long* table) {
    const unsigned long long* task = table + 3 * blockIdx.y;
    char* dst = (char*)task[0];
    const char* src = (const char*)task[1];
    const unsigned long long nbytes = task[2];
    const unsigned long long start = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long bits = task[0] | task[1] | nbytes;
    if ((bits & 15) == 0) {
        uint4* d = (uint4*)dst;
        const uint4* s = (const uint4*)src;
        for (unsigned long long i = start; i < (nbytes >> 4); i += step) d[i] = s[i];
    } else if ((bits & 3) == 0) {
        unsigned int* d = (unsigned int*)dst;
        const unsigned int* s = (const unsigned int*)src;
        for (unsigned long long i = start; i < (nbytes >> 2); i += step) d[i] = s[i];
    } else {
        for (unsigned long long i = start; i < nbytes; i += step) dst[i] = src[i];
    }
}
"""

THREADS = 256
MAX_BLOCKS_PER_TASK = 256     # 256 x 256 threads x 16 bytes: 1 MB per sweep of a task
MAX_TASKS = 65535             # the grid's y dimension


def grid(tasks: list) -> tuple[int, int]:
    """The launch grid for ``tasks`` (at most MAX_TASKS, none empty): enough blocks per
    task row for the largest task's 16-byte words, at most MAX_BLOCKS_PER_TASK."""
    largest = max(n for _, _, n in tasks)
    return int(min(MAX_BLOCKS_PER_TASK, max(1, -(-largest // (16 * THREADS))))), len(tasks)


class BatchedCopy:
    """``copy(tasks)``: [(destination address, source address, bytes)] on the current
    device, queued on its current stream in one launch per 65,535 tasks. The
    addresses must not overlap; the caller orders the stream after the work that
    wrote the sources and before the work that reads the destinations."""

    def __init__(self):
        import cupy
        self._cupy = cupy
        self._kernel = cupy.RawKernel(SOURCE, "copy_many")

    def __call__(self, tasks: list) -> None:
        tasks = [t for t in tasks if t[2]]
        for lo in range(0, len(tasks), MAX_TASKS):
            part = tasks[lo:lo + MAX_TASKS]
            # a device table, freed to the pool at once: the pool hands it out again only
            # to work on this stream, which runs after the kernel
            table = self._cupy.asarray(np.array(part, np.uint64).reshape(-1))
            self._kernel(grid(part), (THREADS,), (table,))
