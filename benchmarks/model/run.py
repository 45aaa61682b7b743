"""A model of the time of one synchronous step, calibrated and checked on this
machine's measurements, and its predictions for a cluster.

    python -m benchmarks.model                         # uses benchmarks/results/sweep/*.json
    python -m benchmarks.model --sweep DIR --compute-ms 200
    python -m benchmarks.model --link [LINK.json ...]  # the emulated links (model_link.py)

Symbols: M bytes of gradients per worker (ResNet-50: 102.2 MB), W workers, S
server processes, B link bandwidth per machine and direction, T_c compute time
of forward + backward, k_w CPU seconds a worker spends per model byte exchanged
(send M, receive M, copy into the output), k_s CPU seconds a server spends per
byte pushed to it (receive, sum, send the result back), P cores.

One machine (what the benchmark measures: loopback, P = 2 cores shared by
everyone): every byte costs CPU, so

    T_x = max( W*M*(k_w + k_s) / P ,          all the CPU work spread over P cores
               max(M*k_w, (W*M/S)*k_s)         the chain of a worker and its server,
                 + p*(k_w + W*k_s) )           overlapped piece by piece (messages of
                                               p = KVSTORE_PIPELINE_BYTES): one piece
                                               fills and drains the pipeline

Cluster, one worker per machine, servers co-located with workers (s server
processes per machine, S = s*N), full-duplex links:

    T_wire = 2*(N-1)/N * M/B                   push out + pull out per NIC (as ring all-reduce)
    T_cpu  = max(M*k_w, M*k_s/s) + p*(k_w+k_s) worker chain and its server's share, pipelined
    T_x    = max(T_wire, T_cpu) + 2*L          L: per-request latency (one round trip)
    T_step = T_c + T_x                         exchange after backward (kv.pushpull, Trainer overlap=False)
    T_step ~ max(T_c, T_x) + M_last/B          pushes overlapping backward (Trainer overlap=True), when
                                               communication has resources of its own (links, cores)

Dedicated server machines (S_m of them, s server processes each): pipelined, the two
directions overlap, so

    T_wire = M/B * max(1, N/S_m)               a worker sends M and receives M; a server
                                               machine receives and sends N*M/S_m
    T_cpu  = max(M*k_w, (N*M/S_m)*k_s/s) + p*(k_w+k_s)
    T_x    = max(T_wire + F, T_cpu) + 2*L      F = max(N, S_m)*s*p/B: the replies trail the
                                               pushes by one round of messages (a message
                                               from every worker to every server process;
                                               benchmarks/model/link.py checks this on the
                                               emulated links); F = 0: ideally pipelined
"""

from __future__ import annotations

import glob
import json
import os
import statistics

import click

from benchmarks.harness.common import RESULTS
from benchmarks.model.link import Costs, default_files, message_bytes, paced
from benchmarks.model.link import report as link_report
from tracker.control import env

M_RESNET50 = 25_557_032 * 4


def _ours_rows(data):
    return [r for r in data["rows"] if r["kind"] == "exchange" and r["contender"] == "ours"]


def measured_costs(data) -> dict:
    """k_w, k_s (s/byte) and the median exchange time of one run's JSON. Server CPU
    is per job, divided by the exchanges the job made (needs a run without the
    latency and async tests, as the sweep)."""
    cfg = data["config"]
    m = data["summary"]["groups"][0]["bytes"]
    rows = _ours_rows(data)
    w, s = cfg["workers"], cfg["servers"]
    worker_cpu = statistics.median(r["cpu_s"] for r in rows)
    exchanges = 2 * (cfg["iters"] + cfg["warmup"])   # both modes, warm-up included
    jobs = {r["launch"]: r["server_usage_total"] for r in rows if r.get("server_usage_total")}
    server_cpu = statistics.median(sum(u["cpu_s"] for u in job.values()) / exchanges
                                   for job in jobs.values())
    times = [t for r in rows for t in r["samples"]]
    return {"W": w, "S": s, "M": m, "k_w": worker_cpu / m, "k_s": server_cpu / (w * m),
            "measured": statistics.median(times), "worker_cpu": worker_cpu,
            "server_cpu_all": server_cpu, "gloo_flat": _gloo_flat(data)}


def _gloo_flat(data):
    g = [g for g in data["summary"]["groups"]
         if g["contender"] == "gloo" and g["variant"] == "one flat all_reduce" and g["stats"]["n"]]
    return g[0]["stats"]["median"] if g else None


PIECE = 8 << 20   # KVSTORE_PIPELINE_BYTES


def predict_local(w, s, m, k_w, k_s, cores=2) -> float:
    return max(w * m * (k_w + k_s) / cores,
               max(m * k_w, w * m / s * k_s) + PIECE * (k_w + w * k_s))


def predict_cluster(n, gbit, m, k_w, k_s, servers_per_machine, latency, compute):
    b = gbit * 1e9 / 8
    wire = 2 * (n - 1) / n * m / b
    cpu = max(m * k_w, m * k_s / servers_per_machine) + PIECE * (k_w + k_s)
    tx = max(wire, cpu) + 2 * latency
    return {"wire": wire, "cpu": cpu, "T_x": tx, "T_step": compute + tx,
            "efficiency": compute / (compute + tx)}


def servers_needed(n, gbit, m, k_w, k_s, max_s=64):
    """Server processes per machine so that the (pipelined) server share fits in the
    wire time; None when the worker alone is slower than the wire (worker-bound)."""
    wire = 2 * (n - 1) / n * m / (gbit * 1e9 / 8)
    if m * k_w >= wire:
        return None
    return next((s for s in range(1, max_s + 1) if m * k_s / s <= wire), None)


def calibration(sweep_dir: str) -> tuple:
    """(every sweep run's measured_costs, k_w, k_s): the per-byte costs are the
    medians over the sweep. Raises ValueError when the directory has no sweep."""
    runs = []
    for path in sorted(glob.glob(os.path.join(sweep_dir, "*.json"))):
        with open(path) as f:
            data = json.load(f)
        if _ours_rows(data):
            runs.append(measured_costs(data))
    if not runs:
        raise ValueError(f"no sweep results in {sweep_dir}: run the sweep first (see docs/performance.md)")
    return (runs, statistics.median(r["k_w"] for r in runs),
            statistics.median(r["k_s"] for r in runs))


def report(sweep_dir: str, compute_ms: float, latency_us: float, calibrate: str,
           server_procs: int = 4) -> str:
    try:
        runs, k_w, k_s = calibration(sweep_dir)
    except ValueError as e:
        return str(e)
    cal = next((r for r in runs if f"w{r['W']}-s{r['S']}" == calibrate), runs[0])
    lines = [f"Calibration (medians over the sweep): k_w = {k_w * 1e9:.2f} ns/byte "
             f"(worker CPU {k_w * cal['M'] * 1e3:.0f} ms per {cal['M'] / 1e6:.1f} MB exchange), "
             f"k_s = {k_s * 1e9:.2f} ns/byte pushed (server CPU {k_s * cal['M'] * 1e3:.0f} ms "
             "per worker's pushes).", "",
             "| W | S | k_w ns/B | k_s ns/B | predicted ms | measured ms | error | gloo flat ms |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(runs, key=lambda r: (r["W"], r["S"])):
        pred = predict_local(r["W"], r["S"], r["M"], k_w, k_s)
        gf = f"{r['gloo_flat'] * 1e3:.0f}" if r["gloo_flat"] and r["W"] > 1 else ""
        lines.append(f"| {r['W']} | {r['S']} | {r['k_w'] * 1e9:.2f} | {r['k_s'] * 1e9:.2f} | "
                     f"{pred * 1e3:.0f} | {r['measured'] * 1e3:.0f} | "
                     f"{(r['measured'] / pred - 1) * 100:+.0f}% | {gf} |")
    m = M_RESNET50
    lat = latency_us * 1e-6
    comp = compute_ms * 1e-3
    lines += ["", f"Cluster predictions for ResNet-50 (M = {m / 1e6:.1f} MB), T_c = {compute_ms:.0f} ms "
              f"(no overlap), L = {latency_us:.0f} us, one worker per machine, servers co-located "
              "with workers. 'wire' is the bandwidth bound any implementation meets; 'ours' keeps "
              "this machine's k_w and k_s (Python + ZeroMQ + kernel TCP):", "",
              "| machines | link | wire T_x ms | ours T_x ms, 1 server/machine | servers/machine "
              "for wire speed | ours T_x ms, 4 servers/machine | ours T_step ms (4 srv) | "
              "wire-bound T_step ms | ours scaling eff. | wire-bound eff. |",
              "|---:|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for gbit in (10, 100):
        for n in (2, 4, 8, 16, 32, 64):
            need = servers_needed(n, gbit, m, k_w, k_s)
            one = predict_cluster(n, gbit, m, k_w, k_s, 1, lat, comp)
            four = predict_cluster(n, gbit, m, k_w, k_s, 4, lat, comp)
            ideal = predict_cluster(n, gbit, m, 0, 0, 1, lat, comp)
            need_text = str(need) if need else f"worker-bound (needs k_w M <= {one['wire'] * 1e3:.0f} ms)"
            lines.append(f"| {n} | {gbit} Gbit/s | {one['wire'] * 1e3:.1f} | {one['T_x'] * 1e3:.0f} | "
                         f"{need_text} | {four['T_x'] * 1e3:.0f} | {four['T_step'] * 1e3:.0f} | "
                         f"{ideal['T_step'] * 1e3:.0f} | {four['efficiency']:.2f} | "
                         f"{ideal['efficiency']:.2f} |")
    return "\n".join(lines + [""] + dedicated_table(m, k_w, k_s, server_procs, lat))


RATIOS = ((1, 8), (1, 4), (1, 2), (1, 1))   # server machines per worker machine
CLOSE = 0.05   # "worth buying": the fewest server machines within 5 % of the best


def predict_dedicated(n, gbit, m, k_w, k_s, server_machines, server_procs, latency,
                      limit="auto", chunk=env.default("KVSTORE_CHUNK_BYTES")):
    """Ours with n worker machines (one worker each) and ``server_machines`` machines of
    ``server_procs`` server processes, in seconds. Pipelined, the two directions
    overlap: the wire is M/B*max(1, n/S_m), against the CPU chain (the worker's M*k_w,
    a server process's share of the n*M/S_m bytes its machine sums, overlapped message
    by message). "T_x" adds what today's messages cost on top (model_link.py): the
    replies trail the pushes by one round of messages, a message from every worker to
    every server process; "T_x_pipelined" leaves that round out."""
    b = gbit * 1e9 / 8
    wire = m / b * max(1, n / server_machines)

    def parts(limit):
        p = message_bytes(m / (server_machines * server_procs), limit, chunk)
        fill = max(n, server_machines) * server_procs * p / b
        cpu = max(m * k_w, n * m / server_machines * k_s / server_procs) + p * (k_w + k_s)
        return {"wire": wire, "fill": fill, "cpu": cpu, "message": p,
                "T_x": max(wire + fill, cpu) + 2 * latency,
                "T_x_pipelined": max(wire, cpu) + 2 * latency}
    if limit == "auto":
        limit = paced(lambda lim: parts(lim)["T_x"], m)
    return parts(limit)


def fewest(options: list[dict], key: str) -> int:
    """The index of the fewest server machines whose ``key`` is within CLOSE of the best."""
    best = min(o[key] for o in options)
    return next(i for i, o in enumerate(options) if o[key] <= best * (1 + CLOSE))


def dedicated_table(m, k_w, k_s, server_procs, latency) -> list[str]:
    """Section 6's table of dedicated server machines against co-location and a ring."""
    procs = f"{server_procs} server process{'es' if server_procs > 1 else ''}"
    ratios = " · ".join(f"N/{d}" if d > 1 else "N" for _, d in RATIOS)
    lines = [f"Dedicated server machines (S_m of them, {procs} each; one worker per worker "
             f"machine; L = {latency * 1e6:.0f} us; KVSTORE_CHUNK_BYTES and KVSTORE_PIPELINE_BYTES "
             "at their defaults). A server machine sums N*M/S_m bytes per exchange: "
             + ", ".join(f"{m * k_s * d:.2f} s" for _, d in RATIOS)
             + f" of CPU at k_s for S_m = {ratios} (less where S_m rounds up to a whole "
             f"machine), spread over its {procs}. 'ring' is the wire "
             "bound 2(N-1)/N*M/B; co-located is ours above (4 servers/machine); 'pipelined' "
             "is max(wire, CPU) + 2L, 'today' adds the round of messages the replies trail "
             f"by; 'worth buying' is the fewest S_m/N within {CLOSE * 100:.0f} % of the best "
             "of the four:", "",
             f"| machines N | link | ring T_x ms | co-located, ours T_x ms | dedicated, wire ms "
             f"(S_m = {ratios}) | dedicated, ours pipelined T_x ms | worth buying | its T_x / "
             "ring | dedicated, ours today T_x ms | worth buying today | its T_x / ring |",
             "|---:|---|---:|---:|---|---|---|---:|---|---|---:|"]
    for gbit in (10, 100):
        for n in (2, 4, 8, 16, 32, 64):
            ring = 2 * (n - 1) / n * m / (gbit * 1e9 / 8)
            colo = predict_cluster(n, gbit, m, k_w, k_s, 4, latency, 0)["T_x"]
            sm = [max(1, -(-n * a // d)) for a, d in RATIOS]
            ours = [predict_dedicated(n, gbit, m, k_w, k_s, s, server_procs, latency) for s in sm]
            cells = [f"{n}", f"{gbit} Gbit/s", f"{ring * 1e3:.1f}", f"{colo * 1e3:.0f}",
                     " · ".join(f"{o['wire'] * 1e3:.0f}" for o in ours)]
            for key in ("T_x_pipelined", "T_x"):
                pick = fewest(ours, key)
                a, d = RATIOS[pick]
                cells += [" · ".join(f"{o[key] * 1e3:.0f}" for o in ours),
                          f"{a}/{d} (S_m = {sm[pick]})", f"{ours[pick][key] / ring:.2f}x"]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--sweep", "sweep_dir", default=os.path.join(RESULTS, "sweep"), show_default=True,
              type=click.Path(file_okay=False), help="Directory of pushpull.py JSON results.")
@click.option("--compute-ms", type=float, default=200.0, show_default=True,
              help="Forward+backward time per step assumed for the cluster predictions.")
@click.option("--latency-us", type=float, default=600.0, show_default=True,
              help="Per-request round trip (our measured small-key exchange here).")
@click.option("--calibrate", default="w2-s2", show_default=True, help="Reference configuration.")
@click.option("--server-procs", type=click.IntRange(1), default=4, show_default=True,
              help="Server processes per dedicated server machine (each with its own core).")
@click.option("--link", "link", is_flag=True,
              help="Check the link model against benchmarks.link JSONs (FILES; default: the runs "
                   "of record) instead.")
@click.argument("files", nargs=-1, type=click.Path(exists=True, dir_okay=False))
def main(sweep_dir, compute_ms, latency_us, calibrate, server_procs, link, files):
    """Check the step-time model against the sweep and print cluster predictions; with
    --link, against the emulated-link runs (benchmarks/model/link.py)."""
    if files and not link:
        raise click.UsageError("FILES are benchmarks.link JSONs: they go with --link")
    if not link:
        click.echo(report(sweep_dir, compute_ms, latency_us, calibrate, server_procs))
        return
    try:
        _, k_w, k_s = calibration(sweep_dir)
        click.echo(link_report(list(files) or default_files(), Costs(k_w, k_s, latency_us * 1e-6)))
    except ValueError as e:
        raise click.ClickException(str(e)) from None


if __name__ == "__main__":
    main()
