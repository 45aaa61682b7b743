"""Accuracy after a fixed time with a straggler: the README's Fashion-MNIST job
(examples/train_mnist.py) under dist_sync, dist_ssp with s = 1, 2, 4, and
dist_async, with one worker slowed from outside.

    python -m benchmarks.straggler                 # W=4, S=1, the defaults below (about 10 minutes)
    python -m benchmarks.straggler -w 2 --network mlp --num-examples 512 --num-epochs 2 \\
        --stop 0.02 --run 0.06 --configs unslowed,ssp1   # small, for tests

Each configuration is one job, ``python -m tracker.local -n W -s S python
examples/train_mnist.py --kvstore K --num-examples N --num-epochs E`` (the
example unchanged, so its learning rate is scaled by 1/W for dist_async and
dist_ssp, its default), with the last worker slowed by benchmarks/harness/throttle.py: it
is stopped (SIGSTOP) for --stop seconds and runs for --run seconds, over and over.
``unslowed`` is dist_sync without the throttle: the reference for what the
straggler costs.

Everything reported is parsed from the workers' log lines (examples/common.py):
``Epoch[e] Validation-accuracy=...`` with its timestamp is the end of epoch e
(its time since the job was launched, and its accuracy on the 10,000 test
images), ``Epoch[e] Time cost=...`` is the epoch's training time, so steps/s =
the epoch's batches ((N // W) // batch size) / time cost. T is the time the
fastest slowed configuration's worker 0 needed for all its epochs; "at T" is the
accuracy of the latest epoch worker 0 had finished by T.
Writes <name>.md (the tables) and <name>.json (every worker's epochs) to --out-dir
(default: a new scratch directory; ``--record``: benchmarks/results/staleness).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid

import click

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    __package__ = "benchmarks.straggler"

from benchmarks.harness import common  # noqa: E402
from benchmarks.harness.output import ResultsDir  # noqa: E402
from benchmarks.harness.procs import GroupFailed, run_group  # noqa: E402
from benchmarks.straggler.report import epochs_by_worker, markdown, summarize  # noqa: E402
from benchmarks.harness.throttle import DutyCycle  # noqa: E402

ROOT = common.REPO
EXAMPLE = os.path.join(ROOT, "examples", "train_mnist.py")
OUTPUT = ResultsDir("straggler", "staleness")
BATCH_SIZE = 64          # examples/train_mnist.py's default, used to count an epoch's batches
# name -> (--kvstore, KVSTORE_STALENESS or None, slowed)
CONFIGS = {"unslowed": ("dist_sync", None, False), "dist_sync": ("dist_sync", None, True),
           **{f"ssp{s}": ("dist_ssp", s, True) for s in (1, 2, 4)},
           "dist_async": ("dist_async", None, True)}


def _configs(ctx, param, value):
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [v for v in items if v not in CONFIGS] + [v for i, v in enumerate(items) if v in items[:i]]
    if bad or not items:
        raise click.BadParameter(f"unknown or repeated: {', '.join(bad) or 'nothing given'}; a comma list "
                                 f"of {', '.join(CONFIGS)}, each once")
    return items


def uptime() -> str:
    """``uptime``'s line (the load on this shared machine goes into the report)."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_seconds() -> tuple[float, float]:
    """(CPU seconds this machine's processors have been busy since boot, /proc/stat;
    CPU seconds of this process's waited-for descendants). Over a job, the first's
    growth minus the second's is what other jobs on the machine used meanwhile."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    busy = ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6]   # user nice system irq softirq
    mine = resource.getrusage(resource.RUSAGE_CHILDREN)
    return busy / os.sysconf("SC_CLK_TCK"), mine.ru_utime + mine.ru_stime


def command(name: str, cfg: dict, token: str) -> list[str]:
    """The job's argv: the README's command with this configuration."""
    store, staleness, _ = CONFIGS[name]
    env = ["--env", f"KVBENCH_STRAGGLER={token}"]   # how the throttle finds this job's worker
    if staleness is not None:
        env += ["--env", f"KVSTORE_STALENESS={staleness}"]
    return [sys.executable, "-m", "tracker.local", "-n", str(cfg["workers"]), "-s", str(cfg["servers"]),
            *env, sys.executable, EXAMPLE, "--kvstore", store, "--network", cfg["network"],
            "--num-examples", str(cfg["num_examples"]), "--num-epochs", str(cfg["num_epochs"])]


def run_config(name: str, cfg: dict, work: str) -> dict:
    """One job, throttled unless ``unslowed``; its workers' epochs as logged.
    Raises click.ClickException (with the log's tail) when a process fails, when
    the throttle could not do its job, or when a worker's log misses an epoch."""
    slowed = CONFIGS[name][2]
    token = uuid.uuid4().hex
    log_path = os.path.join(work, f"{name}.log")
    argv = command(name, cfg, token)
    throttle = None
    if slowed:
        env = {"KVBENCH_STRAGGLER": token, "KVSTORE_ROLE": "worker", "KVSTORE_RANK": str(cfg["workers"] - 1)}
        throttle = DutyCycle(env, cfg["stop"], cfg["run"], find_timeout=cfg["timeout"])
    cpu_before, load_before = cpu_seconds(), os.getloadavg()
    started_at, started = time.time(), time.monotonic()
    if throttle is not None:
        throttle.start()
    try:
        run_group([(name, argv, {"PYTHONPATH": ROOT})], log_path, cfg["timeout"])
    except GroupFailed as e:
        raise click.ClickException(f"{name} failed: {e}") from None
    finally:
        done = throttle.finish() if throttle is not None else None
    wall = time.monotonic() - started
    (busy, mine), (busy0, mine0) = cpu_seconds(), cpu_before
    if throttle is not None:
        assert done is not None   # the throttle's finish()
        if throttle.error is not None or not done["stops"]:
            raise click.ClickException(f"{name}: the throttle of worker {cfg['workers'] - 1} did not work "
                                       f"({throttle.error or 'it never stopped it'}); log: {log_path}")
    with open(log_path, encoding="utf-8", errors="replace") as f:
        workers = epochs_by_worker(f, started_at)
    counts = {r: len(workers.get(r, [])) for r in range(cfg["workers"])}
    missing = {r: n for r, n in counts.items() if n != cfg["num_epochs"]}
    if missing:
        raise click.ClickException(f"{name}: epochs logged by worker {missing} (of {cfg['num_epochs']}); "
                                   f"log: {log_path}")
    return {"config": name, "kvstore": CONFIGS[name][0], "staleness": CONFIGS[name][1], "slowed": slowed,
            "argv": argv, "log": log_path, "wall_s": wall, "throttle": done,
            "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            "job_cores": (mine - mine0) / wall, "other_cores": (busy - busy0 - (mine - mine0)) / wall,
            "workers": {str(r): workers[r] for r in sorted(workers)}}


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-w", "--workers", type=click.IntRange(min=2), default=4, show_default=True,
              help="W; the last one is slowed.")
@click.option("-s", "--servers", type=click.IntRange(min=1), default=1, show_default=True, help="S.")
@click.option("--network", default="lenet", show_default=True, help="train_mnist.py's --network.")
@click.option("--num-examples", type=click.IntRange(min=1), default=8000, show_default=True,
              help="train_mnist.py's --num-examples (the first N training images).")
@click.option("--num-epochs", type=click.IntRange(min=1), default=3, show_default=True,
              help="train_mnist.py's --num-epochs.")
@click.option("--stop", type=click.FloatRange(min=0.001), default=0.1, show_default=True,
              help="Seconds the slowed worker is stopped each cycle.")
@click.option("--run", "run_s", type=click.FloatRange(min=0.001), default=0.1, show_default=True,
              help="Seconds it runs between stops.")
@click.option("--configs", callback=_configs, default=",".join(CONFIGS), show_default=True,
              help="Which configurations to run (comma-separated), in this order.")
@click.option("--name", default="straggler", show_default=True, help="Base name of the result files.")
@click.option("--timeout", type=click.FloatRange(min=1), default=400, show_default=True,
              help="Seconds one job may take.")
@OUTPUT.click_options
def main(workers, servers, network, num_examples, num_epochs, stop, run_s, configs, out_dir, name, timeout):
    """Accuracy over time of dist_sync, dist_ssp (s = 1, 2, 4) and dist_async with a slowed worker."""
    per_worker = num_examples // workers
    if per_worker < BATCH_SIZE:
        raise click.BadParameter(f"{num_examples} examples give each of {workers} workers {per_worker}, "
                                 f"less than a batch ({BATCH_SIZE})", param_hint="--num-examples")
    cfg = {"workers": workers, "servers": servers, "network": network, "num_examples": num_examples,
           "num_epochs": num_epochs, "batch_size": BATCH_SIZE, "batches_per_epoch": per_worker // BATCH_SIZE,
           "stop": stop, "run": run_s, "configs": list(configs), "timeout": timeout}
    os.makedirs(out_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="kvbench-straggler-")
    data = {"machine": common.machine(), "version": common.kvstore_version(), "config": cfg,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "uptime_before": uptime(), "rows": []}
    click.echo(f"W={workers}, S={servers}, worker {workers - 1} stopped {stop * 1e3:.0f} ms of every "
               f"{(stop + run_s) * 1e3:.0f} ms; logs in {work}", err=True)
    for c in configs:
        row = run_config(c, cfg, work)
        data["rows"].append(row)
        last = row["workers"]["0"][-1]
        click.echo(f"  {c}: worker 0 done at {last['t']:.1f} s, accuracy {last['val']:.4f}; job "
                   f"{row['wall_s']:.1f} s", err=True)
    data["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    data["uptime_after"] = uptime()
    data["summary"] = summarize(data)
    common.write_results(out_dir, name, markdown(data), data)


if __name__ == "__main__":
    main()
