"""What the timeline (KVSTORE_TIMELINE, kvstore/timeline.py) costs: off, on, and,
with ``--before REF``, a tree without its hooks.

    python -m benchmarks.timeline_overhead                    # off vs on, 3 launches
    python -m benchmarks.timeline_overhead --before 2b11caf   # + the commit before the hooks

Each launch is a real job (``tracker.local``, W workers, S servers, this machine)
whose workers time ``--calls`` pushpulls of one small key (``--floats`` fp32), the
case where a per-call cost shows most; every ``--block`` calls make one sample and
rank 0's median sample per call is the launch's number, in wall-clock time and in the
worker process's CPU time (less disturbed by other load on the machine). Variants are interleaved
launch by launch (their order rotates). Also times, with timeit, the check each hook
makes when the timeline is off (``self._timeline is not None``) and counts how many a
pushpull makes. Prints a table and writes timeline_overhead.json into ``--out-dir``
(default: a new scratch directory; ``--record``: benchmarks/results).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import timeit

import click

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    __package__ = "benchmarks.timeline_overhead"

from benchmarks.harness.contenders.ours import worktree  # noqa: E402
from benchmarks.harness.output import ResultsDir  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUTPUT = ResultsDir("timeline-overhead", "")
FILE = "timeline_overhead.json"
RECORD = os.path.join(OUTPUT.record_dir, FILE)
# one worker of a launch: argv = calls, floats, block, out (rank 0 writes its samples there)
WORKER = """
import json, sys, time
import numpy as np, kvstore
calls, floats, block, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
kv = kvstore.create("dist_sync")
value = np.ones(floats, np.float32)
kv.init(0, value)
for _ in range(200):                                   # warm-up
    kv.pushpull(0, value)
kv.barrier()
samples = []
for _ in range(calls // block):
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(block):
        kv.pushpull(0, value)
    samples.append(((time.perf_counter() - start) / block, (time.process_time() - cpu) / block))
if kv.rank == 0:
    with open(out, "w") as f:
        json.dump(samples, f)
kv.close()
"""
# the hooks a pushpull of one key to one server passes with the timeline off: the
# worker's _send (2), _fill (3), Client.request (1) and _complete (1); the server's
# _deliver (1) and _send of the reply (2)
CHECKS_PER_PUSHPULL = {"worker": 7, "server": 3}


def off_check_ns(number: int = 2_000_000) -> float:
    """ns per ``self._timeline is not None`` on an object whose attribute is None."""
    class Store:
        _timeline = None

        def __init__(self):
            self._timeline = None
    store = Store()
    times = timeit.repeat("store._timeline is not None", globals={"store": store}, number=number, repeat=5)
    empty = timeit.repeat("store", globals={"store": store}, number=number, repeat=5)
    return max(min(times) - min(empty), 0.0) / number * 1e9


def launch(tree: str, env: dict, workers: int, servers: int, calls: int, floats: int, block: int,
           work: str) -> tuple[float, float]:
    """One job's rank-0 median seconds per pushpull: (wall clock, CPU time)."""
    out = os.path.join(work, "samples.json")
    environ = {k: v for k, v in os.environ.items() if k != "KVSTORE_TIMELINE"}
    environ.update(PYTHONPATH=tree, **env)
    p = subprocess.run([sys.executable, "-m", "tracker.local", "-n", str(workers), "-s", str(servers),
                        sys.executable, "-c", WORKER, str(calls), str(floats), str(block), out],
                       cwd=work, env=environ, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise click.ClickException(f"a launch failed:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    with open(out) as f:
        samples = json.load(f)
    return statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)


def _lines(path: str) -> int:
    with open(path) as f:
        return sum(1 for _ in f)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-w", "--workers", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("-s", "--servers", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--calls", type=click.IntRange(min=1), default=3000, show_default=True, help="Timed pushpulls per launch.")
@click.option("--floats", type=click.IntRange(min=1), default=256, show_default=True, help="fp32 values in the key.")
@click.option("--block", type=click.IntRange(min=1), default=100, show_default=True, help="Calls per sample.")
@click.option("--launches", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--before", metavar="REF", help="Also run commit REF (a git worktree), e.g. the commit before the hooks.")
@OUTPUT.click_options
def main(workers, servers, calls, floats, block, launches, before, out_dir) -> None:
    """Time small pushpulls with the timeline off, on, and (--before) without its hooks."""
    out = os.path.join(out_dir, FILE)
    check = off_check_ns()
    with contextlib.ExitStack() as stack:
        work = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvbench-timeline-"))
        trace = os.path.join(work, "trace")
        variants = {"off": (REPO, {}), "on": (REPO, {"KVSTORE_TIMELINE": trace})}
        if before:
            tree, commit = stack.enter_context(worktree(before))
            variants[f"before ({commit})"] = (tree, {})
        results: dict = {name: [] for name in variants}
        names = list(variants)
        for i in range(launches):
            for name in names[i % len(names):] + names[:i % len(names)]:
                tree, env = variants[name]
                results[name].append(launch(tree, env, workers, servers, calls, floats, block, work))
        events = sum(_lines(os.path.join(trace, f)) for f in os.listdir(trace)) if os.path.isdir(trace) else 0
    base = [statistics.median(v[i] for v in results["off"]) for i in (0, 1)]
    click.echo(f"pushpull of {floats} fp32, W={workers}, S={servers}, {calls} calls x {launches} launches "
               f"(rank 0's median per call over blocks of {block}; median over launches)\n")
    click.echo(f"{'variant':<20} {'us/call':>8} {'vs off':>7} {'cpu us':>7} {'vs off':>7}  launches (wall us)")
    for name, values in results.items():
        wall, cpu = (statistics.median(v[i] for v in values) for i in (0, 1))
        click.echo(f"{name:<20} {wall * 1e6:>8.1f} {wall / base[0]:>7.3f} {cpu * 1e6:>7.1f} {cpu / base[1]:>7.3f}  "
                   f"{', '.join(f'{v[0] * 1e6:.1f}' for v in values)}")
    per_call = check * CHECKS_PER_PUSHPULL["worker"]
    click.echo(f"\noff-check (`self._timeline is not None`): {check:.1f} ns; a pushpull makes "
               f"{CHECKS_PER_PUSHPULL['worker']} on the worker and {CHECKS_PER_PUSHPULL['server']} on the "
               f"server: {per_call:.0f} ns on the worker = {per_call / (base[0] * 1e9) * 100:.3f}% of a call")
    click.echo(f"on: the last launch's files held about {events} lines (events)")
    with open(out, "w") as f:
        json.dump({"workers": workers, "servers": servers, "calls": calls, "floats": floats, "block": block,
                   "launches": launches, "seconds_per_call_wall_cpu": results, "off_check_ns": check,
                   "checks_per_pushpull": CHECKS_PER_PUSHPULL, "events_last_on_launch": events}, f, indent=1)
    click.echo(f"wrote {out}")


if __name__ == "__main__":
    main()
