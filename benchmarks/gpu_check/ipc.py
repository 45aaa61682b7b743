"""Can two processes on one GPU share device memory through CUDA IPC here, and how
fast is it? The groundwork for issue 29's IPC data plane (a GPU server summing
straight from co-located workers' device buffers), measured before it is built:
``python -m benchmarks.gpu_check --only ipc``.

The parent process allocates ResNet-50's gradient bytes (102 MB) from CuPy's pool,
fills them, records an interprocess event and hands the memory and event handles
to a child process, which opens them, waits on the event on its own stream
(ordering by IPC events, no host synchronisation), checks the values, and times
copying them into its own memory device to device; against the same bytes through
the host (device to pinned, pinned to device), as the data plane moves them today.
CuPy's pool hands out pieces of larger allocations, and an IPC handle names the
whole allocation, so the parent sends the piece's offset from the allocation's
base (``cuMemGetAddressRange``). GPU only: nothing here runs in CI."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time, cupy, numpy as np
msg = json.loads(sys.stdin.readline())
rt = cupy.cuda.runtime
t0 = time.perf_counter()
base = rt.ipcOpenMemHandle(bytes.fromhex(msg["mem"]))
event = rt.ipcOpenEventHandle(bytes.fromhex(msg["event"]))
open_ms = (time.perf_counter() - t0) * 1e3
n = msg["n"]
mem = cupy.cuda.UnownedMemory(base + msg["offset"], n * 4, None)
theirs = cupy.ndarray((n,), cupy.float32, cupy.cuda.MemoryPointer(mem, 0))
stream = cupy.cuda.Stream(non_blocking=True)
with stream:
    rt.streamWaitEvent(stream.ptr, event, 0)
    ok = bool((theirs[:1000] == msg["value"]).all()) and bool((theirs[-1000:] == msg["value"]).all())
    ours = cupy.empty(n, cupy.float32)
    pinned = cupy.cuda.alloc_pinned_memory(n * 4)
    host = np.frombuffer(pinned, np.float32, n)
    def timed(fn, reps=10):
        fn(); stream.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        stream.synchronize()
        return (time.perf_counter() - t) / reps * 1e3
    d2d = timed(lambda: cupy.copyto(ours, theirs))
    summed = timed(lambda: cupy.add(theirs, ours, out=ours))
    via_host = timed(lambda: (theirs.get(stream=stream, out=host, blocking=False), ours.set(host, stream=stream)))
    theirs[:4] = -1.0                     # the parent checks this write
    stream.synchronize()
rt.ipcCloseMemHandle(base)
# the cost of each further open, once the context exists: one per allocation a peer
# references (the cuda_ipc transport opens each of a peer's allocations once)
t0 = time.perf_counter()
opened = [rt.ipcOpenMemHandle(bytes.fromhex(h)) for h in msg["more"]]
more_ms = (time.perf_counter() - t0) * 1e3 / max(len(opened), 1)
for b in opened:
    rt.ipcCloseMemHandle(b)
print(json.dumps({"ok": ok, "open_ms": open_ms, "d2d_ms": d2d, "sum_ms": summed, "via_host_ms": via_host,
                  "more_open_ms": more_ms, "more": len(opened)}))
"""


def _base_of(ptr: int) -> int:
    """The start of the CUDA allocation holding device address ``ptr`` (driver API)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    err = cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if err:
        raise RuntimeError(f"cuMemGetAddressRange failed: CUresult {err}")
    return base.value


def ipc(n: int = 25_557_032, env=None, timeout: float = 120) -> dict:
    import cupy
    rt = cupy.cuda.runtime
    cupy.empty(1024, cupy.float32)                   # the pool's first block: ours is not at a base
    theirs = cupy.full(n, 3.0, cupy.float32)
    ptr = int(theirs.data.ptr)
    base = _base_of(ptr)
    flags = getattr(rt, "eventDisableTiming", 2) | getattr(rt, "eventInterprocess", 4)   # CUDA's values
    event = rt.eventCreateWithFlags(flags)
    rt.eventRecord(event, cupy.cuda.get_current_stream().ptr)
    # 64 more allocations of 1 MB, each its own cudaMalloc (the pool has no free block to split)
    more = [cupy.empty(1 << 18, cupy.float32) for _ in range(64)]
    t1 = time.perf_counter()
    more_handles = [bytes(rt.ipcGetMemHandle(_base_of(int(a.data.ptr)))).hex() for a in more]
    export_ms = (time.perf_counter() - t1) * 1e3 / len(more)
    msg = {"mem": bytes(rt.ipcGetMemHandle(base)).hex(), "event": bytes(rt.ipcGetEventHandle(event)).hex(),
           "offset": ptr - base, "n": n, "value": 3.0, "more": sorted(set(more_handles))}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(msg) + "\n", capture_output=True,
                       text=True, timeout=timeout, env=env)
    if p.returncode:
        return {"error": f"child exited {p.returncode}", "tail": (p.stdout + p.stderr)[-3000:]}
    result = json.loads(p.stdout.strip().splitlines()[-1])
    cupy.cuda.Device().synchronize()
    result["child_wrote_back"] = bool((theirs[:4] == -1.0).all()) and bool((theirs[4:1000] == 3.0).all())
    result["offset_from_base"] = ptr - base
    result["mb"] = round(n * 4 / 1e6, 1)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    rt.eventDestroy(event)
    result["export_ms"] = export_ms
    for k in ("open_ms", "d2d_ms", "sum_ms", "via_host_ms", "more_open_ms", "export_ms"):
        result[k] = round(result[k], 3)
    del more
    return result


def report(r: dict) -> list[str]:
    if "error" in r:
        return [f"failed: {r['error']}", "", "```", r.get("tail", ""), "```", ""]
    return [f"{r['mb']} MB of a parent's CuPy pool memory (offset {r['offset_from_base']} bytes into its "
            f"allocation) opened by a child process: values seen after an IPC event wait: {r['ok']}; the "
            f"child's write seen by the parent: {r['child_wrote_back']}; opening the handles took "
            f"{r['open_ms']} ms.", "",
            "| child's operation on the parent's memory | ms |", "|---|---:|",
            f"| device-to-device copy into its own memory | {r['d2d_ms']} |",
            f"| sum into its own memory (reads both) | {r['sum_ms']} |",
            f"| the same bytes through the host (to pinned, back to the device) | {r['via_host_ms']} |", "",
            f"Each further allocation: exporting its handle {r.get('export_ms', '-')} ms (parent), opening "
            f"it {r.get('more_open_ms', '-')} ms (child, over {r.get('more', '-')} allocations of 1 MB): what "
            "the cuda_ipc transport pays once per allocation a peer references.", ""]
