"""The fused CUDA optimizer kernels (kvstore/optimizer/fused.py), and the
multi-tensor kernels built from them (kvstore/optimizer/multi_tensor.py), compiled
for the host: the same loop bodies and preamble, in a C++ loop over numpy arrays, built
with the machine's C++ compiler and called through ctypes. CI has no GPU, so this
is how it checks the kernels' math against the generic NumPy path (the GPU tests
check the CUDA build of the same source on the device).

``-ffp-contract=off`` matches the kernels' ``--fmad=false`` (no fused
multiply-add), and x86-64 computes float in SSE registers (no excess
precision), so float32 and float64 results are those of the CUDA build up to
the device's square root and division, which CUDA rounds correctly as the host
does by default.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile

import numpy as np

from kvstore.optimizer import fused, multi_tensor

_CACHE = os.path.join(tempfile.gettempdir(), f"kvstore-host-kernels-{os.getuid()}")
_built: dict = {}


def compiler() -> str | None:
    """The C++ compiler, or None (the tests that need it skip, saying so)."""
    return shutil.which("g++") or shutil.which("c++")


def _source(name: str, dtype) -> str:
    params, states, body, preamble = fused.kernel_source(name)
    ctype = "double" if np.dtype(dtype) == np.float64 else "float"
    ttype = "_Float16" if np.dtype(dtype) == np.float16 else ctype    # GCC 12+ on x86-64
    args = ", ".join(["long n", "const T* grad_"] + [f"{ctype} {p}" for p in params]
                     + [f"T* {o}_" for o in ("weight",) + states])
    refs = "\n".join(f"        T& {o} = {o}_[i];" for o in ("weight",) + states)
    return f"""
#include <cmath>
using std::sqrt;
#define __device__
#define __forceinline__ inline
typedef {ttype} T;
{preamble % ctype}
extern "C" void kernel({args}) {{
    for (long i = 0; i < n; ++i) {{
        const T grad = grad_[i];
{refs}
        {body}
    }}
}}
"""


def kernel(name: str, dtype):
    """A callable ``(grad, *scalars, weight, *states)`` doing kernel ``name`` in place
    on contiguous numpy arrays of ``dtype`` (float16, float32 or float64; float16
    as the CUDA build: computed in float32, rounded once per stored value)."""
    key = (name, np.dtype(dtype).char)
    if key in _built:
        return _built[key]
    fn = ctypes.CDLL(_build(_source(name, dtype))).kernel
    params, states, _, _ = fused.kernel_source(name)
    scalar = ctypes.c_double if np.dtype(dtype) == np.float64 else ctypes.c_float
    fn.restype = None
    fn.argtypes = [ctypes.c_long, ctypes.c_void_p] + [scalar] * len(params) + \
        [ctypes.c_void_p] * (1 + len(states))

    def run(grad, *rest):
        scalars, arrays = rest[:len(params)], rest[len(params):]
        assert len(arrays) == 1 + len(states)
        for a in (grad, *arrays):
            assert a.dtype == np.dtype(dtype) and a.flags.c_contiguous and a.size == grad.size
        fn(grad.size, grad.ctypes.data, *scalars, *(a.ctypes.data for a in arrays))
    _built[key] = run
    return run


def fused_update(optimizer, weight, grad, state, t, lr=None) -> None:
    """``optimizer``'s update ``t`` done by its fused kernel on the host (what
    ``fused_step`` launches on a GPU): weight and state in place."""
    lr = optimizer.learning_rate_at(t) if lr is None else lr
    if grad.dtype != weight.dtype:
        grad = grad.astype(weight.dtype)
    grad = np.ascontiguousarray(grad)
    if optimizer.splits_norms:                  # LARS, LAMB: the two phases, key whole
        terms, carry = fused.norm_terms(optimizer, weight, grad, state, t, lr, None, np, kernel)
        fused.apply_norms(optimizer, weight, grad, state, t, lr, terms, carry, kernel)
        return
    name, args = fused.plan_call(optimizer, weight.dtype, state, t, lr)
    kernel(name, weight.dtype)(grad, *args, weight, *state)


def fused_update_in_chunks(optimizer, weight, grad, state, t, pieces: int) -> None:
    """A layer-wise update of a key cut into ``pieces`` chunks, as servers do it:
    phase 1 on every chunk, the terms added up over the chunks (in chunk order),
    phase 2 on every chunk; each phase by its fused kernel on the host."""
    lr = optimizer.learning_rate_at(t)
    bounds = np.linspace(0, weight.size, pieces + 1).astype(int)
    chunks = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    found = [fused.norm_terms(optimizer, weight[c], grad[c], tuple(s[c] for s in state), t, lr,
                              None, np, kernel) for c in chunks]
    sums = [sum(terms[i] for terms, _ in found) for i in range(len(found[0][0]))]
    for c, (_, carry) in zip(chunks, found):
        fused.apply_norms(optimizer, weight[c], grad[c], tuple(s[c] for s in state), t, lr, sums, carry,
                          kernel)


# -- the multi-tensor kernels (kvstore/optimizer/multi_tensor.py) ------------------------------
# the CUDA names the kernel uses, for a C++ build that runs every (block, thread) of the grid in turn
_MULTI_PRELUDE = """
#include <cmath>
using std::sqrt;
#define __device__
#define __forceinline__ inline
#define __global__
struct dim3 { unsigned int x, y, z; };
static dim3 blockIdx, blockDim, gridDim, threadIdx;
"""
_MULTI_DRIVER = """
extern "C" void run(const unsigned long long* tasks, const %(ctype)s* scalars, unsigned int blocks,
                    unsigned int rows, unsigned int threads) {
    gridDim = {blocks, rows, 1};
    blockDim = {threads, 1, 1};
    for (unsigned int y = 0; y < rows; ++y)
        for (unsigned int x = 0; x < blocks; ++x)
            for (unsigned int t = 0; t < threads; ++t) {
                blockIdx = {x, y, 0};
                threadIdx = {t, 0, 0};
                kvstore_multi_%(name)s(tasks, scalars);
            }
}
"""
_built_multi: dict = {}


def multi_kernel(name: str, dtype):
    """``run(tasks, scalars, sizes)``: multi-tensor kernel ``name`` for ``dtype`` (float32
    or float64) built for the host, over the tables of
    :meth:`kvstore.optimizer.multi_tensor.KernelGroup.tables`, with the launch grid a GPU gets."""
    key = (name, np.dtype(dtype).char)
    if key in _built_multi:
        return _built_multi[key]
    ctype = "double" if np.dtype(dtype) == np.float64 else "float"
    src = _MULTI_PRELUDE + multi_tensor.source(name, dtype) + _MULTI_DRIVER % {"ctype": ctype, "name": name}
    fn = ctypes.CDLL(_build(src)).run
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint]

    def run(tasks: np.ndarray, scalars: np.ndarray, sizes: list) -> None:
        assert tasks.dtype == np.uint64 and scalars.dtype == np.dtype(dtype)
        blocks, rows = multi_tensor.grid(sizes)
        fn(tasks.ctypes.data, scalars.ctypes.data, blocks, rows, multi_tensor.THREADS)
    _built_multi[key] = run
    return run


def run_group(group) -> None:
    """What a GPU does with a group of batched updates (``KernelGroup.launch``), on the host:
    its tables (host addresses) through the multi-tensor kernel built for the host.
    ``HostDevice(kernels=run_group)`` runs a GPU server's batches so."""
    entries = [e for e in group.entries if e.weight.size]
    if not entries:
        return
    part = multi_tensor.KernelGroup(group.name, group.dtype, entries)
    tasks, scalars = part.tables(lambda a: a.ctypes.data)
    multi_kernel(group.name, group.dtype)(tasks, scalars, [e.weight.size for e in entries])


def _build(src: str) -> str:
    """The shared library of C++ ``src`` (cached by its hash)."""
    os.makedirs(_CACHE, exist_ok=True)
    lib = os.path.join(_CACHE, hashlib.sha1(src.encode()).hexdigest()[:16] + ".so")
    if not os.path.exists(lib):
        cpp = f"{lib[:-3]}.{os.getpid()}.cpp"      # per process: parallel test runs build too
        with open(cpp, "w") as f:
            f.write(src)
        tmp = f"{lib}.{os.getpid()}"
        subprocess.run([compiler() or "g++", "-O2", "-ffp-contract=off", "-fno-fast-math", "-shared",
                        "-fPIC", "-o", tmp, cpp], check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, lib)
    return lib
