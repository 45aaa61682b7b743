"""One process of a measured job (benchmarks/emulated_ipc/run.py starts it for the
workers and the servers): it emulates this process's GPU with exportable memory, as
tests/transport/test_cuda_ipc.py's job script does, then runs its role.

Workers pushpull the layout's keys ``BENCH_ITERS`` times after ``BENCH_WARMUP``
untimed calls, check every output against the exact sum (a wrong one exits
non-zero), and worker 0 writes ``{"median_ms", "samples_ms", "cpu_ms", "cpu_samples_ms",
"keys", "transports"}`` (``cpu_ms``: the median of its process's CPU time per call, which a
loaded machine inflates less than the wall time)
to ``BENCH_OUT``; with ``BENCH_PROFILE`` set to a directory, worker 0 also writes its
cProfile summary (worker-0.txt) and profile (worker-0.prof) there and has the
servers dump theirs (server-<rank>.prof).
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import kvstore  # noqa: E402
import kvstore.devices as devices  # noqa: E402
from benchmarks.harness.key_layouts import layout  # noqa: E402
from kvstore.devices import HostAccelerators, HostDevice  # noqa: E402
from kvstore.devices.host_sharing import HostSharing  # noqa: E402
from kvstore.server import backend  # noqa: E402


def emulate_gpus() -> HostAccelerators:
    """One emulated GPU for this worker, one per server, memory peers can open."""
    acc = HostAccelerators(1, sharing=HostSharing(f"w{os.getpid()}"))
    devices.worker_accelerators = lambda: acc
    backend.for_config = lambda config, rank, alloc=None, shared=None, host=None: backend.DeviceBackend(
        HostDevice(HostSharing(f"s{rank}")), host)
    return acc


def main() -> int:
    acc = emulate_gpus()
    kv = kvstore.create("dist_device_sync")     # a server runs its role here and exits
    assert isinstance(kv, kvstore.KVStore)
    with kv:
        rank, world = kv.rank, kv.num_workers
        sizes = layout(os.environ["BENCH_LAYOUT"], int(os.environ["BENCH_SCALE"]))
        keys = list(range(len(sizes)))
        kv.init(keys, [acc.to_device(np.zeros(n, np.float32), 0) for n in sizes])
        grads = [acc.empty(0, n, np.float32) for n in sizes]
        outs = [acc.empty(0, n, np.float32) for n in sizes]
        iters, warmup = int(os.environ["BENCH_ITERS"]), int(os.environ["BENCH_WARMUP"])
        profile_dir = os.environ.get("BENCH_PROFILE") if rank == 0 else None
        profiler = cProfile.Profile() if profile_dir else None
        samples, cpu = [], []     # wall and this process's CPU time per call (ms)
        for i in range(warmup + iters):
            value = float((rank + 1) * (i + 1) % 251)
            for g in grads:
                g.fill(value)
            if profiler is not None and i == warmup:
                kv._send_command_to_servers("profile_start")
                profiler.enable()
            t0, c0 = time.perf_counter(), time.process_time()
            kv.pushpull(keys, grads, out=outs)
            if i >= warmup:
                samples.append((time.perf_counter() - t0) * 1e3)
                cpu.append((time.process_time() - c0) * 1e3)
            want = float(sum((r + 1) * (i + 1) % 251 for r in range(world)))
            if not all(bool((o == want).all()) for o in outs):
                raise SystemExit(f"worker {rank}: wrong sum in iteration {i} (want {want})")
        if profiler is not None and profile_dir:
            profiler.disable()
            kv._send_command_to_servers("profile_stop")
            kv._send_command_to_servers("profile_dump")     # into KVSTORE_PROFILE_DIR (run.py sets it)
            profiler.dump_stats(os.path.join(profile_dir, "worker-0.prof"))     # python -m pstats FILE
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
            pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
            with open(os.path.join(profile_dir, "worker-0.txt"), "w") as f:
                f.write(text.getvalue())
        transports = sorted(kv.comm_stats()["by_transport"])     # the kinds of link used
    if rank == 0:
        with open(os.environ["BENCH_OUT"], "w") as f:
            json.dump({"median_ms": statistics.median(samples), "samples_ms": samples,
                       "cpu_ms": statistics.median(cpu), "cpu_samples_ms": cpu,
                       "keys": len(sizes), "values": sum(sizes), "transports": transports}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
