"""One training step end to end: ours (kvstore.torch.Trainer) against torch DDP over
gloo and against one process with no communication at all.

    python -m benchmarks.trainer                       # VGG-11, b=16 per worker, W=2, S=2, 3 launches
    python -m benchmarks.trainer --network resnet --num-layers 20 --batch-size 32
    python -m benchmarks.trainer --link 1gbit          # two emulated machines (root)
    python -m benchmarks.trainer --link 500mbit --layout dedicated:4x4   # 4 worker + 4 server hosts

``--link RATE`` splits every distributed contender over emulated machines (network
namespaces, each linked to one bridge by a veth pair rate-limited by tc tbf on both
ends, built and removed, even on failure or SIGTERM, by benchmarks/harness/netns.py's
``Cluster``; trainer_run.py's ``Emulated`` places the processes). By default two: A
runs the scheduler, server 0, worker 0 (DDP rank 0) and the floor, B server 1 and
worker 1 (DDP rank 1) (even ranks on A, odd on B). ``--layout`` (benchmarks/harness/layouts.py,
as benchmarks.link) takes W and S from the layout (-w/-s may repeat them; a different
value is an error) and its hosts instead: ``dedicated:WxS``, worker r and DDP rank r on
worker host r (A, B, C, ...), server s on server host S<s> (all of ours is tcp, DDP's
ring runs over the worker hosts); ``colo:W``, server r and worker r on host r. The
scheduler, the floor and the reference run on A; ours uses shared memory to a server
on its own host, tcp across (every worker's transports and server addresses are
checked). A raw TCP bulk transfer between A and B checks the rate first. It also
times each step's parts (forward, backward, step()), counts the bytes every host's
link sent and received per launch, and sets the medians against docs/performance.md
section 6's step-time model with the layout's wire bytes (ours: its busiest link
direction; DDP: its ring's 2M(W-1)/W). Results go to ``trainer-link-RATE.{md,json}``,
with a layout to ``trainer-link-RATE-dedicated-4x4.{md,json}`` (its key, ':' as '-').

A step is ``zero_grad``, forward, backward (with whatever communication the
contender overlaps with it), the rest of the gradient exchange and the optimizer
update, timed on every worker (rank 0's times are reported). Contenders, all on the
same network (examples/models.py ``get_network``), the same seeded initial weights,
the same synthetic data (per rank and step, from a fixed seed: no download) and
the same SGD hyper-parameters (lr, momentum, weight decay), every process with
``torch.set_num_threads(1)``:

  ours-overlap-server     kvstore.torch.Trainer, dist_sync, S servers, started by
                          tracker.launcher.launch (the real launcher) with the threads
                          python -m tracker.local gives (OMP_NUM_THREADS = cores //
                          processes); overlap=True (each gradient bucket is pushed
                          from a backward hook; --bucket-bytes, default sized by the
                          model); update_on_kvstore=True (the servers run torch SGD's
                          twin); rank 0 also reports the servers' CPU per timed step
  ours-overlap-worker     ... update_on_kvstore=False (torch.optim.SGD on every worker)
  ours-nooverlap-server   overlap=False (everything is pushed once backward ends), servers update
  ours-nooverlap-worker   overlap=False, workers update
  ddp                     torch DistributedDataParallel over gloo (25 MB buckets, the
                          default), torch.optim.SGD; W ranks rendezvous at
                          tcp://127.0.0.1:<free port> as benchmarks/harness/contenders/gloo.py
  floor                   one process, no communication, one batch of W*b: the compute
                          floor (floor/W would be perfect scaling on W free cores)

Each launch runs ``--warmup`` untimed steps, then ``--iters`` timed ones; a barrier
(untimed) and the generation of the step's batch precede every step. Launches are
interleaved, the order rotating every round, and the load average is recorded
before each launch. Writes ``<name>.md`` and ``<name>.json`` to --out-dir (default: a
new scratch directory; ``--record``: benchmarks/results/trainer).

Correctness, checked every run (a wrong answer fails the run, exit status 1): after
its warm-up and timed steps, every worker of every launch of ours and DDP writes its
parameters (raw float32 ``.npy``, no pickle), and they must equal, to ``--rtol`` /
``--atol`` (``numpy.allclose``, default 1e-4 / 1e-5), a reference trained once per
run, untimed, by one process on the concatenation of all workers' batches (after the
first floor launch, in the floor's process): DDP and ours with workers updating
against the reference with torch's SGD, and ours also against DDP of the same round.
Ours with servers updating runs torch SGD's twin on the servers (torch's own step, bit
for bit: kvstore.optimizer.torch_twin); those two variants are checked against a second
reference, the same single-process loop with the servers' update
(``kvstore.torch.Trainer`` on a ``local`` store, ``update_on_kvstore=True``); their
distance from torch's SGD and from DDP is reported, not checked. At W = 2 (VGG-11) every checked comparison came out
bit-identical on this machine (difference 0), which the tolerance does not require. With
W > 2 it cannot: W gradients are added in different orders (gloo's ring per chunk, our
servers as pushes arrive, the reference's autograd), so the last bits differ (W = 4: mlp,
25 steps, ~4e-8; lenet on 3x92x92, 10 steps, 3-5e-6: within the tolerance), and BatchNorm
with dropout amplify that beyond it (VGG-11, 4 steps: 1.4e-5 DDP, 2e-4 ours). With W > 2
use a network without them (lenet, mlp); the run warns at the start.

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

The code: this file (the command line and the run: launches, rounds, checks, result
files), benchmarks/trainer/contenders.py (the contenders and how one launch of each is
started, on this host or across the emulated link), benchmarks/trainer/worker.py
(the processes: network, data, training loop, parameter files), trainer_check.py
(the correctness check) and trainer_report.py (summary, --link prediction, markdown).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    __package__ = "benchmarks.trainer"

import numpy as np  # noqa: E402

from benchmarks.harness import common, layouts, netns  # noqa: E402
from benchmarks.harness.output import ResultsDir  # noqa: E402
from benchmarks.trainer.check import check_all, compare, verdict  # noqa: E402
from benchmarks.trainer.report import last_bucket_bytes, markdown, predict, summarise  # noqa: E402
from benchmarks.trainer.contenders import (CONTENDERS, DEFAULT_CONTENDERS, Emulated, Failed, link_ready,  # noqa: E402
                                    row, run_contender, run_plain)
from benchmarks.trainer.worker import build, per_slice_needed, worker_main  # noqa: E402

__all__ = ["CONTENDERS", "compare", "main", "parse_args"]   # (tests use compare from here)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUTPUT = ResultsDir("trainer", "trainer")


def _ours_version() -> str:
    """common.kvstore_version() as this benchmark has always written it (the key already
    says kvstore): ``<commit>[ + uncommitted changes in kvstore/ or tracker/]``."""
    v = common.kvstore_version().removeprefix("kvstore ")
    return v.replace(" + uncommitted changes", " + uncommitted changes in kvstore/ or tracker/")


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
    p.add_argument("-w", "--workers", type=int, default=None,
                   help="W worker processes (default 2; with --layout the layout's W)")
    p.add_argument("-s", "--servers", type=int, default=None,
                   help="S servers of ours (default 2; with --layout the layout's S)")
    p.add_argument("--network", default="vgg", help="examples/models.py network (default vgg)")
    p.add_argument("--num-layers", type=int, default=None,
                   help="depth (default: 11 for vgg, 20 for resnet, none otherwise)")
    p.add_argument("--batch-size", type=int, default=16, help="b per worker (default 16)")
    p.add_argument("--bucket-bytes", type=int, default=None,
                   help="ours: the Trainer's bucket_bytes (default: sized by the model, "
                        "kvstore.torch.bucket_bytes_for)")
    p.add_argument("--image-size", type=int, default=32, help="inputs are 3xNxN (default 32)")
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iters", type=int, default=20, help="timed steps per launch (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before them (default 5)")
    p.add_argument("--launches", type=int, default=3, help="launches of every contender (default 3)")
    p.add_argument("--contenders", type=_csv, default=DEFAULT_CONTENDERS,
                   help=f"comma-separated, of {','.join(CONTENDERS)} (default: {','.join(DEFAULT_CONTENDERS)})")
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--atol", type=float, default=1e-5)
    p.add_argument("--timeout", type=float, default=300, help="seconds one launch may take")
    p.add_argument("--env", dest="env_pairs", action="append", default=[], metavar="NAME=VALUE",
                   help="extra environment variable for every process (repeatable)")
    OUTPUT.add_arguments(p)
    p.add_argument("--work-dir", default=None,
                   help="logs and parameter files (default: a new temporary directory); removed "
                        "after a passing run, kept after a failed one")
    p.add_argument("--name", default=None,
                   help="base name of the result files (default: trainer; with --link RATE: "
                        "trainer-link-RATE; with --layout too: trainer-link-RATE-dedicated-4x4)")
    p.add_argument("--link", default=None, metavar="RATE",
                   help="run every distributed contender split over emulated machines as "
                        "benchmarks/link/run.py does (network namespaces, each linked to one bridge "
                        "by a veth pair rate-limited to RATE by tc tbf, e.g. 1gbit; needs root): "
                        "by default two, A (the scheduler, server 0, worker 0 / DDP rank 0, the "
                        "floor) and B (server 1, worker 1 / DDP rank 1): even ranks on A, odd on "
                        "B; tcp across the link, gloo over the veth (default: off, everything on "
                        "this host's loopback)")
    p.add_argument("--layout", default=None, metavar="LAYOUT",
                   help="with --link: the hosts of benchmarks.link's layout instead of A and B: "
                        "dedicated:WxS (worker r and DDP rank r on worker host r, server s on "
                        "server host S<s>: all tcp) or colo:W (server r and worker r on host r); "
                        "the scheduler and the floor on A; W and S are the layout's (-w/-s, if "
                        "given, must agree)")
    p.add_argument("--link-check-seconds", type=float, default=1.0,
                   help="--link: duration of the raw TCP check per direction (default 1.0)")
    p.add_argument("--corrupt-for-test", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    _workers_and_servers(p, args)
    if args.bucket_bytes is not None and args.bucket_bytes < 1:
        p.error("--bucket-bytes must be at least 1")
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
        args.link = args.link.strip().lower()
        try:
            netns.parse_rate(args.link)
        except ValueError as e:
            p.error(f"--link: {e}")
        if args.link_check_seconds <= 0:
            p.error("--link-check-seconds must be > 0")
    if args.name is None:
        args.name = "trainer" if args.link is None else f"trainer-link-{args.link}"
        if args.layout is not None:
            args.name += "-" + args.layout.key.replace(":", "-")
    args.out_dir = OUTPUT.chosen(p, args)
    return args


def _workers_and_servers(p: argparse.ArgumentParser, args) -> None:
    """--layout: W and S are the layout's (an explicit -w/-s must agree); else 2 and 2."""
    if args.layout is None:
        args.workers = 2 if args.workers is None else args.workers
        args.servers = 2 if args.servers is None else args.servers
        return
    if args.link is None:
        p.error("--layout places processes on emulated hosts: it needs --link RATE")
    try:
        layout = layouts.parse(args.layout)
    except ValueError as e:
        p.error(f"--layout: {e}")
    if layout.kind == "ring":
        p.error("--layout: ring is gloo's layout (DDP runs over the worker hosts of every "
                "layout); choose colo:W or dedicated:WxS")
    for flag, given, want in (("workers", args.workers, layout.workers),
                              ("servers", args.servers, layout.servers)):
        if given is not None and given != want:
            p.error(f"--{flag} {given} disagrees with --layout {layout.key}, which has "
                    f"{want} {flag}: leave --{flag} out (it is taken from the layout)")
    args.layout, args.workers, args.servers = layout, layout.workers, layout.servers


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:   # the workers' former entry point: trainer_worker.py now
        return worker_main(argv[1:])
    args = parse_args(argv)
    import torch
    cfg = {k: getattr(args, k) for k in ("workers", "servers", "network", "num_layers", "batch_size",
                                         "image_size", "num_classes", "lr", "momentum", "wd", "seed",
                                         "iters", "warmup", "rtol", "atol", "env", "bucket_bytes")}
    model, _ = build(cfg)
    cfg["num_params"] = sum(p.numel() for p in model.parameters())
    last_buckets = last_bucket_bytes([p.numel() * p.element_size() for p in model.parameters()], args.bucket_bytes)
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
    if per_slice and args.workers > 2:   # see the module's docstring, "Correctness"
        say(f"warning: {args.network} has BatchNorm or dropout, which amplify the rounding of "
            f"summing {args.workers} gradients in different orders: the weights check may "
            "fail without a fault (use lenet or mlp, or a looser --rtol/--atol)")
    failures: list[str] = []
    rows: list[dict] = []
    checks: list[dict] = []
    emulated = None
    restore_term = None
    if args.link:
        emulated = Emulated.build(args.workers, args.servers, args.layout)
        info["link"] = {"rate": args.link, **emulated.info()}
        restore_term = signal.signal(signal.SIGTERM, netns.on_sigterm)   # Ctrl-C or kill: clean up
    try:
        if emulated is not None:
            try:
                emulated.cluster.up()
                info["link"].update(link_ready(emulated.cluster, args.link,
                                               args.link_check_seconds, say))
            except netns.SetupFailed as e:
                print(f"skipped: the emulated network cannot be set up here (needs root and "
                      f"network namespaces): {e}", flush=True)
                shutil.rmtree(work, ignore_errors=True)
                return 0
        run_rounds(args, cfg, work, per_slice, emulated, say, rows, checks, failures)
    finally:
        if emulated is not None:
            errors = emulated.cluster.down()
            failures += [f"cleanup: {problem}" for problem in errors]
            for problem in errors:
                say(f"cleanup: {problem}")
            signal.signal(signal.SIGTERM, restore_term)
    correctness = verdict(checks, failures, per_slice, args.rtol, args.atol)
    data = {**info, "failures": failures, "correctness": correctness,
            "summary": summarise(rows, workers=args.workers), "rows": rows,
            "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    if emulated is not None:
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


def run_rounds(args, cfg: dict, work: str, per_slice: bool, emulated, say, rows: list[dict],
               checks: list[dict], failures: list[str]) -> None:
    """The reference (unless a floor launch trains it), then ``--launches`` rounds of
    every contender, the order rotating every round; each round checked as soon as it
    is done. Appends to ``rows``, ``checks`` and ``failures``."""
    done: list[tuple[str, int, str]] = []     # (contender, launch, file prefix) of every launch
    ref_prefix = os.path.join(work, "reference")
    active = list(args.contenders)
    if "floor" not in active:   # else the first floor launch trains the reference afterwards
        t0 = time.monotonic()
        try:
            run_plain(cfg, work, "reference", "reference", 1, args.timeout, emulated=emulated)
        except Failed as e:
            failures.append(f"reference: {e}")
            active = []
        say(f"  reference: {time.monotonic() - t0:.1f}s")
    corrupt_target = next((c for c in active if c.startswith("ours")), None)
    for launch_no in range(args.launches):
        k = launch_no % max(1, len(active))
        for name in active[k:] + active[:k]:
            load = os.getloadavg()
            tag = f"{name}-{launch_no}"
            counted = emulated.cluster.host_counters() if emulated is not None else None
            t1, wall0 = time.monotonic(), time.time()
            try:
                got = run_contender(name, tag, cfg, work, args.timeout,
                                    args.corrupt_for_test and name == corrupt_target, ref_prefix,
                                    emulated=emulated)
            except Failed as e:
                failures.append(f"{name} (launch {launch_no + 1}): {e}")
                say(f"  launch {launch_no + 1}/{args.launches} {name}: FAILED: {e}")
                continue
            done.append((name, launch_no, os.path.join(work, tag)))
            rows.append(row(name, launch_no, got, load, os.getloadavg(), wall0))
            if counted is not None:   # what every host's link carried during the launch
                cluster = emulated.cluster
                hb = rows[-1]["host_bytes"] = cluster.counted(counted, cluster.host_counters())
                if emulated.layout is None:   # two machines: what A sent went to B, and back
                    rows[-1]["link_bytes"] = {"a_to_b": hb["A"]["tx"], "b_to_a": hb["B"]["tx"]}
            ph = rows[-1]["phases_s"]
            say(f"  launch {launch_no + 1}/{args.launches} {name}: median "
                f"{statistics.median(got[0]['times']) * 1e3:.1f} ms in {time.monotonic() - t1:.1f}s "
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


if __name__ == "__main__":
    sys.exit(main())
