"""What deterministic sums cost: the ResNet-50 exchange (``pushpull`` of 161 fp32
tensors, 102.2 MB per worker) with the servers adding a round's pushes as they
arrive and in worker-rank order (``KVSTORE_DETERMINISTIC=1``), side by side.

    python -m benchmarks.deterministic                        # W=4, S=2, shm and tcp, 3 launches
    python -m benchmarks.deterministic --record               # also into benchmarks/results/deterministic
    python -m benchmarks.deterministic --model tiny --launches 1 --iters 2   # a smoke run

Each launch is a real job (tracker's launcher, this machine) per transport and
variant, the variants interleaved launch by launch (their order rotates); the
workers (benchmarks/harness/contenders/ours_worker.py) verify every sum. With
deterministic sums a push that comes before a lower rank's is held until its turn
(the memory of that message stays in use; nothing is copied) and co-located
workers push instead of writing into the servers' sums (write-in is off), so the
shm rows show both effects. Per variant: rank 0's median exchange, the servers' CPU
seconds and their largest peak RSS. Prints a markdown table and writes
``deterministic.md`` and ``deterministic.json`` to a scratch directory (printed),
or to ``--out-dir`` / with ``--record`` to benchmarks/results/deterministic. The
emulated-link comparison runs benchmarks.link twice (docs/performance.md).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile

import click

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    __package__ = "benchmarks.deterministic"

from benchmarks.harness import common, side_by_side  # noqa: E402
from benchmarks.harness.contenders import ours  # noqa: E402
from benchmarks.harness.contenders.base import RunConfig  # noqa: E402
from benchmarks.harness.options import exchange_options  # noqa: E402
from benchmarks.harness.output import ResultsDir  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUTPUT = ResultsDir("deterministic", "deterministic")
RECORD_DIR = OUTPUT.record_dir
VARIANTS = {"arrival order": {}, "rank order": {"KVSTORE_DETERMINISTIC": "1"}}


def measure(cfg: RunConfig, transports: list[str], launches: int) -> list[dict]:
    """One row per (transport, variant, launch): rank 0's exchange times and the servers' usage."""
    rows = []
    for launch in range(launches):
        order = side_by_side.rotated(VARIANTS, launch)
        for name in transports:
            transport = ours.TRANSPORTS[name]
            for variant in order:
                job_cfg = RunConfig(**{**cfg.__dict__, "env": {**cfg.env, **VARIANTS[variant]}})
                res = ours.run_job(job_cfg, transport, cfg.worker_args() + ["--modes", "pushpull"],
                                   f"det-{name}-{variant.split()[0]}-{launch}")
                servers = list((res.get("servers_usage") or {}).values())
                rows.append({"transport": name, "variant": variant, "launch": launch,
                             "samples_s": res["modes"]["pushpull"]["times"],
                             "server_cpu_s": sum(s.get("cpu_s", 0.0) for s in servers),
                             "server_peak_rss_mb": max((s.get("max_rss_mb", 0.0) for s in servers), default=0.0)})
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per transport and variant: the median over launches of each launch's median,
    the spread of those medians, and rank order against arrival order."""
    def servers(mine: list[dict]) -> dict:
        return {"server_cpu_s": statistics.median(r["server_cpu_s"] for r in mine),
                "server_peak_rss_mb": max(r["server_peak_rss_mb"] for r in mine)}
    return side_by_side.summary(rows, VARIANTS, servers, "vs_arrival")


def markdown(lines: list[dict], cfg: RunConfig) -> str:
    head = (f"W={cfg.workers} workers, S={cfg.servers} servers, model {cfg.model}, {cfg.iters} timed "
            f"pushpulls per launch (median of each launch; the median and range over launches)\n\n"
            "| transport | sums | pushpull ms | range ms | vs arrival order | servers' CPU s | "
            "largest server peak RSS MB |\n|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {x['transport']} | {x['variant']} | {x['median_ms']:.1f} | {x['min_ms']:.1f}-{x['max_ms']:.1f} | "
        f"{x['vs_arrival']:.2f}x | {x['server_cpu_s']:.2f} | {x['server_peak_rss_mb']:.0f} |\n" for x in lines)


@click.command()
@exchange_options(workers=4, launches=3)
@OUTPUT.click_options
def main(workers, servers, model, iters, warmup, launches, transports, timeout, out_dir) -> int:
    """Deterministic sums against arrival order: the ResNet-50 exchange, side by side."""
    with tempfile.TemporaryDirectory(prefix="kvstore-det-work-") as work:
        cfg = RunConfig(workers=workers, servers=servers, model=model, iters=iters, warmup=warmup,
                        latency_iters=0, work_dir=work, timeout=timeout)
        rows = measure(cfg, transports, launches)
    lines = summary(rows)
    text = markdown(lines, cfg)
    print(text)
    with open(os.path.join(out_dir, "deterministic.md"), "w") as f:
        f.write(text)
    common.write_json(os.path.join(out_dir, "deterministic.json"),
                      {"config": {"workers": workers, "servers": servers, "model": model, "iters": iters,
                                  "launches": launches}, "summary": lines, "rows": rows,
                       "machine": common.machine(), "kvstore": common.kvstore_version()})
    print(f"results in {out_dir}")
    return 0
