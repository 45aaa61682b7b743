"""One training step end to end: ours (kvstore.torch.Trainer) against torch DDP over
gloo and against one process with no communication at all.

    python -m benchmarks.trainer                       # VGG-11, b=16 per worker, W=2, S=2, 3 launches
    python -m benchmarks.trainer --network resnet --num-layers 20 --batch-size 32

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
import shutil
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

    def step(i):
        stepper.zero_grad()
        xys = batch["xy"]
        loss = 0
        for (x, y), seed in zip(xys, batch["seeds"]):
            torch.manual_seed(seed)   # dropout masks as rank r draws them
            loss = loss + F.cross_entropy(net(x), y)
        if len(xys) > 1:
            loss = loss / len(xys)
        loss.backward()
        stepper.step()
        batch["loss"] = loss

    def check(i):
        losses.append(float(batch["loss"].detach()))

    if not timed:
        for i in range(cfg["warmup"] + cfg["iters"]):
            prepare(i)
            step(i)
            check(i)
        return {"losses": losses, "per_slice": slices}
    times, per = common.timed_loop(step, prepare, check, cfg["iters"], cfg["warmup"], sync)
    return {"times": times, **per, "losses": losses}


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
        kinds = getattr(getattr(kv, "_client", None), "transports", None)
        result["transports"] = list(kinds) if kinds else None
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


def run_ours(cfg: dict, work: str, tag: str, overlap: bool, update_on_kvstore: bool,
             corrupt: bool, timeout: float) -> list[dict]:
    from tracker import env as tracker_env
    from tracker.launcher import JobSpec, launch
    prefix = os.path.join(work, tag)
    _clean(prefix, cfg["workers"])
    argv = _worker_argv(cfg, "ours", prefix, overlap=overlap, update_on_kvstore=update_on_kvstore,
                        corrupt=corrupt)
    extra = {"KVSTORE_LOG_LEVEL": "WARNING", "KVSTORE_TIMEOUT": str(int(timeout)), **cfg["env"]}
    spec = JobSpec(num_workers=cfg["workers"], num_servers=cfg["servers"], command=tuple(argv),
                   env=extra, settings=tracker_env.read({**os.environ, **extra}))
    log_path = f"{prefix}.log"
    with open(log_path, "w") as log:
        outcome = launch(spec, out=log)
    if outcome.returncode != 0:
        raise Failed(f"{tag}: {outcome.root_cause}\n{outcome.table()}\n{tail(log_path)}")
    return _collect(prefix, cfg["workers"], tag)


def run_plain(cfg: dict, work: str, tag: str, role: str, ranks: int, timeout: float,
              reference_prefix: str | None = None) -> list[dict]:
    prefix = os.path.join(work, tag)
    _clean(prefix, ranks)
    argv = _worker_argv(cfg, role, prefix)
    if reference_prefix:
        _clean(reference_prefix, 1)
        _clean(f"{reference_prefix}-kvsgd", 1)
        argv += ["--reference-prefix", reference_prefix]
    if role == "ddp":
        init = f"tcp://127.0.0.1:{free_port()}"
        procs = [(f"ddp rank {r}", argv, {"RANK": str(r), "WORLD_SIZE": str(ranks),
                                          "BENCH_INIT_METHOD": init, **cfg["env"]})
                 for r in range(ranks)]
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
                      f"{', '.join(kinds)} (the default on one host)."]
    if "floor" in summ:
        lines += ["", f"Perfect scaling would be the floor's time / W = "
                      f"{summ['floor']['per_worker_share'] * ms:.1f} ms per step (each worker "
                      "computing b on its own free core, with a free exchange)."]
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
    p.add_argument("--name", default="trainer", help="base name of the result files")
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
            "work_dir": work, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    m = info["machine"]
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    say(f"machine: {m.get('cpu_model', m.get('processor'))}, {m['cpus']} cpus; "
        f"{args.network}-{args.num_layers} b={args.batch_size} W={args.workers} S={args.servers}, "
        f"{cfg['num_params']:,} parameters; {args.launches} launches x {args.iters} steps "
        f"(+{args.warmup} warm-up); work dir {work}")
    failures: list[str] = []
    rows: list[dict] = []
    checks: list[dict] = []
    done: list[tuple[str, int, str]] = []     # (contender, launch, file prefix) of every launch
    ref_prefix = os.path.join(work, "reference")
    active = list(args.contenders)
    if "floor" not in active:   # else the first floor launch trains the reference afterwards
        t0 = time.monotonic()
        try:
            run_plain(cfg, work, "reference", "reference", 1, args.timeout)
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
            t1, wall0 = time.monotonic(), time.time()
            try:
                if kind == "ours":
                    got = run_ours(cfg, work, tag, overlap, ukv,
                                   args.corrupt_for_test and name == corrupt_target, args.timeout)
                elif kind == "ddp":
                    got = run_plain(cfg, work, tag, "ddp", args.workers, args.timeout)
                else:
                    got = run_plain(cfg, work, tag, "floor", 1, args.timeout,
                                    reference_prefix=None if os.path.exists(f"{ref_prefix}-rank0.npy")
                                    else ref_prefix)
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
                         "phases_s": _phases(wall0, time.time(), res0.get("stamps", {}))})
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
