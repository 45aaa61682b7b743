"""How the cuda_ipc data plane's time depends on the number of keys, measured on the
CPU: ResNet-50's gradients pushpulled by ``dist_device_sync`` between real processes
(W workers, S GPU servers, tracker's launcher) whose GPUs are emulated with
exportable host memory (benchmarks/emulated_ipc/job.py), in three layouts
(benchmarks/harness/key_layouts.py): 161 keys, the Trainer's flat buckets, one key.

    python -m benchmarks.emulated_ipc                           # all layouts, 1/64 size
    python -m benchmarks.emulated_ipc --layouts keys --profile /tmp/prof

Every byte crosses as on a GPU (by reference, no host copy: the job fails unless
worker 0 used cuda_ipc to every server), and the sizes are divided by ``--scale``,
so the copies cost little and what is measured is the time per key: the worker's
Python (argument checks, a view, a slot and a reference per value, a lookup per
reply value) and the servers' (a contribute and an update per key). On a GPU the
same Python runs around CuPy calls instead of numpy ones (benchmarks.gpu_check
measures those). Writes emulated_ipc.md and emulated_ipc.json to --out-dir (default: a
new scratch directory; ``--record``: benchmarks/results/emulated_ipc).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile

import click

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    __package__ = "benchmarks.emulated_ipc"

from benchmarks.harness.key_layouts import LAYOUTS  # noqa: E402
from benchmarks.harness import common  # noqa: E402
from benchmarks.harness.options import layout_options  # noqa: E402
from benchmarks.harness.output import ResultsDir  # noqa: E402
from tracker.launcher import JobSpec, launch  # noqa: E402

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "job.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUTPUT = ResultsDir("emulated-ipc", "emulated_ipc")


def run_layout(name: str, cfg: dict, work: str) -> dict:
    """One job pushpulling layout ``name``; worker 0's result. Raises RuntimeError
    when the job fails (a wrong sum exits non-zero) or a worker did not use cuda_ipc."""
    out = os.path.join(work, f"{name}.json")
    job = (sys.executable, JOB)
    env = {"KVSTORE_SERVER_DEVICE": "gpu", "KVSTORE_TIMEOUT": "60", "KVSTORE_LOG_LEVEL": "WARNING",
           "PYTHONPATH": REPO, "BENCH_LAYOUT": name, "BENCH_SCALE": str(cfg["scale"]),
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


def report(results: dict, cfg: dict) -> str:
    lines = ["# The cuda_ipc data plane on emulated GPUs: time per key", "",
             f"ResNet-50's 25,557,032 gradient values divided by {cfg['scale']}, pushpulled by "
             f"`dist_device_sync` with W={cfg['workers']} worker and S={cfg['servers']} GPU server "
             "processes whose GPUs are emulated with exportable host memory (every value by "
             "reference, no host copy); median of worker 0's "
             f"{cfg['iters']} timed calls after {cfg['warmup']} untimed. Command: "
             f"`python -m benchmarks.emulated_ipc --scale {cfg['scale']} --iters {cfg['iters']}`. "
             f"Python {platform.python_version()}, {os.cpu_count()} CPUs, ours {common.kvstore_version()}.",
             "", "| layout | keys | median ms | us per key | worker 0 CPU ms |", "|---|---:|---:|---:|---:|"]
    for name, res in results.items():
        lines.append(f"| {name} | {res['keys']} | {res['median_ms']:.2f} | {res['us_per_key']:.0f} | "
                     f"{res.get('cpu_ms', float('nan')):.2f} |")
    if "keys" in results and "flat" in results:
        keys, flat = results["keys"], results["flat"]
        extra = (keys["median_ms"] - flat["median_ms"]) * 1e3 / (keys["keys"] - 1)
        cpu = (keys.get("cpu_ms", float("nan")) - flat.get("cpu_ms", float("nan"))) * 1e3 / (keys["keys"] - 1)
        lines += ["", f"Each key beyond the first costs {extra:.0f} us (the same bytes in 161 keys against one), "
                      f"{cpu:.0f} us of worker 0's CPU."]
    return "\n".join(lines) + "\n"


@click.command()
@layout_options(LAYOUTS, workers=2, servers=2, iters=30, warmup=3)
@click.option("--profile", type=click.Path(file_okay=False), default=None,
              help="write worker 0's cProfile summary and the servers' profiles under DIR/LAYOUT")
@OUTPUT.click_options
def main(layouts, scale, workers, servers, iters, warmup, profile, out_dir):
    cfg = {"scale": scale, "workers": workers, "servers": servers, "iters": iters, "warmup": warmup,
           "profile": profile}
    results = {}
    with tempfile.TemporaryDirectory(prefix="emulated-ipc-") as work:
        for name in layouts:
            results[name] = run_layout(name, cfg, work)
            click.echo(f"{name}: {results[name]['keys']} keys, {results[name]['median_ms']:.2f} ms, "
                       f"{results[name]['us_per_key']:.0f} us per key")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "emulated_ipc.md"), "w") as f:
        f.write(report(results, cfg))
    with open(os.path.join(out_dir, "emulated_ipc.json"), "w") as f:
        json.dump({"config": cfg, "results": results}, f, indent=1)
    return 0
