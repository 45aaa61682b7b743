"""One measured job of benchmarks/per_key (run.py starts it as a script, with the
checkout measured first on PYTHONPATH): a scheduler, ``BENCH_SERVERS`` servers and
``BENCH_WORKERS`` workers of ``dist_sync`` as threads of this process, over real
ZeroMQ sockets and shared memory. Each worker pushpulls the keys of ``BENCH_SIZES``
(a JSON list of float32 sizes) ``BENCH_ITERS`` times after ``BENCH_WARMUP`` untimed
calls and checks every output against the exact sum (a wrong one exits non-zero).
Worker 0 measures, per call, its own thread's CPU time and the servers' threads'
(their CPU clocks: what each end spent in Python and the copies, not waiting); it
prints one JSON line: ``{"worker_ms": [...], "server_ms": [...], "wall_ms": [...],
"keys", "transports"}``.

It imports only what every checkout since the in-process cluster has (the store,
``ServerNode``, the scheduler), so an older checkout measures the same way.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import numpy as np

import kvstore
from kvstore.config import Config
from kvstore.server import ServerNode
from tracker.control.rendezvous import Scheduler
from tracker.control.security import Security


def main() -> int:
    workers, servers = int(os.environ["BENCH_WORKERS"]), int(os.environ["BENCH_SERVERS"])
    sizes = json.loads(os.environ["BENCH_SIZES"])
    iters, warmup = int(os.environ["BENCH_ITERS"]), int(os.environ["BENCH_WARMUP"])
    timeout, interval, silence = 60.0, 0.5, 30.0
    scheduler = Scheduler(workers, servers, timeout=timeout, heartbeat_interval=interval,
                          heartbeat_timeout=silence, security=Security(None, False)).start()

    def config(role: str, rank: int) -> Config:
        return Config(role=role, rank=rank, scheduler_host="127.0.0.1", scheduler_port=scheduler.port,
                      num_workers=workers, num_servers=servers, exit_on_abort=False, timeout=timeout,
                      heartbeat_interval=interval, heartbeat_timeout=silence)

    idents: dict = {}

    def serve(rank: int, node) -> None:
        idents[rank] = threading.get_ident()
        node.run()
    threads = [threading.Thread(target=serve, args=(r, ServerNode(config("server", r))), daemon=True)
               for r in range(servers)]
    for t in threads:
        t.start()
    result: dict = {}
    errors: list = []

    def work(rank: int) -> None:
        try:
            kv = kvstore.create("dist_sync", config=config("worker", rank))
            assert isinstance(kv, kvstore.KVStore)
            with kv:
                keys = list(range(len(sizes)))
                kv.init(keys, [np.zeros(n, np.float32) for n in sizes])
                grads = [np.empty(n, np.float32) for n in sizes]
                outs = [np.empty(n, np.float32) for n in sizes]
                clocks = [time.pthread_getcpuclockid(idents[r]) for r in range(servers)]
                samples: dict = {"worker_ms": [], "server_ms": [], "wall_ms": []}
                for i in range(warmup + iters):
                    for g in grads:
                        g.fill(float((rank + 1) * (i + 1) % 251))
                    s0, w0, t0 = sum(map(time.clock_gettime, clocks)), time.thread_time(), time.perf_counter()
                    kv.pushpull(keys, grads, out=outs)
                    t1, w1, s1 = time.perf_counter(), time.thread_time(), sum(map(time.clock_gettime, clocks))
                    want = float(sum((r + 1) * (i + 1) % 251 for r in range(workers)))
                    if not all(bool((o == want).all()) for o in outs):
                        raise RuntimeError(f"worker {rank}: wrong sum in iteration {i} (want {want})")
                    if i >= warmup:
                        for name, value in (("worker_ms", w1 - w0), ("server_ms", s1 - s0), ("wall_ms", t1 - t0)):
                            samples[name].append(value * 1e3)
                if rank == 0:
                    result.update(samples, keys=len(sizes), transports=sorted(kv.comm_stats()["by_transport"]))
        except BaseException as e:      # reported below: the job fails
            errors.append(f"worker {rank}: {type(e).__name__}: {e}")
    workers_threads = [threading.Thread(target=work, args=(r,)) for r in range(workers)]
    for t in workers_threads:
        t.start()
    for t in workers_threads:
        t.join(600)
    for t in threads:
        t.join(30)
    scheduler.close()
    if errors or not result:
        print("; ".join(errors) or "no result", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
