"""Mixed precision on the wire: the ResNet-50 exchange (``pushpull`` of 161 tensors,
25.6 M values per worker) with float32 gradients and with bfloat16 ones pushed as
they are to float32 keys (``kv.set_multi_precision(True)``, kvstore/precision.py),
pulled into bfloat16 outputs, side by side.

    python -m benchmarks.mixed_precision                       # W=2, S=2, shm and tcp, 5 launches
    python -m benchmarks.mixed_precision --record              # also into benchmarks/results/mixed_precision
    python -m benchmarks.mixed_precision --model tiny --launches 1 --iters 2   # a smoke run
    python -m benchmarks.mixed_precision --tree before=/tmp/kv-before --tree after=.   # checkouts, alternating

Each launch is one real job (tracker's launcher, this machine) per transport running
both variants, their order rotating launch by launch; the workers
(benchmarks/harness/contenders/ours_worker.py, modes ``pushpull`` and
``pushpull_bf16``) verify every sum. Per variant: the median over launches of rank 0's
median exchange, the range of those medians, the bytes rank 0 sent and received per
exchange, and the machine's load average around the launches (this machine is shared:
read the spread before the medians). The workers run torch with ``--torch-threads``
intra-op threads (``OMP_NUM_THREADS``, default 1, what torchrun sets for several
processes a machine): rounding the float32 replies into bfloat16 outputs is torch's
``copy_``, whose OpenMP threads spin when the machine has fewer free cores than
threads (measured on this 2-core machine at load 8-10: 1251 ms with 2 threads, 433 ms
with 1, the float32 variant, which runs no torch, 398-408 ms). Prints a markdown table and writes
``mixed_precision.md`` and ``mixed_precision.json`` to a scratch directory (printed),
or to ``--out-dir`` / with ``--record`` to benchmarks/results/mixed_precision.

With ``--tree NAME=PATH`` (repeatable: e.g. a ``git worktree`` of an earlier commit and
this one) each launch runs every checkout's own benchmark in turn (one launch each, in
its directory with its PYTHONPATH, their order rotating), and each line names its
checkout beside the transport: before/after in the same run, on the same load.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

import click

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    __package__ = "benchmarks.mixed_precision"

from benchmarks.harness import common, side_by_side  # noqa: E402
from benchmarks.harness.contenders import ours  # noqa: E402
from benchmarks.harness.contenders.base import RunConfig  # noqa: E402
from benchmarks.harness.options import exchange_options  # noqa: E402
from benchmarks.harness.output import ResultsDir  # noqa: E402

OUTPUT = ResultsDir("mixed_precision", "mixed_precision")
RECORD_DIR = OUTPUT.record_dir
VARIANTS = {"float32": "pushpull", "bfloat16": "pushpull_bf16"}     # variant -> ours_worker's mode


def measure(cfg: RunConfig, transports: list[str], launches: int) -> list[dict]:
    """One row per (transport, variant, launch): rank 0's exchange times, bytes per
    exchange, and the 1-minute load average before and after the launch."""
    rows = []
    for launch in range(launches):
        order = side_by_side.rotated(VARIANTS, launch)
        for name in transports:
            load_before = os.getloadavg()[0]
            res = ours.run_job(cfg, ours.TRANSPORTS[name],
                               cfg.worker_args() + ["--modes", ",".join(VARIANTS[v] for v in order)],
                               f"mp-{name}-{launch}")
            load_after = os.getloadavg()[0]
            for variant in order:
                got = res["modes"][VARIANTS[variant]]
                rows.append({"transport": name, "variant": variant, "launch": launch,
                             "samples_s": got["times"], "bytes_sent": got["bytes_sent"],
                             "bytes_received": got["bytes_received"],
                             "load_before": load_before, "load_after": load_after})
    return rows


def measure_trees(cfg: RunConfig, trees: dict[str, str], transports: list[str], launches: int,
                  torch_threads: int) -> list[dict]:
    """:func:`measure` by each checkout of ``trees`` {name: path} in turn per launch (its own
    benchmark, one launch), the rows' transport named "<transport> <name>"."""
    rows = []
    for launch in range(launches):
        for name in side_by_side.rotated(list(trees), launch):
            out = os.path.join(cfg.work_dir, f"tree-{name}-{launch}")
            os.makedirs(out, exist_ok=True)
            argv = [sys.executable, "-m", "benchmarks.mixed_precision", "--workers", str(cfg.workers),
                    "--servers", str(cfg.servers), "--model", cfg.model, "--iters", str(cfg.iters),
                    "--warmup", str(cfg.warmup), "--launches", "1", "--timeout", str(cfg.timeout),
                    "--torch-threads", str(torch_threads), "--out-dir", out, "--transports", ",".join(transports)]
            p = subprocess.run(argv, cwd=trees[name], env={**os.environ, "PYTHONPATH": os.path.abspath(trees[name])},
                               capture_output=True, text=True, timeout=cfg.timeout * 2 * len(transports) + 60)
            if p.returncode != 0:
                raise SystemExit(f"the benchmark of checkout {name} ({trees[name]}) failed:\n{p.stdout[-3000:]}"
                                 f"{p.stderr[-3000:]}")
            with open(os.path.join(out, "mixed_precision.json")) as f:
                for row in json.load(f)["rows"]:
                    rows.append({**row, "transport": f"{row['transport']} {name}", "launch": launch})
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per transport and variant: the median over launches of each launch's median,
    their range, bytes per exchange, the load's range, and bfloat16 against float32."""
    def bytes_and_load(mine: list[dict]) -> dict:
        loads = [r["load_before"] for r in mine] + [r["load_after"] for r in mine]
        return {"sent_mb": statistics.median(r["bytes_sent"] for r in mine) / 1e6,
                "received_mb": statistics.median(r["bytes_received"] for r in mine) / 1e6,
                "load_min": min(loads), "load_max": max(loads)}
    return side_by_side.summary(rows, VARIANTS, bytes_and_load, "vs_float32")


def markdown(lines: list[dict], cfg: RunConfig) -> str:
    head = (f"W={cfg.workers} workers, S={cfg.servers} servers, model {cfg.model}, {cfg.iters} timed "
            f"pushpulls per launch (median of each launch; the median and range over launches; rank 0's "
            f"bytes per exchange; the 1-minute load average around the launches; torch's threads: "
            f"{cfg.env.get('OMP_NUM_THREADS', 'default')})\n\n"
            "| transport | gradients | pushpull ms | range ms | vs float32 | sent MB | received MB | load |\n"
            "|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {x['transport']} | {x['variant']} | {x['median_ms']:.1f} | {x['min_ms']:.1f}-{x['max_ms']:.1f} | "
        f"{x['vs_float32']:.2f}x | {x['sent_mb']:.1f} | {x['received_mb']:.1f} | "
        f"{x['load_min']:.1f}-{x['load_max']:.1f} |\n" for x in lines)


@click.command()
@exchange_options(workers=2, launches=5)
@click.option("--torch-threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="The workers' OMP_NUM_THREADS (torch's intra-op threads).")
@click.option("--tree", "trees", multiple=True, metavar="NAME=PATH",
              help="A checkout to measure (its own benchmark), alternating with the other --tree ones.")
@OUTPUT.click_options
def main(workers, servers, model, iters, warmup, launches, transports, timeout, torch_threads, trees,
         out_dir) -> int:
    """bfloat16 gradients on the wire against float32: the ResNet-50 exchange, side by side."""
    named = {}
    for item in trees:
        name, sep, path = item.partition("=")
        if not sep or not name or not os.path.isdir(os.path.join(path, "benchmarks", "mixed_precision")):
            raise click.BadParameter(f"{item!r}: expected NAME=PATH of a checkout with benchmarks/mixed_precision",
                                     param_hint="--tree")
        named[name] = path
    with tempfile.TemporaryDirectory(prefix="kvstore-mp-work-") as work:
        cfg = RunConfig(workers=workers, servers=servers, model=model, iters=iters, warmup=warmup,
                        latency_iters=0, work_dir=work, timeout=timeout,
                        env={"OMP_NUM_THREADS": str(torch_threads)})
        rows = (measure_trees(cfg, named, transports, launches, torch_threads) if named
                else measure(cfg, transports, launches))
    lines = summary(rows)
    text = markdown(lines, cfg)
    print(text)
    with open(os.path.join(out_dir, "mixed_precision.md"), "w") as f:
        f.write(text)
    common.write_json(os.path.join(out_dir, "mixed_precision.json"),
                      {"config": {"workers": workers, "servers": servers, "model": model, "iters": iters,
                                  "launches": launches, "torch_threads": torch_threads, "trees": named},
                       "summary": lines, "rows": rows,
                       "machine": common.machine(), "kvstore": common.kvstore_version()})
    print(f"results in {out_dir}")
    return 0
