"""A big embedding table spread over dedicated server hosts on emulated links:
the bytes on every host's link against the wire model, and the step time against
the link's bound.

    sudo python -m benchmarks.sparse_link                       # 10,000,000 x 64 fp32, W=2 on A, B; S=2 on S0, S1
    python -m benchmarks.sparse_link -w 4 -s 4 --rate 1gbit
    python -m benchmarks.sparse_link --rows 200000 --batch 4096 --steps 2   # small, for tests

The hosts (benchmarks/harness/netns.py ``Cluster``: a network namespace each, its own
rate-limited full-duplex link to one bridge) are worker hosts A, B, ... and server
hosts S0, S1, ...; worker r runs on worker host r, server s on server host s, the
scheduler on A. The workers are benchmarks/harness/sparse_worker.py's ``ours`` contender
(the table on the servers, RowInit zeros; a step is push of the batch's RowSparse
gradient + row_sparse_pull of its rows, lazy SGD on the servers, each step
verified), started with the environment a launcher would set
(benchmarks/harness/placement.py ``ps_job``); every byte between hosts crosses their links.

The wire model (:func:`model_bytes`) counts what the protocol carries for the
steps run (warm-up included), from the same seeded batches the workers draw: a
worker with ``n`` unique rows on server s sends it ``n`` row ids (8 bytes) and
``n`` rows (4 * dim bytes) in the push, ``n`` row ids in the pull, and receives
``n`` rows. Row r lives on server r % S (kvstore/rows/layout.py). Headers, the
control plane (registration, barriers) and TCP/IP framing are not modelled: the
ratio measured / model says how much they add. The bound of a step is the busiest
link direction's modelled bytes of one step over the link rate.

Writes <name>.md and <name>.json to --out-dir (default: a new scratch directory;
``--record``: benchmarks/results/sparse). Needs root (network namespaces);
without it prints a "skipped" line and exits 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time

import click
import numpy as np

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    __package__ = "benchmarks.sparse_link"

from benchmarks.harness import common  # noqa: E402
from benchmarks.harness.output import ResultsDir  # noqa: E402
from benchmarks.harness.contenders.base import read_result  # noqa: E402
from benchmarks.harness.layouts import server_host, worker_host  # noqa: E402
from benchmarks.harness.netns import Cluster, on_sigterm, parse_rate  # noqa: E402
from benchmarks.harness.placement import expected_transports, ps_job, server_urls  # noqa: E402
from benchmarks.harness.procs import GroupFailed, run_group  # noqa: E402
from benchmarks.harness.contenders.ours import SERVER  # noqa: E402
from benchmarks.harness import sparse_worker  # noqa: E402
from benchmarks.harness.sparse_worker import Batches  # noqa: E402

WORKER = sparse_worker.__file__   # the sparse experiments' worker, its "ours" contender
OUTPUT = ResultsDir("sparse-link", "sparse")
ID_BYTES = 8                   # row ids travel as int64


def model_bytes(cfg: dict) -> dict:
    """{host: {"tx", "rx"}}: the payload bytes every host sends and receives over
    the run's steps (warm-up included), by the wire model of the module's docstring."""
    W, S, row_bytes = cfg["workers"], cfg["servers"], 4 * cfg["dim"]
    batches = Batches(argparse.Namespace(seed=0, batch=cfg["batch"], zipf=cfg["zipf"], rows=cfg["rows"],
                                         dim=cfg["dim"]), W)
    out = {h: {"tx": 0, "rx": 0} for h in [worker_host(r) for r in range(W)] + [server_host(s) for s in range(S)]}
    for step in range(cfg["warmup"] + cfg["steps"]):
        for r in range(W):
            rows, _ = batches.of(r, step)
            per_server = np.bincount(rows % S, minlength=S)
            for s, n in enumerate(per_server.tolist()):
                up, down = n * (2 * ID_BYTES + row_bytes), n * row_bytes   # push + pull's ids; pulled rows
                out[worker_host(r)]["tx"] += up
                out[worker_host(r)]["rx"] += down
                out[server_host(s)]["rx"] += up
                out[server_host(s)]["tx"] += down
    return out


def run(cluster: Cluster, cfg: dict, work: str) -> dict:
    """One job over the cluster; worker 0's result plus the bytes every host's link
    carried while it ran."""
    out = os.path.join(work, "ours.json")
    W, S = cfg["workers"], cfg["servers"]
    worker = [sys.executable, WORKER, "--contender", "ours", "--optimizer", "sgd", "--rows", str(cfg["rows"]),
              "--dim", str(cfg["dim"]), "--batch", str(cfg["batch"]), "--zipf", str(cfg["zipf"]),
              "--steps", str(cfg["steps"]), "--warmup", str(cfg["warmup"]), "--lr", "0.1", "--out", out]
    workers_on = [worker_host(r) for r in range(W)]
    servers_on = [server_host(s) for s in range(S)]
    procs = ps_job(cluster, W, S, [sys.executable, SERVER], worker,
                   {"KVSTORE_LOG_LEVEL": "WARNING", "BENCH_SERVER_STATS": work,
                    "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
                   server_hosts=servers_on, worker_hosts=workers_on)
    before = cluster.host_counters()
    try:
        run_group(procs, os.path.join(work, "ours.log"), cfg["timeout"])
    except GroupFailed as e:
        raise click.ClickException(f"the job failed: {e}") from None
    after = cluster.host_counters()
    res = read_result(out, "ours")
    kinds, urls = res.get("transports"), res.get("server_urls") or []
    want = expected_transports(S, servers_on, workers_on[0])
    if kinds is not None and list(kinds) != want:
        raise click.ClickException(f"worker 0 used {kinds}, not {want}")
    where = server_urls(cluster, S, servers_on)
    if urls and not (len(urls) == len(where) and all(u.startswith(w) for u, w in zip(urls, where))):
        raise click.ClickException(f"servers at {urls}; expected {where} (tcp, each on its host)")
    res["link_bytes"] = cluster.counted(before, after)
    return res


def summarise(cfg: dict, res: dict, model: dict, bits_per_s: float) -> dict:
    times = common.stats(res["times"])
    links = {}
    for h, want in model.items():
        got = res["link_bytes"][h]
        links[h] = {d: {"measured": got[d], "model": want[d],
                        "ratio": (got[d] / want[d]) if got[d] is not None and want[d] else None}
                    for d in ("tx", "rx")}
    steps = cfg["warmup"] + cfg["steps"]
    busiest = max(max(v["tx"], v["rx"]) for v in model.values()) / steps
    return {"time": times, "links": links, "bound_s": busiest / (bits_per_s / 8),
            "busiest_step_bytes": busiest, "unique_rows": float(np.median(res["unique_rows"])),
            "peak_rss_mb": res["peak_rss_mb"], "rss_start_mb": res["rss_start_mb"]}


def markdown(data: dict) -> str:
    cfg, s, m = data["config"], data["summary"], data["machine"]
    table_gb = cfg["rows"] * cfg["dim"] * 4 / 1e9
    t = s["time"]
    lines = [f"## A {cfg['rows']:,} x {cfg['dim']} fp32 table ({table_gb:.2f} GB) on {cfg['servers']} dedicated "
             f"server host(s), {cfg['workers']} worker host(s), every link {cfg['rate']}", "",
             f"Machine: {m.get('cpu_model', '?')}, {m['cpus']} cores, {m.get('mem_total', '?')} (every process "
             f"of every emulated host shares them); run {data['started']} .. {data['finished']}; "
             f"{data['version']}.",
             f"Batches: {cfg['batch']:,} ids a worker a step (Zipf {cfg['zipf']}), {s['unique_rows']:,.0f} unique "
             f"rows a worker (median); {cfg['steps']} timed steps after {cfg['warmup']} warm-up, each verified.",
             "", f"Step time (worker 0, median): **{t['median'] * 1e3:.1f} ms** (p10-p90 {t['p10'] * 1e3:.1f}-"
             f"{t['p90'] * 1e3:.1f}); the link bound (busiest link direction's modelled bytes of a step, "
             f"{s['busiest_step_bytes'] / 1e6:.2f} MB, at {cfg['rate']}): {s['bound_s'] * 1e3:.1f} ms; "
             f"worker 0's RSS {s['rss_start_mb']:.0f} -> {s['peak_rss_mb']:.0f} MB.", "",
             "Bytes on each host's link over the whole job (all steps, warm-up included, plus registration "
             "and barriers) against the wire model (payload only):", "",
             "| host | sent MB | model MB | sent / model | received MB | model MB | received / model |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for h, v in s["links"].items():
        cells = []
        for d in ("tx", "rx"):
            got, want, ratio = v[d]["measured"], v[d]["model"], v[d]["ratio"]
            cells += ["?" if got is None else f"{got / 1e6:.2f}", f"{want / 1e6:.2f}",
                      "" if ratio is None else f"{ratio:.3f}"]
        lines.append(f"| {h} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--rows", type=click.IntRange(min=1000, max=2 ** 31 - 1), default=10_000_000, show_default=True,
              help="Rows of the table.")
@click.option("--dim", type=click.IntRange(min=1), default=64, show_default=True, help="fp32 values a row.")
@click.option("-w", "--workers", type=click.IntRange(min=1, max=26), default=2, show_default=True,
              help="W worker hosts (A, B, ...).")
@click.option("-s", "--servers", type=click.IntRange(min=1, max=16), default=2, show_default=True,
              help="S server hosts (S0, S1, ...).")
@click.option("--rate", default="1gbit", show_default=True, help="Every link's rate (tc syntax).")
@click.option("--batch", type=click.IntRange(min=1), default=131072, show_default=True,
              help="Ids a worker draws a step.")
@click.option("--zipf", type=click.FloatRange(min=0.5, max=3), default=1.05, show_default=True,
              help="Exponent of the Zipf law of the ids.")
@click.option("--steps", type=click.IntRange(min=1), default=10, show_default=True, help="Timed steps.")
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True, help="Untimed steps first.")
@click.option("--name", default="sparse-link", show_default=True, help="Base name of the result files.")
@click.option("--timeout", type=click.FloatRange(min=1), default=1200, show_default=True,
              help="Seconds the job may take.")
@OUTPUT.click_options
def main(rows, dim, workers, servers, rate, batch, zipf, steps, warmup, out_dir, name, timeout):
    """A big row-sparse table over dedicated server hosts on emulated links: bytes per
    link against the wire model, step time against the link bound."""
    cfg = {"rows": rows, "dim": dim, "workers": workers, "servers": servers, "rate": rate, "batch": batch,
           "zipf": zipf, "steps": steps, "warmup": warmup, "timeout": timeout}
    try:
        bits = parse_rate(rate)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--rate")
    signal.signal(signal.SIGTERM, on_sigterm)
    cluster = Cluster([worker_host(r) for r in range(workers)] + [server_host(s) for s in range(servers)])
    work = tempfile.mkdtemp(prefix="kvbench-sparse-link-")
    data = {"command": " ".join(["python -m benchmarks.sparse_link", *sys.argv[1:]]),
            "machine": common.machine(), "version": common.kvstore_version(), "config": cfg,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "namespaces": [cluster.switch, *cluster.ns.values()]}
    try:
        if not cluster.up_or_skip():
            return
        data["qdisc"] = cluster.set_rate(rate)
        click.echo(f"cluster: {', '.join(f'{h} {cluster.addr[h]}' for h in cluster.hosts)}; table {rows:,} x "
                   f"{dim}; logs in {work}", err=True)
        res = run(cluster, cfg, work)
    finally:
        for problem in cluster.down():
            click.echo(f"cleanup: {problem}", err=True)
    data["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    data["raw"] = res
    data["model"] = model_bytes(cfg)
    data["summary"] = summarise(cfg, res, data["model"], bits)
    os.makedirs(out_dir, exist_ok=True)
    common.write_results(out_dir, name, markdown(data), data)


if __name__ == "__main__":
    main()
