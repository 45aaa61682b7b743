"""One rank of the torch.distributed gloo contender (started by contenders/gloo.py).

Modes, on the same parameter set and values as ours:
  per_tensor  one blocking all_reduce per tensor (161 for ResNet-50)
  flat        one all_reduce of a single flat buffer holding every tensor
  buckets     DDP's layout: tensors in reverse order packed into buckets of
              ~25 MB (the first 1 MB, as DDP's first bucket), tensors are views
              into their bucket (gradient_as_bucket_view), one async all_reduce
              per bucket, then wait for all
Then per-key latency: all_reduce of one small tensor.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.harness import common  # noqa: E402
from benchmarks.harness.resnet50_shapes import model_shapes  # noqa: E402

BUCKET_BYTES = 25 << 20
FIRST_BUCKET_BYTES = 1 << 20


def buckets_for(shapes) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(bucket buffers, one view per tensor in the original order)."""
    order = list(range(len(shapes)))[::-1]
    groups: list[list[int]] = []
    cur: list[int] = []
    cur_bytes, cap = 0, FIRST_BUCKET_BYTES
    for k in order:
        nbytes = 4 * int(torch.Size(shapes[k]).numel())
        if cur and cur_bytes + nbytes > cap:
            groups.append(cur)
            cur, cur_bytes, cap = [], 0, BUCKET_BYTES
        cur.append(k)
        cur_bytes += nbytes
    if cur:
        groups.append(cur)
    buffers: list[torch.Tensor] = []
    views: dict[int, torch.Tensor] = {}
    for g in groups:
        buf = torch.zeros(sum(int(torch.Size(shapes[k]).numel()) for k in g), dtype=torch.float32)
        pos = 0
        for k in g:
            n = int(torch.Size(shapes[k]).numel())
            views[k] = buf[pos:pos + n].view(shapes[k])
            pos += n
        buffers.append(buf)
    return buffers, [views[k] for k in range(len(shapes))]   # every tensor is in a group


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--modes", default="per_tensor,flat,buckets")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--latency-sizes", default="1,1024,16384")
    p.add_argument("--latency-iters", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rank, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=os.environ["BENCH_INIT_METHOD"], rank=rank,
                            world_size=w)
    shapes = model_shapes(args.model)
    total = sum(int(torch.Size(s).numel()) for s in shapes)
    result: dict[str, Any] = {"modes": {}, "num_workers": w, "torch_version": torch.__version__,
              "torch_threads": torch.get_num_threads()}
    usage = common.Usage()
    base = 0
    for mode in args.modes.split(","):
        if mode == "per_tensor":
            tensors = [torch.zeros(s, dtype=torch.float32) for s in shapes]

            def step(i, tensors=tensors):
                for t in tensors:
                    dist.all_reduce(t)
        elif mode == "flat":
            flat = torch.zeros(total, dtype=torch.float32)
            tensors, pos = [], 0
            for s in shapes:
                n = int(torch.Size(s).numel())
                tensors.append(flat[pos:pos + n].view(s))
                pos += n

            def step(i, flat=flat):
                dist.all_reduce(flat)
        elif mode == "buckets":
            bufs, tensors = buckets_for(shapes)

            def step(i, bufs=bufs):
                for work in [dist.all_reduce(b, async_op=True) for b in bufs]:
                    work.wait()
        else:
            raise SystemExit(f"unknown mode {mode!r}")
        arrays = [t.numpy() for t in tensors]

        def prepare(i, arrays=arrays, base=base):
            common.fill_grads(arrays, rank, base + i)

        def check(i, arrays=arrays, base=base, mode=mode):
            common.verify(arrays, w, base + i, f"gloo {mode} rank {rank}")
        times, per = common.timed_loop(step, prepare, check, args.iters, args.warmup, dist.barrier)
        result["modes"][mode] = {"times": times, **per}
        base += args.iters + args.warmup
    if args.latency_iters:
        result["latency"] = {}
        for n in (int(x) for x in args.latency_sizes.split(",")):
            t = torch.empty(n, dtype=torch.float32)
            dist.barrier()
            times = []
            for i in range(args.latency_iters + 20):
                t.fill_(common.grad_value(rank, 0, i))
                t0 = time.perf_counter()
                dist.all_reduce(t)
                t1 = time.perf_counter()
                if t[0].item() != common.expected_sum(w, 0, i):
                    raise common.WrongResult(f"gloo latency {n}: got {t[0].item()}")
                if i >= 20:
                    times.append(t1 - t0)
            result["latency"][str(n * 4)] = times
    result["usage_total"] = usage.since()
    dist.barrier()
    if rank == 0:
        common.write_json(args.out, result)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
