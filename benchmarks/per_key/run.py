"""The Python a ``pushpull`` costs per key on the worker and on the servers, measured
on the CPU: ResNet-50's gradients (benchmarks/harness/key_layouts.py: 161 keys, or
the same values in one key) pushpulled by ``dist_sync`` in one process, workers and
servers as threads over real sockets and shared memory (benchmarks/per_key/job.py),
each end's CPU time per call read from its threads' CPU clocks.

    python -m benchmarks.per_key                                  # this checkout
    python -m benchmarks.per_key --tree before=/tmp/kv-start      # and a worktree of another commit

Sizes are divided by ``--scale`` (64), so the copies cost little and what is left is
Python per key: the argument checks, packing, the messages' buffers, each chunk's round.
``--tree LABEL=DIR`` adds a checkout (a ``git worktree`` of an earlier commit) measured
the same way in the same run, its jobs alternating with this checkout's (``--repeats``
launches each), so both see the same load. Reports, per checkout and layout, the
median over launches of each launch's median per call (and the range of the launch
medians) of the worker's CPU, all servers' CPU and the wall time, and the cost of each
key beyond the first (161 keys against one). Writes per_key.md and per_key.json.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys

import click

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    __package__ = "benchmarks.per_key"

from benchmarks.harness import common  # noqa: E402
from benchmarks.harness.checkouts import checkouts as _checkouts, commit, tree_option  # noqa: E402
from benchmarks.harness.key_layouts import layout  # noqa: E402
from benchmarks.harness.options import layout_options  # noqa: E402
from benchmarks.harness.output import ResultsDir  # noqa: E402

OUTPUT = ResultsDir("per-key", "per_key")
JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "job.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYOUTS = ("keys", "flat")
MEASURES = ("worker_ms", "server_ms", "wall_ms")


def launch(tree: str, sizes: list[int], cfg: dict) -> dict:
    """One job of ``tree``'s kvstore; its worker 0's samples. Raises RuntimeError
    when it fails (a wrong sum included)."""
    env = dict(os.environ, PYTHONPATH=tree, KVSTORE_LOG_LEVEL="WARNING", BENCH_SIZES=json.dumps(sizes),
               BENCH_WORKERS=str(cfg["workers"]), BENCH_SERVERS=str(cfg["servers"]),
               BENCH_ITERS=str(cfg["iters"]), BENCH_WARMUP=str(cfg["warmup"]))
    p = subprocess.run([sys.executable, JOB], env=env, capture_output=True, text=True, timeout=600, cwd=tree)
    if p.returncode != 0:
        raise RuntimeError(f"the job of {tree} failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def summary(runs: list[dict]) -> dict:
    """Per measure: the median of the launches' medians, and their range."""
    out: dict = {"keys": runs[0]["keys"], "transports": runs[0]["transports"], "launches": len(runs)}
    for m in MEASURES:
        medians = [statistics.median(r[m]) for r in runs]
        out[m] = {"median": statistics.median(medians), "min": min(medians), "max": max(medians)}
    return out


def per_key(results: dict) -> dict:
    """Per measure, the cost in us of each key beyond the first (161 keys against one)."""
    keys, flat = results["keys"], results["flat"]
    return {m: (keys[m]["median"] - flat[m]["median"]) * 1e3 / (keys["keys"] - 1) for m in MEASURES}


def report(all_results: dict, cfg: dict) -> str:
    lines = ["# Python per key: a pushpull's CPU time on the worker and on the servers", "",
             f"ResNet-50's 25,557,032 gradient values divided by {cfg['scale']}, pushpulled by `dist_sync` "
             f"with W={cfg['workers']} and S={cfg['servers']}, workers and servers as threads of one process "
             "(real sockets, shared memory); worker 0's CPU time per call, all servers' CPU time per call "
             "(their threads' clocks) and the wall time. Each cell: the median over "
             f"{cfg['repeats']} launches of each launch's median of {cfg['iters']} calls (after "
             f"{cfg['warmup']} untimed), and the range of the launch medians; the checkouts' launches "
             "alternate. Command: `python -m benchmarks.per_key "
             + " ".join(f"--tree {label}=DIR" for label in all_results if label != "this") + "`. "
             "Checkouts: " + ", ".join(f"{label} {t['commit']}" for label, t in cfg["trees"].items()) + "; "
             f"Python {platform.python_version()}, {os.cpu_count()} CPUs, ours {common.kvstore_version()}; "
             f"load average at the start {cfg['load'][0]:.1f}, at the end {cfg['load'][1]:.1f}.",
             "", "| checkout | layout | keys | worker ms | servers ms | wall ms |", "|---|---|---:|---:|---:|---:|"]

    def cell(s: dict) -> str:
        return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"
    for label, results in all_results.items():
        for name, res in results.items():
            lines.append(f"| {label} | {name} | {res['keys']} | {cell(res['worker_ms'])} | "
                         f"{cell(res['server_ms'])} | {cell(res['wall_ms'])} |")
    if all(set(LAYOUTS) <= set(r) for r in all_results.values()):
        lines += ["", "Each key beyond the first (us):", "", "| checkout | worker | servers | wall |",
                  "|---|---:|---:|---:|"]
        for label, results in all_results.items():
            extra = per_key(results)
            lines.append(f"| {label} | {extra['worker_ms']:.1f} | {extra['server_ms']:.1f} | {extra['wall_ms']:.1f} |")
    return "\n".join(lines) + "\n"


@click.command()
@layout_options(LAYOUTS, workers=1, servers=1, iters=100, warmup=5)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="launches per checkout and layout")
@tree_option
@OUTPUT.click_options
def main(layouts, scale, workers, servers, iters, warmup, repeats, trees, out_dir):
    checkouts = _checkouts(trees, REPO)
    cfg = {"scale": scale, "workers": workers, "servers": servers, "iters": iters, "warmup": warmup,
           "repeats": repeats, "trees": {label: {"path": tree, "commit": commit(tree)} for label, tree in checkouts.items()},
           "load": [os.getloadavg()[0]]}
    runs: dict = {label: {name: [] for name in layouts} for label in checkouts}
    for _ in range(repeats):
        for name in layouts:
            sizes = layout(name, scale)
            for label, tree in checkouts.items():
                runs[label][name].append(launch(tree, sizes, cfg))
    cfg["load"].append(os.getloadavg()[0])
    results = {label: {name: summary(r) for name, r in by.items()} for label, by in runs.items()}
    for label, by in results.items():
        for name, res in by.items():
            click.echo(f"{label} {name}: {res['keys']} keys, worker {res['worker_ms']['median']:.2f} ms, "
                       f"servers {res['server_ms']['median']:.2f} ms, wall {res['wall_ms']['median']:.2f} ms")
    with open(os.path.join(out_dir, "per_key.md"), "w") as f:
        f.write(report(results, cfg))
    with open(os.path.join(out_dir, "per_key.json"), "w") as f:
        json.dump({"config": cfg, "results": results,
                   "samples": runs}, f, indent=1)
    return 0
