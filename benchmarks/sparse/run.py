"""Sparse embeddings: a big table's step with ours (row-sparse keys) against the
gloo ways of training it, side by side in one run.

    python -m benchmarks.sparse                          # 10,000,000 x 64 fp32 (2.56 GB), W=2, S=2
    python -m benchmarks.sparse --rows 200000 --steps 3  # small, for tests

Every contender trains the same table on the same batches (benchmarks/harness/sparse_worker.py, shared with sparse_link):
each worker draws --batch ids a step from a Zipf law (--zipf; about 49,000 unique
rows a worker at the defaults, printed as measured), and the gradient of a row is
its count times a constant. One after another (the dense one needs two tables of
memory per process):

  ours-sgd    the table on S servers (tracker.local, tcp so every byte crosses a
              socket); a step is push of the RowSparse gradient + row_sparse_pull of
              the batch's rows; lazy SGD on the servers
  ours-adam   the same with lazy Adam
  dense       DDP-style: every rank holds the table and a dense gradient; a step is
              gloo all_reduce of the whole gradient + torch SGD + the lookup
  sparse      every rank holds the table; a step is gloo's sparse all_reduce of the
              COO gradient (all_gather of indices and values, then sum) + torch SGD
              on those rows + the lookup

Per step, medians over the timed steps of worker 0: the time (a barrier, untimed,
before each step), the TCP bytes worker 0 sent plus received (``ss`` on every
socket of the process), and the worker's peak RSS (ru_maxrss) with its RSS before
the table. Every step is verified (see sparse_worker.py); a wrong value fails the
run. Writes <name>.md (the table) and <name>.json (every sample) to --out-dir (default: a
new scratch directory; ``--record``: benchmarks/results/sparse).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import click

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    __package__ = "benchmarks.sparse"

from benchmarks.harness import common  # noqa: E402
from benchmarks.harness.output import ResultsDir  # noqa: E402
from benchmarks.harness.procs import GroupFailed, free_port, run_group  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "harness", "sparse_worker.py")
OUTPUT = ResultsDir("sparse", "sparse")
# name -> (worker arguments, what a step is)
CONTENDERS = {
    "ours-sgd": (["--contender", "ours", "--optimizer", "sgd"],
                 "push + row_sparse_pull, lazy SGD on the servers"),
    "ours-adam": (["--contender", "ours", "--optimizer", "adam"],
                  "push + row_sparse_pull, lazy Adam on the servers"),
    "dense": (["--contender", "dense"], "gloo all_reduce of the dense gradient + SGD"),
    "sparse": (["--contender", "sparse"], "gloo sparse all_reduce of the COO gradient + SGD"),
}
LEARNING_RATES = {"ours-adam": 0.001}     # the others: SGD at 0.1


def _csv(ctx, param, value):
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [v for v in items if v not in CONTENDERS]
    if bad or not items:
        raise click.BadParameter(f"unknown {', '.join(bad) or 'nothing'}; choose from {', '.join(CONTENDERS)}")
    return items


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def run_contender(name: str, cfg: dict, work: str) -> dict:
    """One contender's job; returns worker 0's result. Raises click.ClickException
    (with the log's tail) when a process fails or a check fails."""
    out = os.path.join(work, f"{name}.json")
    argv = [sys.executable, WORKER, *CONTENDERS[name][0], "--rows", str(cfg["rows"]), "--dim", str(cfg["dim"]),
            "--batch", str(cfg["batch"]), "--zipf", str(cfg["zipf"]), "--steps", str(cfg["steps"]),
            "--warmup", str(cfg["warmup"]), "--lr", str(LEARNING_RATES.get(name, 0.1)), "--out", out]
    threads = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}   # what tracker.local gives ours here
    if name.startswith("ours"):
        procs = [(name, [sys.executable, "-m", "tracker.local", "-n", str(cfg["workers"]), "-s", str(cfg["servers"]),
                         "--env", "KVSTORE_TRANSPORT=tcp", "--env", "KVSTORE_LOG_LEVEL=WARNING", *argv],
                  {"PYTHONPATH": common.REPO})]
    else:
        init = f"tcp://127.0.0.1:{free_port()}"
        procs = [(f"{name} rank {r}", argv, {"RANK": str(r), "WORLD_SIZE": str(cfg["workers"]),
                                             "BENCH_INIT_METHOD": init, **threads})
                 for r in range(cfg["workers"])]
    try:
        run_group(procs, os.path.join(work, f"{name}.log"), cfg["timeout"])
    except GroupFailed as e:
        raise click.ClickException(f"{name} failed: {e}") from None
    with open(out) as f:
        return json.load(f)


def summarise(name: str, res: dict) -> dict:
    times, moved = common.stats(res["times"]), common.stats(res["tcp_bytes"])
    row = {"contender": name, "step": CONTENDERS[name][1], "time": times, "tcp_bytes": moved,
           "unique_rows": statistics.median(res["unique_rows"]), "union_rows": statistics.median(res["union_rows"]),
           "rss_start_mb": res["rss_start_mb"], "peak_rss_mb": res["peak_rss_mb"], "cpu_s": res["cpu_s"]}
    if "comm_sent" in res:
        row["comm_bytes"] = statistics.median(a + b for a, b in zip(res["comm_sent"], res["comm_received"]))
    return row


def markdown(data: dict) -> str:
    cfg, m, rows = data["config"], data["machine"], data["rows"]
    table_gb = cfg["rows"] * cfg["dim"] * 4 / 1e9
    dense = next((r for r in rows if r["contender"] == "dense"), None)
    lines = [f"## Sparse embeddings: a {cfg['rows']:,} x {cfg['dim']} fp32 table ({table_gb:.2f} GB), "
             f"W={cfg['workers']}, S={cfg['servers']}", "",
             f"Machine: {m.get('cpu_model', '?')}, {m['cpus']} cores, {m.get('mem_total', '?')}; "
             f"run {data['started']} .. {data['finished']}; {data['version']}.",
             f"Batches: {cfg['batch']:,} ids a worker a step, Zipf exponent {cfg['zipf']}: "
             f"{rows[0]['unique_rows']:,.0f} unique rows a worker, {rows[0]['union_rows']:,.0f} for all "
             f"workers together (medians). {cfg['steps']} timed steps after {cfg['warmup']} warm-up ones, "
             "each verified; medians of worker 0.", "",
             "| contender | a step | median ms | p10-p90 ms | MB a step (TCP, sent + received) | "
             "bytes: dense / this | time: dense / this | worker RSS MB: before table -> peak | load before |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        t, b = r["time"], r["tcp_bytes"]["median"]
        ratio_b = f"{dense['tcp_bytes']['median'] / b:.0f}x" if dense and b else ""
        ratio_t = f"{dense['time']['median'] / t['median']:.1f}x" if dense else ""
        lines.append(f"| {r['contender']} | {r['step']} | **{t['median'] * 1e3:.1f}** | "
                     f"{t['p10'] * 1e3:.1f}-{t['p90'] * 1e3:.1f} | {b / 1e6:.2f} | {ratio_b} | {ratio_t} | "
                     f"{r['rss_start_mb']:.0f} -> {r['peak_rss_mb']:.0f} | {r['load_before']:.2f} |")
    ours = [r for r in rows if r["contender"].startswith("ours")]
    if ours:
        lines += ["", "Ours' own count (kv.comm_stats(): messages with headers, per step): " +
                  ", ".join(f"{r['contender']} {r['comm_bytes'] / 1e6:.2f} MB" for r in ours) + "."]
    if dense:
        lines += ["", "Targets (issue 17): " + "; ".join(
            f"{r['contender']}: {dense['tcp_bytes']['median'] / r['tcp_bytes']['median']:.0f}x fewer bytes "
            f"({'met' if dense['tcp_bytes']['median'] >= 10 * r['tcp_bytes']['median'] else 'NOT met'}, >= 10x), "
            f"{dense['time']['median'] / r['time']['median']:.1f}x faster "
            f"({'met' if dense['time']['median'] >= 5 * r['time']['median'] else 'NOT met'}, >= 5x)"
            for r in ours) + "."]
    return "\n".join(lines) + "\n"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--rows", type=click.IntRange(min=1000, max=2 ** 31 - 1), default=10_000_000, show_default=True,
              help="Rows of the table.")
@click.option("--dim", type=click.IntRange(min=1), default=64, show_default=True, help="fp32 values a row.")
@click.option("-w", "--workers", type=click.IntRange(min=2), default=2, show_default=True, help="W.")
@click.option("-s", "--servers", type=click.IntRange(min=1), default=2, show_default=True, help="S (ours).")
@click.option("--batch", type=click.IntRange(min=1), default=131072, show_default=True,
              help="Ids a worker draws a step.")
@click.option("--zipf", type=click.FloatRange(min=0.5, max=3), default=1.05, show_default=True,
              help="Exponent of the Zipf law of the ids.")
@click.option("--steps", type=click.IntRange(min=1), default=10, show_default=True, help="Timed steps.")
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True, help="Untimed steps first.")
@click.option("--contenders", callback=_csv, default=",".join(CONTENDERS), show_default=True,
              help="Which to run (comma-separated), in this order.")
@click.option("--name", default="sparse", show_default=True, help="Base name of the result files.")
@click.option("--timeout", type=click.FloatRange(min=1), default=900, show_default=True,
              help="Seconds one contender may take.")
@OUTPUT.click_options
def main(rows, dim, workers, servers, batch, zipf, steps, warmup, contenders, out_dir, name, timeout):
    """Time a training step of a big embedding table: ours (row-sparse keys, lazy
    SGD and Adam on the servers) vs gloo's dense and sparse all-reduce."""
    cfg = {"rows": rows, "dim": dim, "workers": workers, "servers": servers, "batch": batch, "zipf": zipf,
           "steps": steps, "warmup": warmup, "timeout": timeout}
    table = rows * dim * 4
    need = {"dense": 2 * table, "sparse": 2 * table}      # per rank: table + gradient (sparse: + sum)
    for c in contenders:
        if c in need and need[c] * workers > 0.9 * mem_available():
            raise click.ClickException(f"{c} needs {need[c] * workers / 1e9:.1f} GB ({workers} ranks, each "
                                       f"holding the {table / 1e9:.2f} GB table and a gradient) but "
                                       f"{mem_available() / 1e9:.1f} GB are available: use --rows or "
                                       "--contenders")
    os.makedirs(out_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="kvbench-sparse-")
    data = {"machine": common.machine(), "version": common.kvstore_version(), "config": cfg,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": [], "raw": {}}
    click.echo(f"table {rows:,} x {dim} fp32 = {table / 1e9:.2f} GB, W={workers}, S={servers}, "
               f"{batch:,} ids a worker a step (Zipf {zipf}); logs in {work}", err=True)
    for c in contenders:
        load, t0 = os.getloadavg()[0], time.monotonic()
        res = run_contender(c, cfg, work)
        data["raw"][c] = res
        data["rows"].append({**summarise(c, res), "load_before": load})
        r = data["rows"][-1]
        click.echo(f"  {c}: {r['time']['median'] * 1e3:.1f} ms a step, {r['tcp_bytes']['median'] / 1e6:.2f} MB, "
                   f"{r['unique_rows']:,.0f} unique rows a worker ({r['union_rows']:,.0f} together), "
                   f"peak RSS {r['peak_rss_mb']:.0f} MB; {time.monotonic() - t0:.0f} s", err=True)
    data["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    common.write_results(out_dir, name, markdown(data), data)


if __name__ == "__main__":
    main()
