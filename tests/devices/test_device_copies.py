"""Batched device copies (kvstore/devices/cuda_copies.py, ``copy_many`` and
``write_many`` of the device layer): a call's chunk copies on a device in one
kernel instead of one launch each.

CI runs the kernel's source compiled for the host over numpy buffers of every
alignment, and the host devices' twins; ``pytest -m gpu`` runs the kernel and
CudaAccelerators' batched writes into torch CUDA tensors and cupy arrays."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

from kvstore.devices import HostAccelerators, arrays, cuda_copies, gpu

try:
    import torch
except ImportError:            # pragma: no cover - torch is a dependency
    torch = None

# the CUDA names the kernel uses, for a C++ build that runs every (block, thread) in turn
HOST_PRELUDE = r"""
#define __global__
struct uint4 { unsigned int x, y, z, w; };
struct dim3 { unsigned int x, y, z; };
static dim3 blockIdx, blockDim, gridDim, threadIdx;
"""
HOST_DRIVER = r"""
extern "C" void run(const unsigned long long* table, unsigned int blocks, unsigned int tasks,
                    unsigned int threads) {
    gridDim = {blocks, tasks, 1};
    blockDim = {threads, 1, 1};
    for (unsigned int y = 0; y < tasks; ++y)
        for (unsigned int x = 0; x < blocks; ++x)
            for (unsigned int t = 0; t < threads; ++t) {
                blockIdx = {x, y, 0};
                threadIdx = {t, 0, 0};
                copy_many(table);
            }
}
"""


@pytest.fixture(scope="module")
def host_copy_many():
    """The kernel's source built for the host: ``run(tasks)`` with the launch grid
    BatchedCopy uses."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("needs a C++ compiler (g++) to build the copy kernel for the host")
    src = HOST_PRELUDE + cuda_copies.SOURCE + HOST_DRIVER
    cache = os.path.join(tempfile.gettempdir(), f"kvstore-host-kernels-{os.getuid()}")
    os.makedirs(cache, exist_ok=True)
    lib = os.path.join(cache, "copy-" + hashlib.sha1(src.encode()).hexdigest()[:16] + ".so")
    if not os.path.exists(lib):
        cpp, tmp = f"{lib[:-3]}.{os.getpid()}.cpp", f"{lib}.{os.getpid()}"
        with open(cpp, "w") as f:
            f.write(src)
        subprocess.run([cxx, "-O2", "-shared", "-fPIC", "-o", tmp, cpp], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(tmp, lib)
    fn = ctypes.CDLL(lib).run
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint]

    def run(tasks):
        table = np.array(tasks, np.uint64).reshape(-1)
        blocks, rows = cuda_copies.grid(tasks)
        fn(table.ctypes.data, blocks, rows, cuda_copies.THREADS)
    return run


# (destination offset, source offset, bytes): 16-byte words, 4-byte words, bytes
CASES = [(0, 0, 16), (0, 0, 1 << 20), (16, 32, 4096 + 16), (4, 8, 4), (4, 4, 65536 + 4),
         (0, 0, 17), (1, 3, 1), (3, 0, 999), (0, 0, 3 * 16 * cuda_copies.THREADS + 16)]


def test_the_copy_kernel_built_for_the_host_copies_each_task_exactly(host_copy_many):
    rng = np.random.default_rng(0)
    pad = 64
    srcs = [rng.integers(0, 256, size + 2 * pad, dtype=np.uint8) for _, _, size in CASES]
    dsts = [np.full(size + 2 * pad, 0xAB, np.uint8) for _, _, size in CASES]
    tasks = [(dst.ctypes.data + pad + d, src.ctypes.data + pad + s, size)
             for (d, s, size), src, dst in zip(CASES, srcs, dsts)]
    host_copy_many(tasks)
    for (d, s, size), src, dst in zip(CASES, srcs, dsts):
        np.testing.assert_array_equal(dst[pad + d:pad + d + size], src[pad + s:pad + s + size])
        assert (dst[:pad + d] == 0xAB).all() and (dst[pad + d + size:] == 0xAB).all(), \
            f"the copy of {size} bytes at offset {d} wrote outside its destination"


def test_the_launch_grid_covers_the_largest_task_and_stays_bounded():
    assert cuda_copies.grid([(0, 0, 1)]) == (1, 1)
    assert cuda_copies.grid([(0, 0, 16 * cuda_copies.THREADS + 1), (0, 0, 4)]) == (2, 2)
    assert cuda_copies.grid([(0, 0, 1 << 40)])[0] == cuda_copies.MAX_BLOCKS_PER_TASK


def test_host_devices_copy_many_checks_every_pair_as_copy_does():
    acc = HostAccelerators(2)
    a = [acc.to_device(np.arange(n, dtype=np.float32), 0) for n in (1, 5, 300)]
    b = [acc.empty(0, n, np.float32) for n in (1, 5, 300)]
    acc.copy_many(b, a)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert acc.batches == 1
    with pytest.raises(ValueError, match="needs a peer copy"):
        acc.copy_many([acc.empty(1, 5, np.float32)], [a[1]])
    with pytest.raises(ValueError, match="5 values into an array of 300"):
        acc.copy_many([b[2]], [a[1]])
    with pytest.raises(ValueError, match="2 sources for 3 destinations"):
        acc.copy_many(b, a[:2])


def test_host_devices_write_many_writes_each_output_of_any_place():
    acc = HostAccelerators(2)
    src = [acc.to_device(np.full(n, float(n), np.float32), 0) for n in (4, 6, 8)]
    outs = [acc.empty(0, 4, np.float32).reshape(2, 2), acc.empty(1, 6, np.float32), np.zeros(8, np.float32)]
    downloads = acc.downloads
    acc.write_many(outs, src)
    for out, n in zip(outs, (4, 6, 8)):
        assert (np.asarray(out) == n).all()
    assert acc.downloads == downloads + 1 and acc.batches == 1     # the host output is a download


def test_family_of_a_value_is_found_once_per_type():
    arrays._FAMILIES.clear()
    assert arrays.is_torch(torch.zeros(2)) and not arrays.is_torch(np.zeros(2))
    assert arrays._FAMILIES[type(np.zeros(2))] == "numpy" and arrays._FAMILIES[torch.Tensor] == "torch"
    assert arrays._family(torch.nn.Parameter(torch.zeros(2))) == "torch"
    assert arrays._family([1.0]) is None and arrays._family(HostAccelerators().empty(0, 2, np.float32)) == "numpy"


def test_host_values_have_no_device_address():
    assert arrays.device_address(np.zeros(3)) is None
    assert arrays.device_address(torch.zeros(3)) is None


# -- on a GPU ------------------------------------------------------------------------------
@pytest.fixture
def cp():
    if not gpu.available():
        pytest.skip(f"needs a usable GPU with CuPy: {gpu.reason()}")
    import cupy
    return cupy


@pytest.mark.gpu
def test_batched_copy_on_the_gpu_copies_each_task_exactly(cp):
    pad = 64
    rng = np.random.default_rng(1)
    srcs = [cp.asarray(rng.integers(0, 256, size + 2 * pad, dtype=np.uint8)) for _, _, size in CASES]
    dsts = [cp.full(size + 2 * pad, 0xAB, cp.uint8) for _, _, size in CASES]
    cuda_copies.BatchedCopy()([(int(dst.data.ptr) + pad + d, int(src.data.ptr) + pad + s, size)
                               for (d, s, size), src, dst in zip(CASES, srcs, dsts)])
    for (d, s, size), src, dst in zip(CASES, srcs, dsts):
        host, want = cp.asnumpy(dst), cp.asnumpy(src)
        np.testing.assert_array_equal(host[pad + d:pad + d + size], want[pad + s:pad + s + size])
        assert (host[:pad + d] == 0xAB).all() and (host[pad + d + size:] == 0xAB).all()


@pytest.mark.gpu
def test_batched_copy_splits_more_tasks_than_one_grid_holds(cp):
    n = cuda_copies.MAX_TASKS + 10
    src = cp.arange(n, dtype=cp.float32)
    dst = cp.zeros(n, cp.float32)
    cuda_copies.BatchedCopy()([(int(dst.data.ptr) + 4 * i, int(src.data.ptr) + 4 * i, 4) for i in range(n)])
    cp.testing.assert_array_equal(dst, src)


@pytest.mark.gpu
def test_cuda_copy_many_and_write_many_into_cupy_arrays_and_torch_tensors(cp):
    if torch is None or not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    from kvstore.devices.cuda import CudaAccelerators
    acc = CudaAccelerators()
    sizes = [1, 7, 4096, 1 << 20]
    srcs = [cp.arange(n, dtype=cp.float32) + 0.5 for n in sizes]
    flat = cp.zeros(sum(sizes), cp.float32)
    bounds = np.cumsum([0] + sizes)
    views = [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    acc.copy_many(views, srcs)
    strided = cp.zeros(2 * sizes[1], cp.float32)[::2]             # not contiguous: copied the plain way
    acc.copy_many([strided], [srcs[1]])
    for v, s in zip(views + [strided], srcs + [srcs[1]]):
        cp.testing.assert_array_equal(v, s)
    # outputs: torch float32 (batched, after a long torch kernel that writes them on
    # torch's own stream), a strided tensor and a bfloat16 one (the plain way), cupy
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        outs = [torch.zeros(n, device="cuda") for n in sizes]
        big = torch.randn(4096, 4096, device="cuda")
        for out in outs:
            out.add_((big @ big).sum() * 0)                     # queued work on the outputs
        odd = torch.zeros(2 * sizes[2], device="cuda")[::2]
        half = torch.zeros(sizes[2], device="cuda", dtype=torch.bfloat16)
        mine = cp.zeros(sizes[3], cp.float32)
        acc.write_many(outs + [odd, half, mine], views + [views[2], views[2], views[3]])
        got = [o.float().cpu().numpy() for o in outs + [odd, half]]
    torch.cuda.synchronize()
    for g, s in zip(got, sizes + [sizes[2], sizes[2]]):
        np.testing.assert_allclose(g, np.arange(s, dtype=np.float32) + 0.5, rtol=1e-2 if g.size == 4096 else 0)
    cp.testing.assert_array_equal(mine, srcs[3])


@pytest.mark.gpu
def test_cuda_write_many_into_one_output_twice_keeps_the_last_value(cp):
    from kvstore.devices.cuda import CudaAccelerators
    acc = CudaAccelerators()
    out = cp.zeros(1000, cp.float32)
    first, last = cp.full(1000, 1.0, cp.float32), cp.full(1000, 2.0, cp.float32)
    acc.write_many([out, out], [first, last])      # in order, as one write after the other
    cp.testing.assert_array_equal(out, last)
