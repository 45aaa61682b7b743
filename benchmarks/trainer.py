"""One training step end to end: ours (kvstore.torch.Trainer) against torch DDP over
gloo and against one process with no communication at all.

    python -m benchmarks.trainer                       # VGG-11, b=16 per worker, W=2, S=2, 3 launches
    python -m benchmarks.trainer --network resnet --num-layers 20 --batch-size 32
    python -m benchmarks.trainer --link 1gbit          # two emulated machines (root)

``--link RATE`` splits every distributed contender over two network namespaces
joined by a veth pair rate-limited by tc tbf, built and removed (even on failure or
SIGTERM) by benchmarks/link.py's ``Link``: A runs the scheduler, server 0, worker 0
(DDP rank 0) and the floor; B server 1, worker 1 (DDP rank 1); ours over tcp, gloo
over the veth. It also times each step's parts (forward, backward, step()), counts
the bytes on the link, and sets the medians against docs/performance.md section 6's
step-time model. Results go to ``trainer-link-RATE.{md,json}``.

A step is ``zero_grad``, forward, backward (with whatever communication the
contender overlaps with it), the rest of the gradient exchange and the optimizer
update, timed on every worker (rank 0's times are reported). Contenders, all on the
same network (examples/models.py ``get_network``), the same seeded initial weights,
the same synthetic data (per rank and step, from a fixed seed: no download) and
the same SGD hyper-parameters (lr, momentum, weight decay), every process with
``torch.set_num_threads(1)``:

  ours-overlap-server     kvstore.torch.Trainer, dist_sync, S servers, started by
                          tracker.launcher.launch (the real launcher); overlap=True
                          (each gradient bucket is pushed from a backward hook);
                          update_on_kvstore=True (the servers run SGD with momentum)
  ours-overlap-worker     ... update_on_kvstore=False (torch.optim.SGD on every worker)
  ours-nooverlap-server   overlap=False (everything is pushed in step()), servers update
  ours-nooverlap-worker   overlap=False, workers update
  ddp                     torch DistributedDataParallel over gloo (25 MB buckets, the
                          default), torch.optim.SGD; W ranks rendezvous at
                          tcp://127.0.0.1:<free port> as benchmarks/contenders/gloo.py
  floor                   one process, no communication, one batch of W*b: the compute
                          floor (floor/W would be perfect scaling on W free cores)

Each launch runs ``--warmup`` untimed steps, then ``--iters`` timed ones; a barrier
(untimed) and the generation of the step's batch precede every step. Launches are
interleaved, the order rotating every round, and the load average is recorded
before each launch. Writes ``<name>.md`` and ``<name>.json`` to --out-dir.

Correctness, checked every run (a wrong answer fails the run, exit status 1): after
its warm-up and timed steps, every worker of every launch of ours and DDP writes its
parameters (raw float32 ``.npy``, no pickle), and they must equal, to ``--rtol`` /
``--atol`` (``numpy.allclose``, default 1e-4 / 1e-5), a reference trained once per
run, untimed, by one process on the concatenation of all workers' batches (after the
first floor launch, in the floor's process): DDP and ours with workers updating
against the reference with torch's SGD, and ours also against DDP of the same round.
Ours with servers updating runs kvstore's SGD on the servers: MXNet's form of the same
update (``mom = m*mom - lr*(g + wd*w); w += mom``), equal to torch's for a constant lr
but rounded differently, and a few dozen steps of a network with BatchNorm, max
pooling and dropout amplify a last-bit difference to ~1e-2 (VGG-11, 25 steps). Those
two variants are therefore checked against a second reference, the same
single-process loop with kvstore's SGD (``kvstore.torch.Trainer`` on a ``local``
store, ``update_on_kvstore=True``); their distance from torch's SGD and from DDP is
reported, not checked. On this machine every checked comparison came out bit-identical
(difference 0), which the tolerance does not require.

What "the concatenated batch" means for networks with BatchNorm (resnet, vgg,
inception-bn): W processes normalise with the statistics of their own b samples,
one process on W*b with the statistics of all of them, so their gradients differ by
far more than rounding. The reference therefore runs the W slices of the
concatenated batch through separate forward passes (BatchNorm statistics per
worker's slice, dropout masks drawn from the same per-rank seeds as the workers) and
averages their losses: mathematically the gradient that DDP's and ours' averaging
produces. For networks without BatchNorm and dropout (mlp, lenet) this is exactly one
forward pass on the concatenated batch, and then the timed ``floor`` run is checked
against the reference too. BatchNorm's running statistics are buffers, not
parameters, and are not compared (ours does not synchronise them; DDP broadcasts rank
0's, which ends up with rank 0's own statistics as ours does).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a file (the workers): make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "benchmarks"

import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.procs import GroupFailed, free_port, run_group, tail  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIS = os.path.abspath(__file__)
DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "trainer")

# name -> (kind, overlap, update_on_kvstore, shown as)
CONTENDERS = {
    "ours-overlap-server": ("ours", True, True, "ours, overlap, servers update (kvstore SGD)"),
    "ours-overlap-worker": ("ours", True, False, "ours, overlap, workers update (torch SGD)"),
    "ours-nooverlap-server": ("ours", False, True, "ours, no overlap, servers update"),
    "ours-nooverlap-worker": ("ours", False, False, "ours, no overlap, workers update"),
    "ddp": ("ddp", None, None, "torch DDP over gloo (25 MB buckets)"),
    "floor": ("floor", None, None, "one process, batch W*b, no communication"),
}


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


def compare(got: np.ndarray, want: np.ndarray, rtol: float, atol: float) -> dict:
    """How far ``got`` is from ``want`` (flat float32 parameters): ok is
    ``numpy.allclose(got, want, rtol, atol)`` with matching shapes and finite values."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return {"ok": False, "why": f"shape {got.shape} != {want.shape}"}
    if not np.all(np.isfinite(got)):
        return {"ok": False, "why": "non-finite parameters"}
    diff = np.abs(got - want)
    excess = diff - (atol + rtol * np.abs(want))
    worst = int(np.argmax(excess)) if diff.size else 0
    return {"ok": bool(diff.size == 0 or excess[worst] <= 0), "max_abs": float(diff.max(initial=0.0)),
            "max_rel": float((diff / np.maximum(np.abs(want), 1e-12)).max(initial=0.0)),
            "worst_index": worst, "worst_got": float(got[worst]) if diff.size else None,
            "worst_want": float(want[worst]) if diff.size else None}


# ----------------------------------------------------------------- the processes

def train(cfg: dict, role: str, rank: int, net, stepper, sync=None, timed: bool = True):
    """Run warm-up + timed steps. ``role``: ours/ddp (rank ``rank``'s batch), floor
    (one pass on the concatenated batch) or reference (per-slice passes when the
    network needs them). ``stepper`` has zero_grad() and step() (Trainer or torch
    optimizer). Returns (rank 0-style result dict without parameters)."""
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

    parts = {"forward": [], "backward": [], "step": []}   # where each timed step's time went

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

    if not timed:
        for i in range(cfg["warmup"] + cfg["iters"]):
            prepare(i)
            step(i)
            check(i)
        return {"losses": losses, "per_slice": slices}
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
    compute) and ``prefix-kvsgd-rank0.npy`` with kvstore's SGD, the servers' update
    rule, run by the same loop on a ``local`` store (update_on_kvstore=True)."""
    import kvstore
    import kvstore.torch as kvtorch
    t0 = time.time()
    model, opt = build(cfg)
    ref = train(cfg, "reference", 0, model, opt, timed=False)
    ref["num_params"] = _save(f"{prefix}-rank0", model, False)
    model, opt = build(cfg)
    with kvstore.create("local") as kv:
        trainer = kvtorch.Trainer(model.parameters(), kv, opt, update_on_kvstore=True, overlap=False)
        ref["kvsgd_losses"] = train(cfg, "reference", 0, model, trainer, timed=False)["losses"]
        trainer.close()
    _save(f"{prefix}-kvsgd-rank0", model, False)
    ref["seconds"] = time.time() - t0
    common.write_json(f"{prefix}-rank0.json", ref)


def worker_main(argv: list[str]) -> int:
    """``python benchmarks/trainer.py _worker --role ROLE --config JSON --out-prefix P``:
    writes ``P-rank<r>.npy`` (parameters after the steps, float32) and ``P-rank<r>.json``;
    ``--reference-prefix R`` (floor only): then trains the reference, to ``R-rank0.*``."""
    p = argparse.ArgumentParser(prog="benchmarks/trainer.py _worker")
    p.add_argument("--role", choices=("ours", "ddp", "floor", "reference"), required=True)
    p.add_argument("--config", required=True, help="the run's settings as JSON")
    p.add_argument("--out-prefix", required=True)
    p.add_argument("--reference-prefix", default=None)
    p.add_argument("--overlap", type=int, default=1)
    p.add_argument("--update-on-kvstore", type=int, default=0)
    p.add_argument("--corrupt", type=int, default=0, help="tests only: perturb one parameter")
    args = p.parse_args(argv)
    cfg = json.loads(args.config)
    stamps = {"start": time.time()}
    import torch
    model, opt = build(cfg)
    stamps["imported"] = time.time()
    w = cfg["workers"]
    kv = trainer = None
    if args.role == "ours":
        import kvstore
        import kvstore.torch as kvtorch
        kv = kvstore.create("dist_sync")
        rank = kv.rank
        if kv.num_workers != w:
            raise SystemExit(f"expected {w} workers, the job has {kv.num_workers}")
        trainer = kvtorch.Trainer(model.parameters(), kv, opt,
                                  update_on_kvstore=bool(args.update_on_kvstore),
                                  overlap=bool(args.overlap))
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
    result = train(cfg, args.role, rank, net, stepper, sync)
    stamps["trained"] = time.time()
    # the last worker's answer goes wrong with --corrupt (tests: the check must catch it)
    n = _save(f"{args.out_prefix}-rank{rank}", model, bool(args.corrupt) and rank == w - 1)
    result.update(role=args.role, rank=rank, loadavg_start=load, loadavg_end=os.getloadavg(),
                  num_params=n, torch=torch.__version__, torch_threads=torch.get_num_threads())
    if kv is not None:
        client = getattr(kv, "_client", None)
        kinds = getattr(client, "transports", None)
        urls = getattr(client, "servers", None)
        result["transports"] = list(kinds) if kinds else None
        result["server_urls"] = list(urls) if urls else None
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


# ----------------------------------------------------------------- the orchestrator

class Failed(RuntimeError):
    pass


def _worker_argv(cfg: dict, role: str, prefix: str, **flags) -> list[str]:
    argv = [sys.executable, THIS, "_worker", "--role", role, "--config", json.dumps(cfg),
            "--out-prefix", prefix]
    for k, v in flags.items():
        argv += [f"--{k.replace('_', '-')}", str(int(v))]
    return argv


def _clean(prefix: str, ranks: int) -> None:
    for r in range(ranks):
        for ext in ("json", "npy"):
            path = f"{prefix}-rank{r}.{ext}"
            if os.path.exists(path):
                os.remove(path)


def _collect(prefix: str, ranks: int, what: str) -> list[dict]:
    """Every rank's result JSON (their parameters stay in ``prefix-rank<r>.npy``)."""
    out = []
    for r in range(ranks):
        try:
            with open(f"{prefix}-rank{r}.json") as f:
                out.append(json.load(f))
            if not os.path.exists(f"{prefix}-rank{r}.npy"):
                raise OSError(f"no {prefix}-rank{r}.npy")
        except (OSError, ValueError) as e:
            raise Failed(f"{what}: rank {r} finished but wrote no result: {e}") from None
    return out


def load_params(prefix: str, rank: int) -> np.ndarray:
    return np.load(f"{prefix}-rank{rank}.npy", allow_pickle=False)


def side_of(rank: int) -> str:
    """--link: the emulated machine of server/worker/DDP rank ``rank`` (A: even, B: odd;
    W=2, S=2: server 0 and worker 0 with the scheduler on A, server 1 and worker 1 on B)."""
    return "AB"[rank % 2]


def run_ours(cfg: dict, work: str, tag: str, overlap: bool, update_on_kvstore: bool,
             corrupt: bool, timeout: float, link=None) -> list[dict]:
    from tracker import env as tracker_env
    from tracker.launcher import JobSpec, launch
    prefix = os.path.join(work, tag)
    _clean(prefix, cfg["workers"])
    argv = _worker_argv(cfg, "ours", prefix, overlap=overlap, update_on_kvstore=update_on_kvstore,
                        corrupt=corrupt)
    extra = {"KVSTORE_LOG_LEVEL": "WARNING", "KVSTORE_TIMEOUT": str(int(timeout)), **cfg["env"]}
    if link is not None:
        return _run_ours_link(cfg, prefix, tag, argv, extra, timeout, link)
    spec = JobSpec(num_workers=cfg["workers"], num_servers=cfg["servers"], command=tuple(argv),
                   env=extra, settings=tracker_env.read({**os.environ, **extra}))
    log_path = f"{prefix}.log"
    with open(log_path, "w") as log:
        outcome = launch(spec, out=log)
    if outcome.returncode != 0:
        raise Failed(f"{tag}: {outcome.root_cause}\n{outcome.table()}\n{tail(log_path)}")
    return _collect(prefix, cfg["workers"], tag)


def _run_ours_link(cfg: dict, prefix: str, tag: str, argv: list[str], extra: dict,
                   timeout: float, link) -> list[dict]:
    """Ours across the emulated link, each process started as benchmarks/link.py starts
    them (``ip netns exec NS ...``, an argument list, the launcher's environment from
    tracker/env.py ``for_process``, the job secret in the environment only): the
    scheduler on A, server r and worker r on side_of(r), KVSTORE_TRANSPORT=tcp."""
    from benchmarks import link as netlink
    from tracker import env as tracker_env
    from tracker.security import new_secret
    port = random.randint(20000, 60000)   # a fresh namespace: nothing else listens there
    shared = {"KVSTORE_SECRET": new_secret(), "KVSTORE_TRANSPORT": "tcp", "KVSTORE_SECURE": "0",
              **extra}
    w, s = cfg["workers"], cfg["servers"]

    def env(role, rank, side):
        return netlink._child_env(tracker_env.for_process(
            role=role, rank=rank, scheduler_host=link.addr["A"], scheduler_port=port,
            num_workers=w, num_servers=s, node_host=link.addr[side], extra=shared))
    procs = [("scheduler", link.exec_argv("A", [sys.executable, "-m", "tracker.scheduler"]),
              env("scheduler", None, "A"))]
    procs += [(f"server {r}", link.exec_argv(side_of(r), [sys.executable, "-m", "kvstore.server"]),
               env("server", r, side_of(r))) for r in range(s)]
    procs += [(f"worker {r}", link.exec_argv(side_of(r), argv), env("worker", r, side_of(r)))
              for r in range(w)]
    try:
        run_group(procs, f"{prefix}.log", timeout)
    except GroupFailed as e:
        raise Failed(f"{tag}: {e}") from None
    got = _collect(prefix, w, tag)
    kinds, urls = got[0].get("transports"), got[0].get("server_urls") or []
    if not kinds or set(kinds) != {"tcp"}:
        raise Failed(f"{tag}: the client used {kinds}, not tcp")
    want = [f"tcp://{link.addr[side_of(r)]}:" for r in range(s)]
    if len(urls) != s or not all(u.startswith(x) for u, x in zip(urls, want)):
        raise Failed(f"{tag}: servers at {urls}; expected {want}")
    return got


def run_plain(cfg: dict, work: str, tag: str, role: str, ranks: int, timeout: float,
              reference_prefix: str | None = None, link=None) -> list[dict]:
    from benchmarks import link as netlink
    prefix = os.path.join(work, tag)
    _clean(prefix, ranks)
    argv = _worker_argv(cfg, role, prefix)
    if reference_prefix:
        _clean(reference_prefix, 1)
        _clean(f"{reference_prefix}-kvsgd", 1)
        argv += ["--reference-prefix", reference_prefix]
    if role == "ddp" and link is not None:
        # as benchmarks/link.py runs gloo: the rendezvous on A's address, each rank's
        # gloo on the veth of its own "machine"
        init = f"tcp://{link.addr['A']}:{random.randint(20000, 60000)}"
        procs = [(f"ddp rank {r}", link.exec_argv(side_of(r), argv),
                  netlink._child_env({"RANK": str(r), "WORLD_SIZE": str(ranks),
                                      "BENCH_INIT_METHOD": init, "MASTER_ADDR": link.addr["A"],
                                      "GLOO_SOCKET_IFNAME": link.dev[side_of(r)], **cfg["env"]}))
                 for r in range(ranks)]
    elif role == "ddp":
        init = f"tcp://127.0.0.1:{free_port()}"
        procs = [(f"ddp rank {r}", argv, {"RANK": str(r), "WORLD_SIZE": str(ranks),
                                          "BENCH_INIT_METHOD": init, **cfg["env"]})
                 for r in range(ranks)]
    elif link is not None:   # the floor (and the reference): one process on A
        procs = [(role, link.exec_argv("A", argv), netlink._child_env(dict(cfg["env"])))]
    else:
        procs = [(role, argv, dict(cfg["env"]))]
    try:
        run_group(procs, f"{prefix}.log", timeout)
    except GroupFailed as e:
        raise Failed(f"{tag}: {e}") from None
    return _collect(prefix, ranks, tag)


def check_all(done: list[tuple[str, int, str]], ref_prefix: str, workers: int, per_slice: bool,
              rtol: float, atol: float) -> list[dict]:
    """Compare every rank of every launch in ``done`` (contender, launch, file prefix)
    with its reference and each of ours with DDP of the same round. ``checked``: a
    mismatch fails the run; the other comparisons are reported only.

    - DDP and ours with workers updating (torch SGD): against the torch-SGD reference,
      and ours against DDP; all checked.
    - ours with servers updating: against the reference with kvstore's SGD (checked).
      Its distance from the torch-SGD reference and from DDP is reported, not checked:
      kvstore's SGD (MXNet's form, ``mom = m*mom - lr*(g + wd*w); w += mom``) equals
      torch's for a constant lr but rounds differently, and a few dozen steps of a
      network with BatchNorm, max pooling and dropout amplify rounding far beyond any
      useful tolerance.
    - the floor: against the torch-SGD reference only where one pass on W*b is what the
      reference computes (no BatchNorm, no dropout)."""
    checks = []
    refs = {}
    for which, path in (("reference", ref_prefix), ("reference-kvsgd", f"{ref_prefix}-kvsgd")):
        try:
            refs[which] = load_params(path, 0)
        except (OSError, ValueError) as e:
            return [{"contender": name, "launch": launch, "rank": 0, "against": which,
                     "checked": True, "ok": False, "why": f"no {which}: {e}"}
                    for name, launch, _ in done]
    ddp = {launch: prefix for name, launch, prefix in done if name == "ddp"}
    for name, launch, prefix in done:
        kind, _, servers_update, _ = CONTENDERS[name]
        if kind == "floor" and per_slice:
            continue
        for rank in range(1 if kind == "floor" else workers):
            params = load_params(prefix, rank)
            against = [("reference", refs["reference"], not servers_update)]
            if servers_update:
                against.append(("reference-kvsgd", refs["reference-kvsgd"], True))
            if kind == "ours" and launch in ddp:
                against.append(("ddp", load_params(ddp[launch], rank), not servers_update))
            for which, want, checked in against:
                checks.append({"contender": name, "launch": launch, "rank": rank, "against": which,
                               "checked": checked, **compare(params, want, rtol, atol)})
    return checks


def _on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")   # unwinds through the link's clean-up


def _link_ready(link, args, say) -> dict:
    """--link: the rate limit on both veth ends, then benchmarks/link.py's raw TCP
    check (a bulk transfer both ways at once). A failed check is reported, not fatal."""
    from benchmarks import link as netlink
    out = {"qdisc": link.set_rate(args.link)}
    bps = netlink.parse_rate(args.link)
    nbytes = max(4 << 20, int(bps / 8 * args.link_check_seconds))
    try:
        out["raw"] = raw = netlink.measure_raw(link, nbytes, timeout=60 + 10 * args.link_check_seconds)
        say(f"link: {link.ns['A']} ({link.addr['A']}) <-> {link.ns['B']} ({link.addr['B']}), "
            f"tbf {args.link}; raw TCP both ways at once: A->B {raw['a_to_b_gbit']:.3f}, "
            f"B->A {raw['b_to_a_gbit']:.3f} Gbit/s")
    except netlink.Failed as e:
        out["raw_error"] = str(e)
        say(f"link: raw TCP check failed (the prediction uses the nominal rate only): {e}")
    return out


# the first bucket DDP fills is capped at 1 MiB (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES),
# the others at bucket_cap_mb = 25 MiB
DDP_FIRST_BUCKET = 1 << 20
DDP_BUCKET = 25 << 20


def last_bucket_bytes(sizes: list[int]) -> dict:
    """Bytes in the last gradient bucket that backward completes (parameters become
    ready roughly in reverse order): the Trainer's (flushed at >= 4 MiB from hooks, the
    rest pushed in step()) and DDP's (1 MiB first bucket, then 25 MiB)."""
    from kvstore.torch import DEFAULT_BUCKET_BYTES
    bucket, last = 0, 0
    for n in reversed(sizes):
        bucket += n
        if bucket >= DEFAULT_BUCKET_BYTES:
            last, bucket = bucket, 0
    trainer = bucket or last
    try:
        import torch.distributed as dist
        first = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", DDP_FIRST_BUCKET)
    except ImportError:
        first = DDP_FIRST_BUCKET
    buckets, cur, cap = [], 0, first
    for n in reversed(sizes):   # as torch's compute_bucket_assignment_by_size: add, then cut
        cur += n
        if cur >= cap:
            buckets.append(cur)
            cur, cap = 0, DDP_BUCKET
    if cur or not buckets:
        buckets.append(cur)
    return {"trainer": trainer, "ddp": buckets[-1], "ddp_buckets": buckets}


# docs/performance.md section 6 calibration (this machine, tcp): CPU s per byte of a
# worker's exchange and of a server's share, the pipeline piece, one small round trip
K_W, K_S, PIECE, LATENCY = 0.79e-9, 0.84e-9, 8 << 20, 0.6e-3


def predict(data: dict) -> dict:
    """--link: the step times docs/performance.md section 6 predicts, from this run's
    own compute time and the link's rate, next to the measured medians.

    T_c = forward + backward of ours without overlap (rank 0's median: both workers
    computing at once, nothing on the wire); T_wire = 2*(N-1)/N * M/B = M/B at N = 2
    machines; T_cpu = max(M*k_w, M*k_s/s) + p*(k_w + k_s); T_x = max(T_wire, T_cpu) + 2L.
    No overlap: T_c + T_x. Overlap (section 6): max(T_c, T_x) + the last bucket's
    exchange. This Trainer's overlap (pushes from backward hooks, every pull in step()):
    per direction half of T_wire is pushes and half replies, so only the pushes can hide
    under backward: T_fwd + max(T_bwd, T_x/2) + T_x/2."""
    cfg, rows, summ = data["config"], data["rows"], data["summary"]
    m = cfg["num_params"] * 4
    info = data.get("link") or {}
    bps = {"nominal": info["qdisc"]["bits_per_s"] / 8}
    raw = info.get("raw") or {}
    if raw.get("a_to_b_gbit") and raw.get("b_to_a_gbit"):
        bps["raw"] = min(raw["a_to_b_gbit"], raw["b_to_a_gbit"]) * 1e9 / 8

    def med(names, part):
        xs = [t for r in rows if r["contender"] in names and r.get("parts") for t in r["parts"][part]]
        return statistics.median(xs) if xs else None
    noov = ("ours-nooverlap-server", "ours-nooverlap-worker")
    t_fwd, t_bwd = med(noov, "forward"), med(noov, "backward")
    if t_fwd is None and "floor" in summ:   # no run without overlap: the floor's share
        t_fwd, t_bwd = summ["floor"]["median"] / cfg["workers"] / 3, summ["floor"]["median"] / cfg["workers"] * 2 / 3
    if t_fwd is None:
        return {}
    t_c = t_fwd + t_bwd
    s_per = max(1, -(-cfg["servers"] // 2))     # servers per machine
    piece = min(PIECE, m / cfg["servers"])     # a piece is at most one server's share
    t_cpu = max(m * K_W, m * K_S / s_per) + piece * (K_W + K_S)
    last = data["last_bucket_bytes"]
    out = {"M_bytes": m, "T_fwd": t_fwd, "T_bwd": t_bwd, "T_c": t_c, "T_cpu": t_cpu,
           "T_x_measured_nooverlap": med(noov, "step"), "rates": {}}
    for which, b in bps.items():
        t_x = max(m / b, t_cpu) + 2 * LATENCY
        pred = {"T_wire": m / b, "T_x": t_x,
                "nooverlap": t_c + t_x,
                "overlap_docs": max(t_c, t_x) + last["trainer"] / b + 2 * LATENCY,
                "overlap_push_only": t_fwd + max(t_bwd, t_x / 2) + t_x / 2,
                "ddp_docs": max(t_c, t_x) + last["ddp"] / b + 2 * LATENCY}
        out["rates"][which] = pred
    predicted = {"ours-overlap-server": ("overlap_docs", "overlap_push_only"),
                 "ours-overlap-worker": ("overlap_docs", "overlap_push_only"),
                 "ours-nooverlap-server": ("nooverlap", None),
                 "ours-nooverlap-worker": ("nooverlap", None),
                 "ddp": ("ddp_docs", None)}
    out["by_contender"] = {}
    for name, (docs, refined) in predicted.items():
        if name not in summ:
            continue
        e = {"measured": summ[name]["median"]}
        for which, pred in out["rates"].items():
            e[f"docs_{which}"] = pred[docs]
            if refined:
                e[f"push_only_{which}"] = pred[refined]
        out["by_contender"][name] = e
    return out


def _phases(wall0: float, wall1: float, stamps: dict) -> dict:
    """Where a launch's wall time went (rank 0's view): start-up (process start,
    imports, model), rendezvous (store or process group, Trainer/DDP construction),
    the steps, and closing down."""
    if not {"start", "imported", "ready", "trained", "closed"} <= set(stamps):
        return {}
    return {"spawn": stamps["start"] - wall0, "startup": stamps["imported"] - stamps["start"],
            "rendezvous": stamps["ready"] - stamps["imported"],
            "steps": stamps["trained"] - stamps["ready"], "close": stamps["closed"] - stamps["trained"],
            "after": wall1 - stamps["closed"], "total": wall1 - wall0}


def summarise(rows: list[dict], ddp_name: str = "ddp", workers: int = 2) -> dict:
    out = {}
    for name in CONTENDERS:
        mine = [r for r in rows if r["contender"] == name]
        if not mine:
            continue
        samples = [t for r in mine for t in r["times"]]
        s = common.stats(samples)
        out[name] = {"shown": CONTENDERS[name][3], **s,
                     "launch_medians": [statistics.median(r["times"]) for r in mine],
                     "loadavg_before": [r["loadavg_before"] for r in mine],
                     "cpu_s_per_step": statistics.fmean(r["cpu_s"] for r in mine)}
        parts = [r["parts"] for r in mine if r.get("parts")]
        if parts:   # rank 0's forward (with zero_grad), backward, step() medians
            out[name]["parts_median"] = {k: statistics.median(t for p in parts for t in p[k])
                                         for k in ("forward", "backward", "step")}
    base = out.get(ddp_name, {}).get("median")
    for name, s in out.items():
        s["vs_ddp"] = s["median"] / base if base and s.get("median") else None
    if "floor" in out:
        out["floor"]["per_worker_share"] = out["floor"]["median"] / workers
    return out


def markdown(data: dict) -> str:
    cfg, summ, m = data["config"], data["summary"], data["machine"]
    ms = 1e3
    lines = ["# One training step: ours vs torch DDP (gloo) vs no communication", "",
             f"{cfg['network']}{'-' + str(cfg['num_layers']) if cfg['num_layers'] else ''} on "
             f"3x{cfg['image_size']}x{cfg['image_size']} synthetic inputs, {cfg['num_params']:,} "
             f"parameters ({cfg['num_params'] * 4 / 1e6:.1f} MB of fp32 gradients), b={cfg['batch_size']} "
             f"per worker, W={cfg['workers']} workers, S={cfg['servers']} servers (ours), SGD lr="
             f"{cfg['lr']} momentum={cfg['momentum']} wd={cfg['wd']}; every process "
             f"`torch.set_num_threads(1)`. {data['launches']} interleaved launches x "
             f"{cfg['iters']} timed steps (+{cfg['warmup']} warm-up) per contender; rank 0's step "
             "times (zero_grad + forward + backward + exchange + update; an untimed barrier "
             "before each step).", "",
             f"Run {data['started']} - {data['finished']}: `{data['command']}`", "",
             f"Machine: {m.get('cpu_model', m.get('processor'))}, {m['cpus']} CPUs, "
             f"{m.get('mem_total', '?')}, {m['platform']}; {', '.join(f'{k} {v}' for k, v in data['versions'].items())}.",
             "",
             "**Caveat: this is a shared 2-core machine; other jobs may have run during this "
             "run.** The 1-minute load average before each launch is in the last column "
             "(a load above ~1 before a launch means someone else was using a core).", "",
             "| contender | median ms | p10-p90 ms | per-launch medians ms | vs DDP | worker CPU ms/step | steps | load avg before each launch |",
             "|---|---:|---:|---|---:|---:|---:|---|"]
    for name, s in summ.items():
        if not s.get("n"):
            continue
        ratio = f"{s['vs_ddp']:.2f}x" if s.get("vs_ddp") else "-"
        lines.append(
            f"| {s['shown']} | {s['median'] * ms:.1f} | {s['p10'] * ms:.1f}-{s['p90'] * ms:.1f} | "
            f"{', '.join(f'{x * ms:.1f}' for x in s['launch_medians'])} | {ratio} | "
            f"{s['cpu_s_per_step'] * ms:.0f} | {s['n']} | "
            f"{', '.join(f'{x:.2f}' for x in s['loadavg_before'])} |")
    kinds = sorted({t for r in data["rows"] for t in (r.get("transports") or [])})
    if kinds:
        lines += ["", f"Ours' data plane, as rank 0's client reports it for every server: "
                      f"{', '.join(kinds)} ("
                      + ("KVSTORE_TRANSPORT=tcp across the emulated link)." if data.get("link")
                         else "the default on one host).")]
    if "floor" in summ:
        lines += ["", f"Perfect scaling would be the floor's time / W = "
                      f"{summ['floor']['per_worker_share'] * ms:.1f} ms per step (each worker "
                      "computing b on its own free core, with a free exchange)."]
    if data.get("link"):
        lines += _link_markdown(data)
    chk = data["correctness"]
    lines += ["", "## Correctness", "",
              f"After {cfg['warmup'] + cfg['iters']} steps (warm-up + timed), every worker's "
              "parameters of every launch against one process trained on the concatenated "
              f"batches ({chk['reference']}), `numpy.allclose(rtol={cfg['rtol']}, "
              f"atol={cfg['atol']})`; ours also against DDP of the same round. Largest absolute "
              "difference over all launches and ranks; in parentheses: reported, not checked "
              "(servers updating run kvstore's SGD, MXNet's form of the same update, which rounds "
              "differently from torch's; they are checked against the same single-process loop "
              "with kvstore's SGD on a `local` store, and their distance from torch's SGD shows "
              "how far a few dozen steps amplify rounding).", "",
              "| contender | vs reference, torch SGD | vs reference, kvstore SGD | vs DDP | checks | passed |",
              "|---|---:|---:|---:|---:|---|"]

    def cell(c, which):
        if which not in c["max_abs"]:
            return "-"
        text = f"{c['max_abs'][which]:.2e}"
        return text if c["checked"].get(which) else f"({text})"
    for name, c in chk["by_contender"].items():
        lines.append(f"| {CONTENDERS[name][3]} | {cell(c, 'reference')} | "
                     f"{cell(c, 'reference-kvsgd')} | {cell(c, 'ddp')} | {c['checks']} | "
                     f"{'yes' if c['ok'] else '**NO**'} |")
    lines += ["", f"Overall: {'passed' if chk['ok'] else '**FAILED**'}."]
    if data["failures"]:
        lines += ["", "## Failures", ""] + [f"- {f.splitlines()[0]}" for f in data["failures"]]
    return "\n".join(lines) + "\n"


def _link_markdown(data: dict) -> list[str]:
    """--link: the link, where each step's time went, and measured vs predicted."""
    info, summ, ms = data["link"], data["summary"], 1e3
    raw = info.get("raw") or {}
    q = info.get("qdisc") or {}
    lines = ["", f"## Over the emulated link ({info['rate']})", "",
             f"Two network namespaces joined by a veth pair, `tc {q.get('tc', '?')}` on both ends "
             f"(as `python -m benchmarks.link`): A ({info['addresses']['A']}) runs "
             f"{info['sides']['A']}; B ({info['addresses']['B']}) runs {info['sides']['B']}. "
             'Both "machines" share this host\'s cores. Raw TCP bulk transfer, both directions '
             'at once: '
             + (f"A->B **{raw['a_to_b_gbit']:.3f}**, B->A **{raw['b_to_a_gbit']:.3f}** Gbit/s."
                if raw else f"not measured ({info.get('raw_error', '?')})."),
             "",
             "Where rank 0's step went (medians of each part; forward includes zero_grad; "
             "ours with overlap pushes from backward hooks, so its backward includes handing "
             "buckets to the store and its step() is the rest of the push and every pull; DDP "
             "all-reduces its buckets inside backward, so its step() is the optimizer only), "
             "and the bytes each veth end sent per launch (mean):", "",
             "| contender | step ms | forward ms | backward ms | step() ms | A->B MB/launch | B->A MB/launch |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, s in summ.items():
        pm = s.get("parts_median")
        if not pm:
            continue
        got = [r.get("link_bytes") or {} for r in data["rows"] if r["contender"] == name]

        def mb(k):
            xs = [g[k] for g in got if g.get(k) is not None]
            return f"{statistics.fmean(xs) / 1e6:.1f}" if xs else "-"
        lines.append(f"| {s['shown']} | {s['median'] * ms:.1f} | {pm['forward'] * ms:.1f} | "
                     f"{pm['backward'] * ms:.1f} | {pm['step'] * ms:.1f} | {mb('a_to_b')} | "
                     f"{mb('b_to_a')} |")
    pr = data.get("prediction") or {}
    if not pr.get("rates"):
        return lines
    last = data["last_bucket_bytes"]
    lines += ["", "### Measured vs predicted (docs/performance.md section 6)", "",
              f"M = {pr['M_bytes'] / 1e6:.1f} MB; T_c = forward + backward of ours without overlap "
              f"(rank 0's median, both workers computing at once) = {pr['T_fwd'] * ms:.1f} + "
              f"{pr['T_bwd'] * ms:.1f} = **{pr['T_c'] * ms:.1f} ms**; T_cpu = max(M k_w, M k_s/s) "
              f"+ p (k_w + k_s) = {pr['T_cpu'] * ms:.1f} ms (section 6's k_w, k_s); T_x = "
              "max(T_wire, T_cpu) + 2L with T_wire = 2(N-1)/N M/B = M/B (N = 2), L = 0.6 ms; "
              "measured exchange of ours without overlap (its step()): "
              + (f"**{pr['T_x_measured_nooverlap'] * ms:.1f} ms**. "
                 if pr.get("T_x_measured_nooverlap") else "- . ")
              + f"Last bucket backward completes: the Trainer's {last['trainer'] / 1e6:.2f} MB, "
              f"DDP's {last['ddp'] / 1e6:.2f} MB (buckets "
              f"{', '.join(f'{b / 1e6:.1f}' for b in last['ddp_buckets'])} MB).", ""]
    for which, p in pr["rates"].items():
        lines.append(f"- B = {which} rate: T_wire = {p['T_wire'] * ms:.1f} ms, T_x = "
                     f"{p['T_x'] * ms:.1f} ms.")
    lines += ["",
              "Predicted step: no overlap T_c + T_x; overlap, as section 6 states it, max(T_c, T_x) "
              "+ the last bucket's exchange (for DDP: its last bucket); and 'push-only overlap', "
              "what this Trainer can do (the pushes leave from backward hooks, every pull waits "
              "for step(); at N = 2 half of each direction's bytes are pushes, half replies): "
              "T_fwd + max(T_bwd, T_x/2) + T_x/2.", "",
              "| contender | measured ms | predicted, section 6 (nominal B) ms | measured/pred. "
              "| predicted, section 6 (raw TCP B) ms | measured/pred. | push-only overlap (raw B) ms "
              "| measured/pred. |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, e in pr["by_contender"].items():
        cells = []
        for key in ("docs_nominal", "docs_raw", "push_only_raw"):
            if e.get(key):
                cells += [f"{e[key] * ms:.1f}", f"{e['measured'] / e[key]:.2f}"]
            else:
                cells += ["-", "-"]
        lines.append(f"| {CONTENDERS[name][3]} | {e['measured'] * ms:.1f} | " + " | ".join(cells) + " |")
    for mode in ("server", "worker"):
        a, b = summ.get(f"ours-overlap-{mode}"), summ.get(f"ours-nooverlap-{mode}")
        if a and b:
            gain = 1 - a["median"] / b["median"]
            lines.append("")
            lines.append(f"Overlap, {'servers' if mode == 'server' else 'workers'} updating: "
                         f"{a['median'] * ms:.1f} vs {b['median'] * ms:.1f} ms without, "
                         f"{abs(gain) * 100:.0f} % {'faster' if gain >= 0 else 'slower'}.")
    return lines


def _ours_version() -> str:
    try:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "kvstore", "tracker"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", ""
    return f"{commit or '?'}{' + uncommitted changes in kvstore/ or tracker/' if dirty else ''}"


def _csv(value: str) -> tuple[str, ...]:
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [v for v in items if v not in CONTENDERS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(bad)}; choose from {', '.join(CONTENDERS)}")
    return items


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.trainer",
        description="Median time of one training step (forward + backward + gradient exchange + "
                    "update), W workers: kvstore.torch.Trainer (4 variants) vs torch DDP over gloo "
                    "vs one process on W*b; checks that all of them train to the same weights.")
    p.add_argument("-w", "--workers", type=int, default=2, help="W worker processes (default 2)")
    p.add_argument("-s", "--servers", type=int, default=2, help="S servers of ours (default 2)")
    p.add_argument("--network", default="vgg", help="examples/models.py network (default vgg)")
    p.add_argument("--num-layers", type=int, default=None,
                   help="depth (default: 11 for vgg, 20 for resnet, none otherwise)")
    p.add_argument("--batch-size", type=int, default=16, help="b per worker (default 16)")
    p.add_argument("--image-size", type=int, default=32, help="inputs are 3xNxN (default 32)")
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iters", type=int, default=20, help="timed steps per launch (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before them (default 5)")
    p.add_argument("--launches", type=int, default=3, help="launches of every contender (default 3)")
    p.add_argument("--contenders", type=_csv, default=tuple(CONTENDERS),
                   help=f"comma-separated, default all: {','.join(CONTENDERS)}")
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--atol", type=float, default=1e-5)
    p.add_argument("--timeout", type=float, default=300, help="seconds one launch may take")
    p.add_argument("--env", dest="env_pairs", action="append", default=[], metavar="NAME=VALUE",
                   help="extra environment variable for every process (repeatable)")
    p.add_argument("--out-dir", default=DEFAULT_OUT)
    p.add_argument("--work-dir", default=None,
                   help="logs and parameter files (default: a new temporary directory); removed "
                        "after a passing run, kept after a failed one")
    p.add_argument("--name", default=None,
                   help="base name of the result files (default: trainer; with --link RATE: "
                        "trainer-link-RATE)")
    p.add_argument("--link", default=None, metavar="RATE",
                   help="run every distributed contender split over two emulated machines as "
                        "benchmarks/link.py does (network namespaces A and B joined by a veth "
                        "pair rate-limited to RATE by tc tbf, e.g. 1gbit; needs root): the "
                        "scheduler, server 0 and worker 0 / DDP rank 0 on A, server 1 and worker "
                        "1 / DDP rank 1 on B, KVSTORE_TRANSPORT=tcp, gloo over the veth; the "
                        "floor on A (default: off, everything on this host's loopback)")
    p.add_argument("--link-check-seconds", type=float, default=1.0,
                   help="--link: duration of the raw TCP check per direction (default 1.0)")
    p.add_argument("--corrupt-for-test", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for flag in ("workers", "servers", "batch_size", "image_size", "iters", "launches"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        p.error("--warmup must be at least 0")
    if args.num_layers is None:
        args.num_layers = {"vgg": 11, "resnet": 20}.get(args.network)
    sys.path.insert(0, REPO)
    from examples.models import get_network
    try:
        get_network(args.network, num_classes=args.num_classes, num_layers=args.num_layers,
                    image_shape=(3, args.image_size, args.image_size))
    except ValueError as e:
        p.error(str(e))
    env = {}
    for pair in args.env_pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            p.error(f"--env {pair!r} is not NAME=VALUE")
        env[key] = value
    args.env = env
    if args.link is not None:
        from benchmarks import link as netlink
        args.link = args.link.strip().lower()
        try:
            netlink.parse_rate(args.link)
        except ValueError as e:
            p.error(f"--link: {e}")
        if args.link_check_seconds <= 0:
            p.error("--link-check-seconds must be > 0")
    if args.name is None:
        args.name = "trainer" if args.link is None else f"trainer-link-{args.link}"
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:
        return worker_main(argv[1:])
    args = parse_args(argv)
    import torch
    cfg = {k: getattr(args, k) for k in ("workers", "servers", "network", "num_layers", "batch_size",
                                         "image_size", "num_classes", "lr", "momentum", "wd", "seed",
                                         "iters", "warmup", "rtol", "atol", "env")}
    model, _ = build(cfg)
    cfg["num_params"] = sum(p.numel() for p in model.parameters())
    last_buckets = last_bucket_bytes([p.numel() * p.element_size() for p in model.parameters()])
    per_slice = per_slice_needed(model)
    del model
    os.makedirs(args.out_dir, exist_ok=True)
    if args.work_dir:
        os.makedirs(args.work_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="kvbench-trainer-", dir=args.work_dir)
    info = {"command": " ".join(["python -m benchmarks.trainer", *argv]), "config": cfg,
            "launches": args.launches, "contenders": list(args.contenders),
            "machine": common.machine(),
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "numpy": np.__version__, "kvstore": _ours_version()},
            "work_dir": work, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "last_bucket_bytes": last_buckets}
    m = info["machine"]
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    say(f"machine: {m.get('cpu_model', m.get('processor'))}, {m['cpus']} cpus; "
        f"{args.network}-{args.num_layers} b={args.batch_size} W={args.workers} S={args.servers}, "
        f"{cfg['num_params']:,} parameters; {args.launches} launches x {args.iters} steps "
        f"(+{args.warmup} warm-up); work dir {work}")
    failures: list[str] = []
    rows: list[dict] = []
    checks: list[dict] = []
    link = None
    restore_term = None
    if args.link:
        from benchmarks import link as netlink
        link = netlink.Link()
        info["link"] = {"rate": args.link, "namespaces": dict(link.ns), "addresses": dict(link.addr),
                        "devices": dict(link.dev), "sides": {
                            "A": "scheduler, even ranks (server 0, worker 0, DDP rank 0), floor",
                            "B": "odd ranks (server 1, worker 1, DDP rank 1)"}}
        restore_term = signal.signal(signal.SIGTERM, _on_sigterm)   # Ctrl-C or kill: clean up
    try:
        if link is not None:
            try:
                link.up()
                info["link"].update(_link_ready(link, args, say))
            except netlink.SetupFailed as e:
                print(f"skipped: the emulated network cannot be set up here (needs root and "
                      f"network namespaces): {e}", flush=True)
                shutil.rmtree(work, ignore_errors=True)
                return 0
        done: list[tuple[str, int, str]] = []     # (contender, launch, file prefix) of every launch
        ref_prefix = os.path.join(work, "reference")
        active = list(args.contenders)
        if "floor" not in active:   # else the first floor launch trains the reference afterwards
            t0 = time.monotonic()
            try:
                run_plain(cfg, work, "reference", "reference", 1, args.timeout, link=link)
            except Failed as e:
                failures.append(f"reference: {e}")
                active = []
            say(f"  reference: {time.monotonic() - t0:.1f}s")
        corrupt_target = next((c for c in active if c.startswith("ours")), None)
        for launch_no in range(args.launches):
            k = launch_no % max(1, len(active))
            for name in active[k:] + active[:k]:
                kind, overlap, ukv, _ = CONTENDERS[name]
                load = os.getloadavg()
                tag = f"{name}-{launch_no}"
                counted = link.counters() if link is not None else None
                t1, wall0 = time.monotonic(), time.time()
                try:
                    if kind == "ours":
                        got = run_ours(cfg, work, tag, overlap, ukv,
                                       args.corrupt_for_test and name == corrupt_target, args.timeout,
                                       link=link)
                    elif kind == "ddp":
                        got = run_plain(cfg, work, tag, "ddp", args.workers, args.timeout, link=link)
                    else:
                        got = run_plain(cfg, work, tag, "floor", 1, args.timeout,
                                        reference_prefix=None if os.path.exists(f"{ref_prefix}-rank0.npy")
                                        else ref_prefix, link=link)
                except Failed as e:
                    failures.append(f"{name} (launch {launch_no + 1}): {e}")
                    say(f"  launch {launch_no + 1}/{args.launches} {name}: FAILED: {e}")
                    continue
                res0 = got[0]
                done.append((name, launch_no, os.path.join(work, tag)))
                rows.append({"contender": name, "launch": launch_no, "times": res0["times"],
                             "cpu_s": res0["cpu_s"], "minor_faults": res0["minor_faults"],
                             "loadavg_before": load[0], "loadavg_before_1_5_15": list(load),
                             "loadavg_after_1_5_15": list(os.getloadavg()),
                             "rank_times": [r["times"] for r in got],
                             "losses": [r["losses"] for r in got],
                             "transports": res0.get("transports"),
                             "server_urls": res0.get("server_urls"),
                             "parts": res0.get("parts"),
                             "phases_s": _phases(wall0, time.time(), res0.get("stamps", {}))})
                if counted is not None:   # bytes each veth end sent during the launch
                    after = link.counters()
                    rows[-1]["link_bytes"] = {k: (after[k] - counted[k])
                                              if None not in (after[k], counted[k]) else None
                                              for k in after}
                ph = rows[-1]["phases_s"]
                say(f"  launch {launch_no + 1}/{args.launches} {name}: median "
                    f"{statistics.median(res0['times']) * 1e3:.1f} ms in {time.monotonic() - t1:.1f}s "
                    f"(start-up {ph.get('startup', 0):.1f}s, steps {ph.get('steps', 0):.1f}s, "
                    f"load before {load[0]:.2f})")
            # check this round now and drop its parameter files (VGG-11: 38 MB per rank)
            this_round = [d for d in done if d[1] == launch_no]
            got = check_all(this_round, ref_prefix, args.workers, per_slice, args.rtol, args.atol)
            checks += got
            for _, _, prefix in this_round if all(c["ok"] or not c["checked"] for c in got) else ():
                for r in range(args.workers):
                    if os.path.exists(f"{prefix}-rank{r}.npy"):
                        os.remove(f"{prefix}-rank{r}.npy")
    finally:
        if link is not None:
            errors = link.down()
            failures += [f"cleanup: {e}" for e in errors]
            for e in errors:
                say(f"cleanup: {e}")
            signal.signal(signal.SIGTERM, restore_term)
    if not checks and not failures:
        failures.append("nothing was checked")
    by = {}
    for c in checks:
        b = by.setdefault(c["contender"], {"checks": 0, "ok": True, "max_abs": {}, "checked": {}})
        b["checks"] += c["checked"]
        if c["checked"]:
            b["ok"] = b["ok"] and c["ok"]
        b["checked"][c["against"]] = c["checked"]
        if c.get("max_abs") is not None:
            b["max_abs"][c["against"]] = max(b["max_abs"].get(c["against"], 0.0), c["max_abs"])
        if c["checked"] and not c["ok"]:
            failures.append(f"WRONG RESULT: {c['contender']} launch {c['launch'] + 1} rank "
                            f"{c['rank']} differs from {c['against']}: {c}")
    correctness = {"ok": bool(checks) and not failures,
                   "reference": ("W per-worker slices of the concatenated batch, losses averaged "
                                 "(BatchNorm/dropout per worker)" if per_slice else
                                 "one forward pass on the concatenated batch of W*b"),
                   "rtol": args.rtol, "atol": args.atol, "by_contender": by, "checks": checks}
    data = {**info, "failures": failures, "correctness": correctness,
            "summary": summarise(rows, workers=args.workers), "rows": rows,
            "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    if link is not None:
        data["prediction"] = predict(data)
    table = markdown(data)
    paths = {"json": os.path.join(args.out_dir, f"{args.name}.json"),
             "md": os.path.join(args.out_dir, f"{args.name}.md")}
    common.write_json(paths["json"], data)
    with open(paths["md"], "w") as f:
        f.write(table)
    print(table)
    for kind, path in paths.items():
        print(f"{kind}: {os.path.relpath(path)}")
    if not failures:   # keep the logs of a failed run for a post-mortem
        shutil.rmtree(work, ignore_errors=True)
    if failures:
        say(f"work dir (logs): {work}")
        say("\nFAILED:\n" + "\n".join(f.splitlines()[0] if f.startswith("WRONG") else f
                                      for f in failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
