"""What replication costs a step over an emulated link: the failover benchmark's job
(benchmarks/failover/worker.py, dist_sync pushpulls, SGD with momentum on the
servers, deterministic sums) with and without ``KVSTORE_REPLICAS=1``, on emulated
machines (benchmarks/harness/netns.py ``Cluster``: a network namespace each, its own
rate-limited full-duplex link to one switch).

    sudo python -m benchmarks.failover --link 1gbit                     # dedicated:4x2 and colo:4
    python -m benchmarks.failover --link 1gbit --layouts dedicated:4x4 --launches 3

Layouts are benchmarks.link's (benchmarks/harness/layouts.py): ``dedicated:WxS``, W
worker hosts and S server hosts (every byte crosses a link), and ``colo:W``, a worker
and a server on each of W hosts. Every launch round runs each layout without and
with replicas, in a rotating order (interleaved: the machine's load drifts alike
for both); per variant the table gives the median over launches of each launch's
median step, the launches' range, the ratio with/without replicas per launch round
(its median and range), and the wire bound: the busiest link direction's bytes per
step / the rate. Replication adds one copy of each server's share per round, from
the primary's host to its backup's (``N/S`` each way on a server host, N one
worker's bytes), so on dedicated hosts the bound grows from ``W*N/S`` to
``(W+1)*N/S``: a ratio of (W+1)/W at best. Where the time goes: each launch's
bytes per step on every host's interface beside the model's, the servers' CPU time
and worker 0's (the whole launch, start-up included: medians over launches), and
the largest server's peak RSS (the replicas' memory).

The processes inherit the environment, so ``KVSTORE_CHUNK_BYTES=524288 python -m
benchmarks.failover --link 1gbit`` measures with smaller chunks (the record and the
table name every KVSTORE_ setting inherited). Needs root; without it prints a
"skipped" line. Reported, never asserted.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import tempfile

from benchmarks.failover.run import timings
from benchmarks.harness import layouts as layout_specs
from benchmarks.harness.contenders.base import read_result
from benchmarks.harness.contenders.ours import SERVER
from benchmarks.harness.layouts import Layout
from benchmarks.harness.netns import Cluster, Failed, parse_rate, ps_job, raw_check
from benchmarks.harness.procs import GroupFailed, run_group

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, "benchmarks", "failover", "worker.py")
WARMUP = 2    # steps left out of a launch's median (connections, first allocations)


def wire_bytes(layout: Layout, nbytes: float, replicas: bool) -> dict[str, tuple[float, float]]:
    """{host: (bytes it sends, bytes it receives)} per step: benchmarks.link's model
    (layouts.py) plus, with replicas, each server's share of the round's sum sent
    once to its backup on the next server's host (``N/S`` each way on a server host;
    a backup on the same host sends nothing over the link)."""
    out = {h: list(pair) for h, pair in layout.link_bytes("pushpull", nbytes).items()}
    if replicas:
        hosts = layout.server_hosts
        for r, h in enumerate(hosts):
            backup = hosts[(r + 1) % len(hosts)]
            if backup != h:
                out[h][0] += nbytes / layout.servers
                out[backup][1] += nbytes / layout.servers
    return {h: (tx, rx) for h, (tx, rx) in out.items()}


def bound_ms(layout: Layout, nbytes: float, replicas: bool, bytes_per_s: float) -> float:
    """The wire bound of a step: the busiest link direction's bytes / the rate."""
    return 1e3 * max(max(pair) for pair in wire_bytes(layout, nbytes, replicas).values()) / bytes_per_s


def launch(cluster: Cluster, layout: Layout, replicas: bool, env: dict, work: str, tag: str,
           timeout: float) -> dict:
    """One job of ``layout`` (with or without replicas); worker 0's step times and
    every host's bytes per step. Failed when a process fails or the weights differ."""
    stats = os.path.join(work, f"{tag}-servers")
    os.makedirs(stats)
    extra = {**env, "BENCH_SERVER_STATS": stats, **({"KVSTORE_REPLICAS": "1"} if replicas else {})}
    procs = ps_job(cluster, layout.workers, layout.servers, [sys.executable, SERVER],
                   [sys.executable, WORKER], extra, server_hosts=layout.server_hosts,
                   worker_hosts=layout.worker_hosts)
    log = os.path.join(work, f"{tag}.log")
    before = cluster.host_counters()
    try:
        run_group(procs, log, timeout)
    except GroupFailed as e:
        raise Failed(f"{tag}: {e}") from None
    counted = Cluster.counted(before, cluster.host_counters(), layout.hosts)
    with open(log) as f:
        text = f.read()
    ends, _, digest = timings(text)
    steps = int(env["STEPS"])
    if len(ends) != steps or digest is None:
        raise Failed(f"{tag}: worker 0 printed {len(ends)} of {steps} steps (digest {digest})")
    gaps = [b - a for a, b in zip(ends[WARMUP:], ends[WARMUP + 1:])]
    servers = [read_result(os.path.join(stats, f), "server stats") for f in sorted(os.listdir(stats))
               if f.endswith(".json")]
    cpu = re.search(r"^cpu (\d+\.\d+)$", text, re.M)
    return {"median_step_ms": 1e3 * statistics.median(gaps), "steps_ms": [round(1e3 * g, 2) for g in gaps],
            "digest": digest, "bytes": counted, "seconds": round(ends[-1] - ends[0], 3),
            "servers_cpu_s": round(sum(u["cpu_s"] for u in servers), 3),
            "servers_peak_rss_mb": round(max((u["max_rss_mb"] for u in servers), default=0), 1),
            "worker0_cpu_s": float(cpu.group(1)) if cpu else None}


def measure(rate: str, layouts: list[Layout], steps: int, keys: int, size: int, launches: int,
            out_dir: str, raw_seconds: float = 1.0) -> dict | None:
    """Every launch round runs each layout without and with replicas (order rotating);
    the record (None where the emulated network cannot be built)."""
    hosts = layout_specs.hosts_for(layouts)
    cluster = Cluster(hosts)
    if not cluster.up_or_skip():
        return None
    env = {"KVSTORE_DETERMINISTIC": "1", "STEPS": str(steps), "KEYS": str(keys), "SIZE": str(size),
           "KVSTORE_LOG_LEVEL": "WARNING", "KVSTORE_TIMEOUT": "120"}
    nbytes = keys * size * 4
    variants = [(layout, replicas) for layout in layouts for replicas in (False, True)]
    rows: list[dict] = []
    # the processes inherit this environment (run_group): its KVSTORE_ settings apply to every launch
    inherited = {k: v for k, v in sorted(os.environ.items()) if k.startswith("KVSTORE_") and k not in env}
    record: dict = {"rate": rate, "hosts": hosts, "steps": steps, "warmup_steps": WARMUP, "keys": keys,
                    "size": size, "bytes_per_worker": nbytes, "launches": launches, "settings": inherited,
                    "rows": rows}
    work = tempfile.mkdtemp(prefix="failover-link-")     # the launches' logs: scratch, not results
    record["logs"] = work
    try:
        record["qdisc"] = cluster.set_rate(rate)
        record["raw"] = raw_check(cluster, rate, raw_seconds)
        timeout = 120 + steps * 4 * bound_ms(max(layouts, key=lambda x: x.workers), nbytes, True,
                                             parse_rate(rate) / 8) / 1e3
        for n in range(launches):
            order = variants[n % len(variants):] + variants[:n % len(variants)]
            for layout, replicas in order:
                load = os.getloadavg()[0]
                tag = f"{layout.key}-{'replicas' if replicas else 'plain'}-{n}"
                row = {"layout": layout.key, "replicas": replicas, "launch": n, "load_1min": round(load, 2)}
                try:
                    row.update(launch(cluster, layout, replicas, env, work, tag, timeout))
                except Failed as e:
                    row["failed"] = str(e)[-3000:]
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k not in ("steps_ms", "failed")}),
                      file=sys.stderr, flush=True)
    finally:
        cluster.down()
    # deterministic sums: the final weights depend on W only, with or without replicas
    by_w: dict[int, set] = {}
    for r in rows:
        if "digest" in r:
            by_w.setdefault(layout_specs.parse(r["layout"]).workers, set()).add(r["digest"])
    record["one_digest_per_w"] = all(len(d) == 1 for d in by_w.values())
    return record


def table(record: dict) -> str:
    """The markdown table of a :func:`measure` record."""
    bps = parse_rate(record["rate"]) / 8
    nbytes = record["bytes_per_worker"]
    rows = record["rows"]
    raw = record.get("raw", {})
    loads = [r["load_1min"] for r in rows]
    lines = [f"Link {record['rate']} per host, each direction (raw TCP both ways at once: "
             f"{raw.get('a_to_b_gbit', 0):.2f} / {raw.get('b_to_a_gbit', 0):.2f} Gbit/s); "
             f"{record['keys']} keys x {record['size']} fp32 ({nbytes / 1e6:.1f} MB per worker), "
             f"{record['steps']} steps a launch (the first {record['warmup_steps']} left out), "
             f"{record['launches']} launches per variant, interleaved; deterministic sums; load average "
             f"(1 min) {min(loads, default=0):.1f}-{max(loads, default=0):.1f} over the launches"
             + "".join(f"; {k}={v}" for k, v in record.get("settings", {}).items()) + ".", "",
             "| layout | replicas | launches ok | median step ms | launches' range ms | wire bound ms | "
             "measured / bound | with / without replicas: median (range) over launch rounds | "
             "servers' CPU s (all servers, whole launch) | worker 0's CPU s | largest server peak RSS MB |",
             "|---|---|---:|---:|---|---:|---:|---|---:|---:|---:|"]
    for key in dict.fromkeys(r["layout"] for r in rows):
        layout = layout_specs.parse(key)
        ratios = []
        for n in range(record["launches"]):
            pair = {r["replicas"]: r.get("median_step_ms") for r in rows if r["layout"] == key and r["launch"] == n}
            if pair.get(True) and pair.get(False):
                ratios.append(pair[True] / pair[False])
        for replicas in (False, True):
            mine = [r["median_step_ms"] for r in rows if r["layout"] == key and r["replicas"] == replicas
                    and "median_step_ms" in r]
            bound = bound_ms(layout, nbytes, replicas, bps)
            med = statistics.median(mine) if mine else None
            ratio = "" if not replicas or not ratios else \
                f"**{statistics.median(ratios):.2f}x** ({min(ratios):.2f}-{max(ratios):.2f})"
            ok = [r for r in rows if r["layout"] == key and r["replicas"] == replicas and "median_step_ms" in r]

            def median_of(field: str, fmt: str) -> str:
                got = [r[field] for r in ok if r.get(field) is not None]
                return format(statistics.median(got), fmt) if got else "-"
            lines.append(f"| {layout.describe()} | {'yes' if replicas else 'no'} | {len(mine)} | "
                         f"{'-' if med is None else f'{med:.1f}'} | "
                         f"{f'{min(mine):.1f}-{max(mine):.1f}' if mine else '-'} | {bound:.1f} | "
                         f"{'-' if med is None else f'{med / bound:.2f}'} | {ratio} | "
                         f"{median_of('servers_cpu_s', '.2f')} | {median_of('worker0_cpu_s', '.2f')} | "
                         f"{median_of('servers_peak_rss_mb', '.0f')} |")
    lines += ["", f"Final weights: {'one digest per W in every launch, with or without replicas' if record['one_digest_per_w'] else 'DIFFERENT digests for one W'}.",
              "", "Bytes per step on each host's interface (sent / received, MB: a launch's bytes / its steps, "
              "so init and the last pull add about a step's worth; median over the launches) against the model:", "", "| layout | replicas | host | sent | model | received | model |",
              "|---|---|---|---:|---:|---:|---:|"]
    for key in dict.fromkeys(r["layout"] for r in rows):
        layout = layout_specs.parse(key)
        for replicas in (False, True):
            mine = [r for r in rows if r["layout"] == key and r["replicas"] == replicas and "bytes" in r]
            if not mine:
                continue
            model = wire_bytes(layout, nbytes, replicas)
            for h in layout.hosts:
                per_step = {d: statistics.median(r["bytes"][h][d] / (record["steps"] + 0.0) for r in mine
                                                 if r["bytes"][h][d] is not None) for d in ("tx", "rx")}
                lines.append(f"| {key} | {'yes' if replicas else 'no'} | {h} | {per_step['tx'] / 1e6:.2f} | "
                             f"{model[h][0] / 1e6:.2f} | {per_step['rx'] / 1e6:.2f} | {model[h][1] / 1e6:.2f} |")
    failed = [r for r in rows if "failed" in r]
    if failed:
        lines += ["", f"{len(failed)} launches failed:"] + [f"- {r['layout']} replicas={r['replicas']} "
                                                           f"launch {r['launch']}: {r['failed'][:300]}" for r in failed]
    return "\n".join(lines) + "\n"
