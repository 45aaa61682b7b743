"""One worker process of the GPU check's timed runs (started by benchmarks/gpu_check/run.py).

    python -m tracker.local -n 2 -s 2 --server-device gpu \\
        python benchmarks/gpu_check/worker.py exchange --out /tmp/ours.json
    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p \\
        python benchmarks/gpu_check/worker.py exchange --gloo --out /tmp/gloo.json

``exchange``: the ResNet-50 gradient set (161 tensors, 102.2 MB fp32) as CUDA
tensors, summed over the workers: ours by ``dist_device_sync`` pushpull of every
key in one call (``--layout buckets``: of the 19 flat buckets that hold the same
values in ``Trainer(flat_buckets=True)``; ``--layout flat``: of one key), gloo by one all_reduce of a flat CUDA
buffer (its fastest layout here). Every result is checked against the exact sum (a wrong one exits non-zero).
``train``: one ResNet-50 training step (torchvision's model, a synthetic batch on
the GPU): ours ``kvstore.torch.Trainer`` with SGD on the servers, gloo DDP with
torch SGD. Rank 0 writes the medians (ms) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from benchmarks.harness.key_layouts import LAYOUTS, layout  # noqa: E402
from benchmarks.harness.resnet50_shapes import resnet50_shapes  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(step, iters: int, warmup: int, check=None) -> list[float]:
    """Milliseconds of each ``step(i)`` after ``warmup``; ``check(i)`` runs untimed."""
    samples = []
    for i in range(warmup + iters):
        sync()
        t0 = time.perf_counter()
        step(i)
        sync()
        if i >= warmup:
            samples.append((time.perf_counter() - t0) * 1e3)
        if check is not None:
            check(i)
    return samples


def exchange(args, rank: int, world: int, kv=None) -> list[float]:
    shapes: list = [s for _, s in resnet50_shapes()]
    if args.layout != "keys":   # the same values in the Trainer's 19 flat buckets, or in one key
        shapes = [(n,) for n in layout(args.layout)]
    grads = [torch.empty(s, device=args.device) for s in shapes]
    outs = [torch.empty(s, device=args.device) for s in shapes]
    if kv is not None:
        keys = list(range(len(shapes)))
        kv.init(keys, [torch.zeros(s, device=args.device) for s in shapes])
        flat = None
    else:
        flat = torch.empty(sum(g.numel() for g in grads), device=args.device)

    def step(i):
        value = float((rank + 1) * (i + 1) % 251)
        if kv is not None:
            for g in grads:
                g.fill_(value)
            kv.pushpull(keys, grads, out=outs)
        else:
            flat.fill_(value)
            torch.distributed.all_reduce(flat)

    def check(i):
        want = float(sum((r + 1) * (i + 1) % 251 for r in range(world)))
        for t in (outs if kv is not None else [flat]):
            if not bool((t == want).all()):
                raise SystemExit(f"worker {rank}: wrong sum in iteration {i} (want {want})")
    return timed(step, args.iters, args.warmup, check)


def train(args, rank: int, world: int, kv=None) -> list[float]:
    import torchvision
    import kvstore.torch as kvtorch
    from kvstore import optimizer as kvopt
    torch.manual_seed(0)
    model = torchvision.models.resnet50().cuda()
    gen = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(args.batch, 3, 224, 224, device="cuda", generator=gen)
    y = torch.randint(0, 1000, (args.batch,), device="cuda", generator=gen)
    zero: Callable[[], object]      # the Trainer's or torch's optimizer's
    finish: Callable[[], object]
    if kv is not None:
        trainer = kvtorch.Trainer(model.parameters(), kv, kvopt.SGD(learning_rate=0.01, momentum=0.9),
                                  flat_buckets=args.flat_buckets)
        zero, finish = trainer.zero_grad, trainer.step
        net = model
    else:
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        zero, finish = opt.zero_grad, opt.step

    def step(i):
        zero()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        finish()
    samples = timed(step, args.iters, args.warmup)
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        raise SystemExit(f"worker {rank}: the weights are not finite after training")
    return samples


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("task", choices=["exchange", "train"])
    p.add_argument("--gloo", action="store_true", help="torch.distributed gloo instead of kvstore")
    p.add_argument("--flat-buckets", action="store_true", help="train: the Trainer's flat_buckets=True")
    p.add_argument("--layout", choices=LAYOUTS, default="keys",
                   help="exchange: ours pushpulls ResNet-50's values as 161 keys, as the Trainer's 19 flat "
                        "buckets, or as one key (benchmarks/harness/key_layouts.py)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="exchange: where the tensors live (cpu: CI runs this script's logic there)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=32, help="train: images per worker")
    p.add_argument("--out", required=True)
    p.add_argument("--profile", default=None, help="rank 0 writes a cProfile summary of the run here")
    p.add_argument("--server-profile", default=None, metavar="LABEL",
                   help="rank 0 profiles the servers' request loops for the run (server commands "
                        "profile_start/stop/dump); each server writes server-<rank>-LABEL.prof into "
                        "its KVSTORE_PROFILE_DIR (set it in the job's environment)")
    args = p.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(0)
    task = exchange if args.task == "exchange" else train
    transports: list = []
    if args.gloo:
        torch.distributed.init_process_group("gloo")
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        samples = task(args, rank, world)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    else:
        import kvstore
        kv = kvstore.create("dist_device_sync")
        assert isinstance(kv, kvstore.KVStore)   # a built-in store type
        with kv:
            rank, world = kv.rank, kv.num_workers
            profiles_servers = bool(args.server_profile) and rank == 0
            if profiles_servers:
                kv._send_command_to_servers("profile_start")
            if args.profile and rank == 0:
                import cProfile
                import io
                import pstats
                profiler = cProfile.Profile()
                samples = profiler.runcall(task, args, rank, world, kv)
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
                with open(args.profile, "w") as f:
                    f.write(text.getvalue())
            else:
                samples = task(args, rank, world, kv)
            if profiles_servers:
                kv._send_command_to_servers("profile_stop")
                print("server profiles:", kv._send_command_to_servers("profile_dump", args.server_profile))
            transports = sorted(kv.comm_stats()["by_transport"])   # e.g. ["cuda_ipc"]
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"median_ms": statistics.median(samples), "samples_ms": samples,
                       "transports": transports}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
