"""The processes of benchmarks.trainer: what every worker, the floor and the
reference share (the seeded network, the synthetic batches, the training loop) and
the entry point each of them runs:

    python benchmarks/trainer/worker.py --role ROLE --config JSON --out-prefix P

``ROLE``: ours (a kvstore.torch.Trainer worker of a dist_sync job), ddp (a torch
DDP rank over gloo), floor (one process on the concatenated batch) or reference
(the untimed single-process references). Each writes ``P-rank<r>.npy`` (its
parameters after the steps, raw float32, no pickle) and ``P-rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING

if __package__ in (None, ""):  # run as a file (the workers): make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    __package__ = "benchmarks.trainer"

import numpy as np  # noqa: E402

from benchmarks.harness import common  # noqa: E402

if TYPE_CHECKING:
    from kvstore import KVStore
    from kvstore.torch import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
THIS = os.path.abspath(__file__)


# ----------------------------------------------------------------- what every process shares

def data_seed(seed: int, rank: int, step: int) -> int:
    return (seed * 1_000_003 + rank * 10_007 + step) % (2 ** 63)


def make_batch(cfg: dict, rank: int, step: int):
    """Rank ``rank``'s batch of step ``step``: b images (standard normal) and labels."""
    import torch
    g = torch.Generator().manual_seed(data_seed(cfg["seed"], rank, step))
    x = torch.randn((cfg["batch_size"], 3, cfg["image_size"], cfg["image_size"]), generator=g)
    y = torch.randint(0, cfg["num_classes"], (cfg["batch_size"],), generator=g)
    return x, y


def dropout_seed(cfg: dict, rank: int, step: int) -> int:
    return data_seed(cfg["seed"] + 7919, rank, step)


def build(cfg: dict):
    """(model, torch SGD) from the seeded initialisation, with 1 intra-op thread."""
    import torch
    sys.path.insert(0, REPO)
    from examples.models import get_network
    torch.set_num_threads(1)
    torch.manual_seed(cfg["seed"])
    model = get_network(cfg["network"], num_classes=cfg["num_classes"],
                        num_layers=cfg["num_layers"],
                        image_shape=(3, cfg["image_size"], cfg["image_size"]))
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"],
                          weight_decay=cfg["wd"])
    return model, opt


def per_slice_needed(model) -> bool:
    """True when one forward pass on W*b is not W passes on b averaged (BatchNorm
    statistics, dropout masks)."""
    from torch import nn
    return any(isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.Dropout)) for m in model.modules())


def flat_params(model) -> np.ndarray:
    import torch
    with torch.no_grad():
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


# ----------------------------------------------------------------- the processes

def servers_cpu_s() -> float:
    """CPU seconds used so far by this worker's sibling servers (processes of the same
    parent running ``kvstore.server``: the launcher's job on this host), from /proc."""
    total, parent, tick = 0.0, os.getppid(), os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == parent and b"kvstore.server" in cmd:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def train(cfg: dict, role: str, rank: int, net, stepper, sync=None, timed: bool = True,
          at_timed=None):
    """Run warm-up + timed steps. ``role``: ours/ddp (rank ``rank``'s batch), floor
    (one pass on the concatenated batch) or reference (per-slice passes when the
    network needs them). ``stepper`` has zero_grad() and step() (Trainer or torch
    optimizer); ``at_timed()``, if given, runs untimed before the first timed step and
    after the last. Returns (rank 0-style result dict without parameters)."""
    import torch
    import torch.nn.functional as F
    w = cfg["workers"]
    slices = role == "reference" and per_slice_needed(net)
    batch, losses = {}, []

    def prepare(i):
        if role in ("ours", "ddp"):
            batch["xy"] = [make_batch(cfg, rank, i)]
            batch["seeds"] = [dropout_seed(cfg, rank, i)]
        else:
            parts = [make_batch(cfg, r, i) for r in range(w)]
            batch["xy"] = parts if slices else [(torch.cat([x for x, _ in parts]),
                                                 torch.cat([y for _, y in parts]))]
            batch["seeds"] = [dropout_seed(cfg, r, i) for r in range(w)]

    parts: dict[str, list[float]] = {"forward": [], "backward": [], "step": []}   # where each timed step's time went

    def step(i):
        t0 = time.perf_counter()
        stepper.zero_grad()
        xys = batch["xy"]
        loss = 0
        for (x, y), seed in zip(xys, batch["seeds"]):
            torch.manual_seed(seed)   # dropout masks as rank r draws them
            loss = loss + F.cross_entropy(net(x), y)
        if len(xys) > 1:
            loss = loss / len(xys)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        stepper.step()
        batch["loss"] = loss
        if i >= cfg["warmup"]:
            for k, v in (("forward", t1 - t0), ("backward", t2 - t1),
                         ("step", time.perf_counter() - t2)):
                parts[k].append(v)

    def check(i):
        losses.append(float(batch["loss"].detach()))
        if at_timed is not None and i in (cfg["warmup"] - 1, cfg["warmup"] + cfg["iters"] - 1):
            at_timed()

    if not timed:
        for i in range(cfg["warmup"] + cfg["iters"]):
            prepare(i)
            step(i)
            check(i)
        return {"losses": losses, "per_slice": slices}
    if at_timed is not None and cfg["warmup"] == 0:
        at_timed()
    times, per = common.timed_loop(step, prepare, check, cfg["iters"], cfg["warmup"], sync)
    return {"times": times, **per, "losses": losses, "parts": parts}


def _save(prefix: str, model, corrupt: bool) -> int:
    params = flat_params(model)
    if corrupt:
        params[len(params) // 2] += 1e-2
    np.save(f"{prefix}.npy", params, allow_pickle=False)
    return int(params.size)


def train_references(cfg: dict, prefix: str) -> None:
    """The single-process references, untimed, from the same seeded initial weights:
    ``prefix-rank0.npy`` with torch's SGD (what DDP and ours with workers updating
    compute) and ``prefix-kvsgd-rank0.npy`` with the servers' update (torch SGD's
    twin), run by the same loop on a ``local`` store (update_on_kvstore=True)."""
    import kvstore
    import kvstore.torch as kvtorch
    t0 = time.time()
    model, opt = build(cfg)
    ref = train(cfg, "reference", 0, model, opt, timed=False)
    ref["num_params"] = _save(f"{prefix}-rank0", model, False)
    model, opt = build(cfg)
    kv = kvstore.create("local")
    assert isinstance(kv, kvstore.KVStore)   # a built-in store type
    with kv:
        trainer = kvtorch.Trainer(model.parameters(), kv, opt, update_on_kvstore=True, overlap=False)
        ref["kvsgd_losses"] = train(cfg, "reference", 0, model, trainer, timed=False)["losses"]
        trainer.close()
    _save(f"{prefix}-kvsgd-rank0", model, False)
    ref["seconds"] = time.time() - t0
    common.write_json(f"{prefix}-rank0.json", ref)


def worker_main(argv: list[str]) -> int:
    """``python benchmarks/trainer/worker.py --role ROLE --config JSON --out-prefix P``:
    writes ``P-rank<r>.npy`` (parameters after the steps, float32) and ``P-rank<r>.json``;
    ``--reference-prefix R`` (floor only): then trains the reference, to ``R-rank0.*``."""
    p = argparse.ArgumentParser(prog="benchmarks/trainer/worker.py")
    p.add_argument("--role", choices=("ours", "ddp", "floor", "reference"), required=True)
    p.add_argument("--config", required=True, help="the run's settings as JSON")
    p.add_argument("--out-prefix", required=True)
    p.add_argument("--reference-prefix", default=None)
    p.add_argument("--overlap", type=int, default=1)
    p.add_argument("--update-on-kvstore", type=int, default=0)
    p.add_argument("--flat-buckets", type=int, default=0, help="ours: the Trainer's flat_buckets=")
    p.add_argument("--corrupt", type=int, default=0, help="tests only: perturb one parameter")
    args = p.parse_args(argv)
    cfg = json.loads(args.config)
    stamps = {"start": time.time()}
    import torch
    model, opt = build(cfg)
    stamps["imported"] = time.time()
    w = cfg["workers"]
    kv: KVStore | None = None
    trainer: Trainer | None = None
    if args.role == "ours":
        import kvstore
        import kvstore.torch as kvtorch
        created = kvstore.create("dist_sync")
        assert isinstance(created, kvstore.KVStore)   # a built-in store type
        kv = created
        rank = kv.rank
        if kv.num_workers != w:
            raise SystemExit(f"expected {w} workers, the job has {kv.num_workers}")
        trainer = kvtorch.Trainer(model.parameters(), kv, opt,
                                  update_on_kvstore=bool(args.update_on_kvstore),
                                  overlap=bool(args.overlap), flat_buckets=bool(args.flat_buckets),
                                  bucket_bytes=cfg.get("bucket_bytes"))
        net, stepper, sync = model, trainer, kv.barrier
    elif args.role == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
        rank = int(os.environ["RANK"])
        dist.init_process_group("gloo", init_method=os.environ["BENCH_INIT_METHOD"], rank=rank,
                                world_size=w)
        net, stepper, sync = DistributedDataParallel(model), opt, dist.barrier
    else:
        rank, net, stepper, sync = 0, model, opt, None
    load = os.getloadavg()
    stamps["ready"] = time.time()
    if args.role == "reference":
        train_references(cfg, args.out_prefix)
        os._exit(0)
    servers_cpu: list[float] = []    # ours, rank 0: the servers' CPU seconds at the timed steps' ends
    at_timed = (lambda: servers_cpu.append(servers_cpu_s())) if args.role == "ours" and rank == 0 else None
    result = train(cfg, args.role, rank, net, stepper, sync, at_timed=at_timed)
    if len(servers_cpu) == 2:
        result["servers_cpu_s"] = (servers_cpu[1] - servers_cpu[0]) / cfg["iters"]
    stamps["trained"] = time.time()
    # the last worker's answer goes wrong with --corrupt (tests: the check must catch it)
    n = _save(f"{args.out_prefix}-rank{rank}", model, bool(args.corrupt) and rank == w - 1)
    result.update(role=args.role, rank=rank, loadavg_start=load, loadavg_end=os.getloadavg(),
                  num_params=n, torch=torch.__version__, torch_threads=torch.get_num_threads())
    if trainer is not None:
        result["bucket_bytes"] = trainer.bucket_bytes
    if kv is not None:
        client = getattr(kv, "_client", None)
        kinds = getattr(client, "transports", None)
        urls = getattr(client, "servers", None)
        result["transports"] = list(kinds) if kinds else None
        result["server_urls"] = list(urls) if urls else None
        assert trainer is not None   # built with kv
        trainer.close()
        kv.close()
    if args.role == "ddp":
        import torch.distributed as dist
        dist.barrier()
        dist.destroy_process_group()
    stamps["closed"] = time.time()
    result["stamps"] = stamps
    if args.reference_prefix:   # untimed, after the timed steps
        train_references(cfg, args.reference_prefix)
    common.write_json(f"{args.out_prefix}-rank{rank}.json", result)
    # skip the interpreter's slow tear-down of torch (seconds per launch on 2 cores):
    # everything this process had to say is in its files
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
