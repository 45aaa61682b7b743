"""One process of MXNet 1.9.1's own dist kvstore job (scheduler, server or worker:
``DMLC_ROLE`` decides; ``import mxnet`` runs the scheduler/server loop and exits
for those roles, as MXNet's tools/launch.py relies on). Runs in
benchmarks/.venv-mxnet; started by benchmarks/harness/peers/mxnet_peer.py.

The worker does what ours_worker.py does with MXNet's API: every key in one
call, push then pull, and pushpull; per-key latency; dist_async updates/s.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import mxnet as mx  # noqa: E402  (servers and the scheduler never return from this import)
import numpy as np  # noqa: E402

from benchmarks.harness import common  # noqa: E402
from benchmarks.harness.resnet50_shapes import model_shapes  # noqa: E402

LATENCY_KEY0 = 1 << 20


def sync_task(kv, args) -> dict:
    rank, w = kv.rank, kv.num_workers
    shapes = model_shapes(args.model)
    keys = list(range(len(shapes)))
    grads = [mx.nd.zeros(s, dtype="float32") for s in shapes]
    outs = [mx.nd.zeros(s, dtype="float32") for s in shapes]
    kv.init(keys, grads)
    mx.nd.waitall()
    result: dict[str, Any] = {"modes": {}}   # the JSON result
    base = 0
    for mode in args.modes.split(","):
        def prepare(i, base=base):
            for k, g in enumerate(grads):
                g[:] = common.grad_value(rank, k, base + i)
            for o in outs:
                o[:] = -1.0
            mx.nd.waitall()

        if mode == "push_pull":
            def step(i):
                kv.push(keys, grads)
                kv.pull(keys, out=outs)
                mx.nd.waitall()
        elif mode == "pushpull":
            def step(i):
                kv.pushpull(keys, grads, out=outs)
                mx.nd.waitall()
        else:
            raise SystemExit(f"unknown mode {mode!r}")

        def check(i, base=base, mode=mode):
            common.verify([o.asnumpy() for o in outs], w, base + i, f"mxnet {mode} worker {rank}")
        times, per = common.timed_loop(step, prepare, check, args.iters, args.warmup, kv._barrier)
        result["modes"][mode] = {"times": times, **per}
        base += args.iters + args.warmup
    if args.latency_iters:
        result["latency"] = {}
        for j, n in enumerate(int(x) for x in args.latency_sizes.split(",")):
            key = LATENCY_KEY0 + j
            g = mx.nd.zeros(n, dtype="float32")
            out = mx.nd.zeros(n, dtype="float32")
            kv.init(key, mx.nd.zeros(n, dtype="float32"))
            mx.nd.waitall()
            kv._barrier()
            times = []
            for i in range(args.latency_iters + 20):
                g[:] = common.grad_value(rank, 0, i)
                g.wait_to_read()
                t0 = time.perf_counter()
                kv.pushpull(key, g, out=out)
                out.wait_to_read()
                t1 = time.perf_counter()
                got = out.asnumpy()
                if got[0] != common.expected_sum(w, 0, i) or got[-1] != got[0]:
                    raise common.WrongResult(f"mxnet latency {n}: got {got[0]}, iteration {i}")
                if i >= 20:
                    times.append(t1 - t0)
            result["latency"][str(n * 4)] = times
    return result


def async_task(kv, args) -> dict:
    w = kv.num_workers
    n, pushes = args.async_size, args.async_pushes
    key = 7
    kv.init(key, mx.nd.zeros(n, dtype="float32"))
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=1.0))
    g = mx.nd.ones(n, dtype="float32")
    out = mx.nd.zeros(n, dtype="float32")
    mx.nd.waitall()
    rates, done = [], 0
    for rep in range(args.async_reps):
        kv._barrier()
        t0 = time.perf_counter()
        for _ in range(pushes):
            kv.push(key, g)
        mx.nd.waitall()   # every push acknowledged by the server
        kv._barrier()
        t1 = time.perf_counter()
        done += w * pushes
        kv.pull(key, out=out)
        got = out.asnumpy()
        if got[0] != -float(done) or got[-1] != got[0]:
            raise common.WrongResult(f"mxnet async: weight {got[0]}, expected {-float(done)}")
        rates.append(w * pushes / (t1 - t0))
        # MXNet's dist kvstore pulls into the buffer of the last push of the key
        # (its comm buffer is the pushed array on CPU): restore the gradient
        g[:] = 1.0
        mx.nd.waitall()
    return {"async": {"size_bytes": n * 4, "pushes_per_worker": pushes, "updates_per_s": rates}}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--task", choices=("sync", "async"), default="sync")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--modes", default="push_pull,pushpull")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--latency-sizes", default="1,1024,16384")
    p.add_argument("--latency-iters", type=int, default=0)
    p.add_argument("--async-size", type=int, default=1024)
    p.add_argument("--async-pushes", type=int, default=500)
    p.add_argument("--async-reps", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    kv = mx.kv.create("dist_sync" if args.task == "sync" else "dist_async")
    usage = common.Usage()
    result = (sync_task if args.task == "sync" else async_task)(kv, args)
    result["usage_total"] = usage.since()
    kv._barrier()
    if kv.rank == 0:
        result.update(num_workers=kv.num_workers, task=args.task, model=args.model,
                      mxnet_version=mx.__version__, numpy_version=np.__version__)
        common.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
