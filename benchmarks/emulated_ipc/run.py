"""How the cuda_ipc data plane's time depends on the number of keys, measured on the
CPU: ResNet-50's gradients pushpulled by ``dist_device_sync`` between real processes
(W workers, S GPU servers, tracker's launcher) whose GPUs are emulated with
exportable host memory (benchmarks/emulated_ipc/job.py), in three layouts
(benchmarks/harness/key_layouts.py): 161 keys, the Trainer's flat buckets, one key.

    python -m benchmarks.emulated_ipc                           # all layouts, 1/64 size
    python -m benchmarks.emulated_ipc --layouts keys --profile /tmp/prof
    python -m benchmarks.emulated_ipc --tree before=/tmp/kv-before --repeats 5   # before/after

Every byte crosses as on a GPU (by reference, no host copy: the job fails unless
worker 0 used cuda_ipc to every server), and the sizes are divided by ``--scale``,
so the copies cost little and what is measured is the time per key: the worker's
Python (argument checks, a view, a slot and a reference per value, a lookup per
reply value) and the servers' (a contribute and an update per key). On a GPU the
same Python runs around CuPy calls instead of numpy ones (benchmarks.gpu_check
measures those). ``--tree LABEL=DIR`` adds a checkout (a ``git worktree`` of an earlier
commit, its own job.py) measured the same way, its jobs alternating with this
checkout's, ``--repeats`` launches each (benchmarks/harness/checkouts.py); each cell is
then the median over launches of each launch's median, with the range of the launch
medians. Writes emulated_ipc.md and emulated_ipc.json to --out-dir (default: a new
scratch directory; ``--record``: benchmarks/results/emulated_ipc).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile

import click

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    __package__ = "benchmarks.emulated_ipc"

from benchmarks.harness.key_layouts import LAYOUTS  # noqa: E402
from benchmarks.harness import common  # noqa: E402
from benchmarks.harness.checkouts import checkouts, commit, tree_option  # noqa: E402
from benchmarks.harness.options import layout_options  # noqa: E402
from benchmarks.harness.output import ResultsDir  # noqa: E402
from tracker.launcher import JobSpec, launch  # noqa: E402

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "job.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUTPUT = ResultsDir("emulated-ipc", "emulated_ipc")


def run_layout(name: str, cfg: dict, work: str, tree: str = REPO) -> dict:
    """One job of checkout ``tree`` pushpulling layout ``name``; worker 0's result. Raises
    RuntimeError when the job fails (a wrong sum exits non-zero) or a worker did not use
    cuda_ipc."""
    out = os.path.join(work, f"{name}.json")
    job = (sys.executable, os.path.join(tree, os.path.relpath(JOB, REPO)))    # the checkout's own job
    env = {"KVSTORE_SERVER_DEVICE": "gpu", "KVSTORE_TIMEOUT": "60", "KVSTORE_LOG_LEVEL": "WARNING",
           "PYTHONPATH": tree, "BENCH_LAYOUT": name, "BENCH_SCALE": str(cfg["scale"]),
           "BENCH_ITERS": str(cfg["iters"]), "BENCH_WARMUP": str(cfg["warmup"]), "BENCH_OUT": out}
    if cfg["profile"]:
        os.makedirs(os.path.join(cfg["profile"], name), exist_ok=True)
        env["BENCH_PROFILE"] = os.path.abspath(os.path.join(cfg["profile"], name))
        env["KVSTORE_PROFILE_DIR"] = env["BENCH_PROFILE"]     # where the servers' profile_dump writes
    outcome = launch(JobSpec(num_workers=cfg["workers"], num_servers=cfg["servers"], command=job,
                             server_command=job, env=env))
    if outcome.returncode != 0:
        raise RuntimeError(f"layout {name}: the job failed with status {outcome.returncode}")
    with open(out) as f:
        res = json.load(f)
    if res["transports"] != ["cuda_ipc"]:
        raise RuntimeError(f"layout {name}: worker 0 used {res['transports']}, not cuda_ipc to every server")
    res["us_per_key"] = res["median_ms"] * 1e3 / res["keys"]
    return res


def summary(runs: list[dict]) -> dict:
    """A layout's launches: the last launch's record, with ``median_ms`` and ``cpu_ms``
    the median over launches of each launch's median, and their ranges."""
    out = dict(runs[-1], launches=len(runs))
    for m in ("median_ms", "cpu_ms"):
        medians = [r[m] for r in runs]
        out[m], out[f"{m}_range"] = statistics.median(medians), [min(medians), max(medians)]
    out["us_per_key"] = out["median_ms"] * 1e3 / out["keys"]
    return out


def beyond_first(results: dict) -> tuple[float, float] | None:
    """(wall us, worker 0's CPU us) of each key beyond the first: 161 keys against one."""
    if "keys" not in results or "flat" not in results:
        return None
    keys, flat = results["keys"], results["flat"]
    return ((keys["median_ms"] - flat["median_ms"]) * 1e3 / (keys["keys"] - 1),
            (keys["cpu_ms"] - flat["cpu_ms"]) * 1e3 / (keys["keys"] - 1))


def report(by_tree: dict, cfg: dict) -> str:
    repeats = cfg.get("repeats", 1)
    trees = cfg.get("trees", {"this": {"commit": common.kvstore_version()}})
    sampled = (f"median of worker 0's {cfg['iters']} timed calls after {cfg['warmup']} untimed"
               if repeats == 1 else f"median over {repeats} launches of each launch's median of worker 0's "
               f"{cfg['iters']} timed calls (after {cfg['warmup']} untimed), and the range of the launch "
               "medians; the checkouts' launches alternate")
    command = (f"`python -m benchmarks.emulated_ipc --scale {cfg['scale']} --iters {cfg['iters']}"
               + (f" --repeats {repeats}" if repeats > 1 else "")
               + "".join(f" --tree {label}=DIR" for label in trees if label != "this") + "`")
    lines = ["# The cuda_ipc data plane on emulated GPUs: time per key", "",
             f"ResNet-50's 25,557,032 gradient values divided by {cfg['scale']}, pushpulled by "
             f"`dist_device_sync` with W={cfg['workers']} worker and S={cfg['servers']} GPU server "
             "processes whose GPUs are emulated with exportable host memory (every value by "
             f"reference, no host copy); {sampled}. Command: {command}. "
             f"Python {platform.python_version()}, {os.cpu_count()} CPUs; checkouts: "
             + ", ".join(f"{label} {t['commit']}" for label, t in trees.items())
             + (f"; load average at the start {cfg['load'][0]:.1f}, at the end {cfg['load'][1]:.1f}"
                if "load" in cfg else "") + ".",
             "", "| checkout | layout | keys | median ms | us per key | worker 0 CPU ms |",
             "|---|---|---:|---:|---:|---:|"]

    def cell(res: dict, m: str) -> str:
        low, high = res.get(f"{m}_range", (None, None))
        return f"{res[m]:.2f}" + (f" ({low:.2f}-{high:.2f})" if repeats > 1 and low is not None else "")
    for label, results in by_tree.items():
        for name, res in results.items():
            lines.append(f"| {label} | {name} | {res['keys']} | {cell(res, 'median_ms')} | "
                         f"{res['us_per_key']:.0f} | {cell(res, 'cpu_ms')} |")
    for label, results in by_tree.items():
        extra = beyond_first(results)
        if extra is not None:
            lines += ["", f"{label}: each key beyond the first costs {extra[0]:.0f} us (the same bytes in 161 "
                          f"keys against one), {extra[1]:.0f} us of worker 0's CPU."]
    return "\n".join(lines) + "\n"


@click.command()
@layout_options(LAYOUTS, workers=2, servers=2, iters=30, warmup=3)
@click.option("--profile", type=click.Path(file_okay=False), default=None,
              help="write worker 0's cProfile summary and the servers' profiles under DIR/LAYOUT")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="launches per checkout and layout")
@tree_option
@OUTPUT.click_options
def main(layouts, scale, workers, servers, iters, warmup, profile, repeats, trees, out_dir):
    dirs = checkouts(trees, REPO)
    cfg = {"scale": scale, "workers": workers, "servers": servers, "iters": iters, "warmup": warmup,
           "profile": profile, "repeats": repeats,
           "trees": {label: {"path": tree, "commit": commit(tree)} for label, tree in dirs.items()},
           "load": [os.getloadavg()[0]]}
    runs: dict = {label: {name: [] for name in layouts} for label in dirs}
    with tempfile.TemporaryDirectory(prefix="emulated-ipc-") as work:
        for _ in range(repeats):
            for name in layouts:
                for label, tree in dirs.items():
                    res = run_layout(name, cfg, work, tree)
                    runs[label][name].append(res)
                    click.echo(f"{label} {name}: {res['keys']} keys, {res['median_ms']:.2f} ms, "
                               f"{res['us_per_key']:.0f} us per key")
    cfg["load"].append(os.getloadavg()[0])
    by_tree = {label: {name: summary(r) for name, r in by.items()} for label, by in runs.items()}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "emulated_ipc.md"), "w") as f:
        f.write(report(by_tree, cfg))
    with open(os.path.join(out_dir, "emulated_ipc.json"), "w") as f:
        json.dump({"config": cfg, "results": by_tree["this"], "checkouts": by_tree, "launches": runs}, f, indent=1)
    return 0
