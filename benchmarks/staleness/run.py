"""Bounded staleness with a straggler: the step rate of dist_sync, dist_ssp with
s = 1, 2, 4, and dist_async when a worker is slowed.

    python -m benchmarks.staleness                     # W=4, S=1, 60 steps, the defaults below
    python -m benchmarks.staleness --steps 5 --configs dist_sync,ssp1 --delays r1   # small, for tests

Each configuration is one ``tracker.local`` job of benchmarks/staleness/worker.py:
every worker "computes" for --compute seconds a step (a sleep: the point is the
waiting, not the CPU), then pushpulls a --size float32 key (SGD on the servers);
one worker sleeps --delay seconds more on some steps, as --delays says (a comma
list, one table each): N, the last worker on every N-th step (1: a worker that
is always slower; 4: one that stalls now and then); rN, the workers in turn on
every N-th step (stragglers that come and go, every worker as fast on average).
Every read is checked against the store's bound (a wrong value fails the run).
Per configuration: the step rate of the fast workers (all of them with rN) and of
the slowed one over the timed steps, the job's wall time, and the others' pushes
missing from the fast workers' reads (dist_sync: 0; mostly the straggler's).
Writes <name>.md (the tables) and <name>.json to --out-dir (default: a new scratch
directory; ``--record``: benchmarks/results/staleness).
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys
import tempfile
import time

import click

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    __package__ = "benchmarks.staleness"

from benchmarks.harness import common  # noqa: E402
from benchmarks.harness.output import ResultsDir  # noqa: E402
from benchmarks.harness.procs import GroupFailed, run_group  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
OUTPUT = ResultsDir("staleness", "staleness")
# name -> the worker's store arguments
CONFIGS = {"dist_sync": ["--store", "dist_sync"],
           **{f"ssp{s}": ["--store", "dist_ssp", "--staleness", str(s)] for s in (1, 2, 4)},
           "dist_async": ["--store", "dist_async"]}


def _configs(ctx, param, value):
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [v for v in items if v not in CONFIGS]
    if bad or not items:
        raise click.BadParameter(f"unknown {', '.join(bad) or 'nothing'}; choose from {', '.join(CONFIGS)}")
    return items


def _delays(ctx, param, value):
    items = tuple(v.strip() for v in value.split(","))
    if not all(v.removeprefix("r").isdigit() and int(v.removeprefix("r")) >= 1 for v in items):
        raise click.BadParameter("a comma list of N (the last worker every N-th step) or rN (the "
                                 "workers in turn every N-th step), N >= 1, e.g. 1,4,r1")
    return items


def describe(delays: str) -> str:
    n = int(delays.removeprefix("r"))
    when = "every step" if n == 1 else f"every {n}{dict([(2, 'nd'), (3, 'rd')]).get(n, 'th')} step"
    return f"the workers in turn, {when}" if delays.startswith("r") else f"the last worker, {when}"


def run_config(name: str, delays: str, cfg: dict, work: str) -> dict:
    """One job; the summary of its workers' results. Raises click.ClickException
    (with the log's tail) when a process fails or a read breaks the bound."""
    out = os.path.join(work, f"{name}-{delays}")
    os.makedirs(out)
    when = ["--every", delays.removeprefix("r")] + (["--rotate"] if delays.startswith("r") else [])
    argv = [sys.executable, "-m", "tracker.local", "-n", str(cfg["workers"]), "-s", str(cfg["servers"]),
            "--env", "KVSTORE_LOG_LEVEL=WARNING", sys.executable, WORKER, *CONFIGS[name],
            "--steps", str(cfg["steps"]), "--warmup", str(cfg["warmup"]), "--size", str(cfg["size"]),
            "--compute", str(cfg["compute"]), "--delay", str(cfg["delay"]), *when, "--out", out]
    started = time.monotonic()
    try:
        run_group([(name, argv, {"PYTHONPATH": common.REPO})],
                  os.path.join(work, f"{name}-{delays}.log"), cfg["timeout"])
    except GroupFailed as e:
        raise click.ClickException(f"{name} (delays {delays}) failed: {e}") from None
    wall = time.monotonic() - started
    results = []
    for path in sorted(glob.glob(os.path.join(out, "worker-*.json"))):
        with open(path) as f:
            results.append(json.load(f))
    fast, slow = [r for r in results if not r["slow"]], [r for r in results if r["slow"]]
    return {"config": name, "delays": delays, "wall_s": wall,
            "fast_rate": statistics.fmean(len(r["times"]) / sum(r["times"]) for r in fast),
            "slow_rate": len(slow[0]["times"]) / sum(slow[0]["times"]) if slow else None,
            "missed": statistics.fmean(b for r in fast for b in r["behind"]),
            "missed_max": max(b for r in fast for b in r["behind"]), "raw": results}


def markdown(data: dict) -> str:
    cfg, m = data["config"], data["machine"]
    lines = [f"## Bounded staleness with a straggler: W={cfg['workers']}, S={cfg['servers']}", "",
             f"Machine: {m.get('cpu_model', '?')}, {m['cpus']} cores, {m.get('mem_total', '?')}; "
             f"run {data['started']} .. {data['finished']}; {data['version']}.",
             f"A step: {cfg['compute'] * 1e3:.0f} ms of 'compute' (a sleep), then a pushpull of "
             f"{cfg['size'] * 4 / 2 ** 20:.2f} MiB (float32, SGD on the servers); a delayed step sleeps "
             f"{cfg['delay'] * 1e3:.0f} ms more. {cfg['steps']} timed steps a worker after {cfg['warmup']} "
             "warm-up ones; every read checked against the store's bound. Rates are steps a second over "
             "the timed steps (fast: the mean of the workers other than the slowed one; of all of them "
             "when they take turns); 'missed' counts the other workers' pushes of steps up to the "
             "reader's own that a fast worker's read did not hold (mean, max).", ""]
    for delays in cfg["delays"]:
        rows = [r for r in data["rows"] if r["delays"] == delays]
        sync = next((r for r in rows if r["config"] == "dist_sync"), None)
        lines += [f"### Delayed: {describe(delays)}", "",
                  "| store | fast workers, steps/s | vs dist_sync | slowed worker, steps/s | job wall s | "
                  "missed (mean, max) |", "|---|---:|---:|---:|---:|---:|"]
        for r in rows:
            ratio = f"{r['fast_rate'] / sync['fast_rate']:.2f}x" if sync else ""
            slow = "" if r["slow_rate"] is None else f"{r['slow_rate']:.1f}"
            lines.append(f"| {r['config']} | **{r['fast_rate']:.1f}** | {ratio} | {slow} | "
                         f"{r['wall_s']:.1f} | {r['missed']:.2f}, {r['missed_max']:.0f} |")
        lines.append("")
    return "\n".join(lines)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-w", "--workers", type=click.IntRange(min=2), default=4, show_default=True, help="W.")
@click.option("-s", "--servers", type=click.IntRange(min=1), default=1, show_default=True, help="S.")
@click.option("--size", type=click.IntRange(min=1), default=1 << 18, show_default=True,
              help="float32 values of the key.")
@click.option("--steps", type=click.IntRange(min=1), default=60, show_default=True, help="Timed steps.")
@click.option("--warmup", type=click.IntRange(min=0), default=3, show_default=True, help="Untimed steps first.")
@click.option("--compute", type=click.FloatRange(min=0), default=0.02, show_default=True,
              help="Seconds of 'compute' (a sleep) a step, every worker.")
@click.option("--delay", type=click.FloatRange(min=0), default=0.06, show_default=True,
              help="Extra seconds of a delayed step.")
@click.option("--delays", callback=_delays, default="1,4,r1", show_default=True,
              help="Who is delayed when: N, the last worker every N-th step; rN, the workers in turn "
                   "every N-th step. A comma list: one table each.")
@click.option("--configs", callback=_configs, default=",".join(CONFIGS), show_default=True,
              help="Which stores to run (comma-separated), in this order.")
@click.option("--name", default="staleness", show_default=True, help="Base name of the result files.")
@click.option("--timeout", type=click.FloatRange(min=1), default=300, show_default=True,
              help="Seconds one job may take.")
@OUTPUT.click_options
def main(workers, servers, size, steps, warmup, compute, delay, delays, configs, out_dir, name, timeout):
    """Step rates of dist_sync, dist_ssp (s = 1, 2, 4) and dist_async with a slowed worker."""
    cfg = {"workers": workers, "servers": servers, "size": size, "steps": steps, "warmup": warmup,
           "compute": compute, "delay": delay, "delays": list(delays), "timeout": timeout}
    os.makedirs(out_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="kvbench-staleness-")
    data = {"machine": common.machine(), "version": common.kvstore_version(), "config": cfg,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": []}
    click.echo(f"W={workers}, S={servers}, {compute * 1e3:.0f} ms a step + {delay * 1e3:.0f} ms on delayed "
               f"steps ({', '.join(delays)}); logs in {work}", err=True)
    for d in delays:
        for c in configs:
            row = run_config(c, d, cfg, work)
            data["rows"].append(row)
            click.echo(f"  {d}: {c}: fast {row['fast_rate']:.1f} steps/s, missed {row['missed']:.2f}; "
                       f"{row['wall_s']:.1f} s", err=True)
    data["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    common.write_results(out_dir, name, markdown(data), data)


if __name__ == "__main__":
    main()
