"""One worker of our contender, started by tracker's launcher (never by hand).

    python -m tracker.local -n 2 -s 2 python benchmarks/harness/contenders/ours_worker.py \
        --task sync --model resnet50 --iters 20 --warmup 3 --out /tmp/ours.json

``--task sync``: dist_sync, all keys in one call per exchange: push then pull, and
pushpull; then per-key latency of single small keys. ``--task async``: dist_async
with SGD on the servers, pushes of one small key; updates per second.
Every worker checks every result (a wrong sum exits non-zero, failing the job);
rank 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import numpy as np  # noqa: E402

import kvstore  # noqa: E402
from benchmarks.harness import common  # noqa: E402
from benchmarks.harness.resnet50_shapes import model_shapes  # noqa: E402

LATENCY_KEY0 = 1 << 20

# Gradient compression modes: pushpull with worker->server traffic compressed.
# Every pushed value is >= 1 (common.grad_value), so with error feedback each
# element always sends +t (2bit, t = 0.5) or +1 (1bit, t = 0): the exact sum is
# W*t or W, every iteration. fp16 carries these small integers exactly.
COMPRESSION = {
    "pushpull_2bit": ({"type": "2bit", "threshold": 0.5}, lambda w, k, i: w * 0.5),
    "pushpull_1bit": ({"type": "1bit", "threshold": 0.0}, lambda w, k, i: float(w)),
    "pushpull_fp16": ({"type": "fp16"}, common.expected_sum),
}


# Mixed precision on the wire (kv.set_multi_precision, kvstore/precision.py): pushpull of
# torch gradients in this dtype into outputs of it, the keys float32 on the servers. The
# benchmark's values are small integers, which bfloat16 carries exactly.
LOW_PRECISION = {"pushpull_bf16": "bfloat16"}


class _TorchFilled:
    """A torch tensor with numpy's ``fill`` (what common.fill_grads calls)."""

    def __init__(self, t):
        self.t = t

    def fill(self, value: float) -> None:
        self.t.fill_(value)


def sync_task(kv, args) -> dict:
    rank, w = kv.rank, kv.num_workers
    shapes = model_shapes(args.model)
    keys = list(range(len(shapes)))
    grads: list[Any] = [np.zeros(s, np.float32) for s in shapes]
    outs: list[Any] = [np.zeros(s, np.float32) for s in shapes]
    kv.init(keys, grads)
    result: dict[str, Any] = {"modes": {}}   # the JSON result
    base = 0
    wide = (grads, outs)
    for mode in args.modes.split(","):
        grads, outs = wide
        if mode == "pushpull_shared":   # gradients in kv.empty() memory (read in place over shm)
            grads = [kv.empty(s, np.float32) for s in shapes]
            wide = (grads, outs)         # (kept by the modes after it, as before)
        kv.set_multi_precision(mode in LOW_PRECISION)
        if mode in LOW_PRECISION:
            import torch
            dtype = getattr(torch, LOW_PRECISION[mode])
            grads, outs = ([torch.zeros(s, dtype=dtype) for s in shapes] for _ in range(2))
        compression, expected = COMPRESSION.get(mode, ({"type": "none"}, common.expected_sum))
        kv.set_gradient_compression(compression)   # fresh residuals for every mode
        traffic = {"bytes_sent": 0, "bytes_received": 0, "exchanges": 0}
        def prepare(i, base=base, grads=grads, outs=outs, mode=mode):
            if mode in LOW_PRECISION:
                common.fill_grads([_TorchFilled(g) for g in grads], rank, base + i)
                for o in outs:
                    o.fill_(-1.0)
                return
            common.fill_grads(grads, rank, base + i)
            for o in outs:
                o.fill(-1.0)

        if mode == "push_pull":
            def step(i, grads=grads, outs=outs):
                kv.push(keys, grads)
                kv.pull(keys, out=outs)
        elif mode in ("pushpull", "pushpull_shared") or mode in COMPRESSION or mode in LOW_PRECISION:
            def step(i, grads=grads, outs=outs):
                kv.pushpull(keys, grads, out=outs)
        else:
            raise SystemExit(f"unknown mode {mode!r}")

        def counted(i, step=step, traffic=traffic):   # bytes on the wire, this worker
            before = kv.comm_stats()
            step(i)
            after = kv.comm_stats()
            for f in ("bytes_sent", "bytes_received"):
                traffic[f] += after[f] - before[f]
            traffic["exchanges"] += 1

        def check(i, base=base, mode=mode, expected=expected, outs=outs):
            shown = [o.float() for o in outs] if mode in LOW_PRECISION else outs   # (numpy has no bfloat16)
            common.verify(shown, w, base + i, f"ours {mode} worker {rank}", expected)
        times, per = common.timed_loop(counted, prepare, check, args.iters, args.warmup, kv.barrier,
                                       profiler=args.profiler)
        n = max(1, traffic["exchanges"])
        result["modes"][mode] = {"times": times, **per, "bytes_sent": traffic["bytes_sent"] / n,
                                 "bytes_received": traffic["bytes_received"] / n}
        base += args.iters + args.warmup
    kv.set_gradient_compression({"type": "none"})
    kv.set_multi_precision(False)
    if args.latency_iters:
        result["latency"] = {}
        for j, n in enumerate(int(x) for x in args.latency_sizes.split(",")):
            key = LATENCY_KEY0 + j
            g = np.empty(n, np.float32)
            out = np.empty(n, np.float32)
            kv.init(key, np.zeros(n, np.float32))
            kv.barrier()
            times = []
            for i in range(args.latency_iters + 20):
                g.fill(common.grad_value(rank, 0, i))
                t0 = time.perf_counter()
                kv.pushpull(key, g, out=out)
                t1 = time.perf_counter()
                if out[0] != common.expected_sum(w, 0, i) or out[-1] != out[0]:
                    raise common.WrongResult(f"ours latency {n}: got {out[0]}, iteration {i}")
                if i >= 20:
                    times.append(t1 - t0)
            result["latency"][str(n * 4)] = times
    return result


def async_task(kv, args) -> dict:
    w = kv.num_workers
    n, pushes = args.async_size, args.async_pushes
    key = 7
    kv.init(key, np.zeros(n, np.float32))
    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=1.0))
    g = np.ones(n, np.float32)
    out = np.empty(n, np.float32)
    rates = []
    done = 0
    for rep in range(args.async_reps):
        kv.barrier()
        t0 = time.perf_counter()
        for _ in range(pushes):
            kv.push(key, g)
        kv.barrier()  # waits for this worker's acknowledgements, then for everyone's
        t1 = time.perf_counter()
        done += w * pushes
        kv.pull(key, out=out)
        if out[0] != -float(done) or out[-1] != out[0]:
            raise common.WrongResult(f"ours async: weight {out[0]}, expected {-float(done)}")
        rates.append(w * pushes / (t1 - t0))
    return {"async": {"size_bytes": n * 4, "pushes_per_worker": pushes, "updates_per_s": rates}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
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
    p.add_argument("--out", default=os.environ.get("BENCH_OUT"))
    p.add_argument("--profile", default=None,
                   help="write a cProfile dump of rank 0's timed exchanges here")
    args = p.parse_args()
    store = "dist_sync" if args.task == "sync" else "dist_async"
    kv = kvstore.create(store)
    assert isinstance(kv, kvstore.KVStore)   # a built-in store type
    with kv:
        args.profiler = None
        if args.profile and kv.rank == 0:
            import cProfile
            args.profiler = cProfile.Profile()
        usage = common.Usage()
        result = (sync_task if args.task == "sync" else async_task)(kv, args)
        result["usage_total"] = usage.since()
        if args.profiler is not None:
            args.profiler.dump_stats(args.profile)
        if kv.rank == 0 and args.out:
            # which data-plane URLs the servers advertised (checks the transport used)
            client = getattr(kv, "_client", None)
            urls = getattr(client, "servers", None)
            kinds = getattr(client, "transports", None)
            result.update(num_workers=kv.num_workers, task=args.task, model=args.model,
                          host_group=list(getattr(kv, "host_group", ())),   # KVSTORE_HOST_REDUCE
                          server_urls=list(urls) if urls else None,
                          transports=list(kinds) if kinds else None)
            common.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
