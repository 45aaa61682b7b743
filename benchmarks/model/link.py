"""The step-time model against benchmarks.link's measured exchanges (emulated links,
docs/performance.md 2.6 and 6), and the message size both it and the cluster table
of benchmarks/model/run.py assume.

    python -m benchmarks.model --link                       # the run-of-record files
    python -m benchmarks.model --link RUN1/link.json RUN2/link.json     # any runs

A link.json holds, per link rate and layout (benchmarks/harness/layouts.py), the median time
of one exchange of N bytes per worker. Every point is predicted from the run's own
link rate and settings and section 6's CPU calibration; nothing is fitted per point.

  B   the raw TCP payload rate measured in that run (``rates[rate]["raw"]``, both
      directions at once; ~5 % under the tc rate: TCP/IP framing)
  D   bytes on the busiest link direction (layouts.py: a compressed push carries f*N,
      f = 1/16 for 2bit, the reply N)
  p   a message: each worker cuts every server's share of a call (N/S) into runs of
      whole chunks (KVSTORE_CHUNK_BYTES, at least one) of at most KVSTORE_PIPELINE_BYTES;
      with ``auto`` (kvstore/transport/pace.py) at most 10 ms of the rate the worker's
      calls reach: its network bytes / T, so p is a fixed point of this model, found by
      iterating from 8 MiB (the warm-up call's size). (About: keys smaller than a
      chunk make some messages smaller.) The pace's window, 8 messages per server in
      flight, holds 8 rounds; the pipeline needs about two, so it does not bind.
  L   one request round trip; k_w, k_s the per-byte CPU of section 6; P cores

gloo's ring: T = D/B + 2L. It keeps two segments in flight and sends each as soon as
the one before is reduced, so no direction waits but for one segment's reduction at
the turn from reduce-scatter to all-gather (a few ms of CPU): its fill is negligible.

Ours: a server answers a message once every worker's copy arrived, so the replies
trail the pushes by one round (a message from every worker to every server):

  co-located   every direction carries pushes and replies: while the first round
               travels it is busy with pushes, and the last replies follow pushes
               already queued.                       T_link = D/B
  dedicated    a worker's receive direction (a server's send direction) carries only
               replies: it idles while the first round arrives, F = max(W,S)*f*p/B (a
               server's link brings it W messages, a worker's takes S), and the last
               round's replies, R = max(W,S)*p/B, leave after the last pushes arrived.
                                 T_link = max(F + D_reply/B, D_push/B + R)
               (= D/B + max(W,S)*p/B uncompressed: one round, not two, since the
               receive direction, once started, runs at the full rate)

  T = max(T_link, W*N*(k_w + k_s)/P) + p*(k_w + k_s) + 2L
      (every process of the run shares this machine's P cores; the last message's
      sum and copy, and a round trip at each end, follow the last byte)
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import statistics

from benchmarks.harness.common import RESULTS
from benchmarks.harness.layouts import PUSH_FRACTION, parse
from benchmarks.harness.layouts import VARIANTS
from kvstore.transport import pace
from tracker.control import env

# the runs of record; benchmarks/results/link/ keeps only its link.md (no json) so far
RUNS_OF_RECORD = ("dedicated/link.json", "dedicated/pipeline-1mb/link.json", "link/*.json")
# Runs started before kvstore/transport/pace.py existed (commit e95ccbc; the run of
# record of 04:42 ran it from the working tree) sent messages of a fixed 8 MiB
# (pace.MAX_BYTES, the old default of KVSTORE_PIPELINE_BYTES), and their link.json
# records only the variables a run set (later runs record config.effective).
PACE_SINCE = "2026-11-25 04:00"
WITHIN = 0.15   # issue 18: every measured point within 15 % of the model


@dataclasses.dataclass(frozen=True)
class Costs:
    """What the model takes from elsewhere: section 6's CPU per byte (s/byte) and
    one request round trip (s)."""
    k_w: float
    k_s: float
    latency: float


def message_bytes(share: float, limit: int, chunk: int) -> float:
    """The bytes of one message: whole chunks, at least one, at most ``limit`` (0: no
    cut), never more than the server's ``share`` of the call (sharding.pieces)."""
    if not limit:
        return share
    return min(share, chunk * max(1, limit // chunk))


def paced(time_of, network_bytes: float) -> int:
    """The message limit pace.Pace settles on when a call of ``network_bytes`` takes
    ``time_of(limit)`` seconds: 10 ms of the rate it reaches, clamped."""
    limit = pace.MAX_BYTES
    for _ in range(20):
        rate = network_bytes / time_of(limit)
        limit = int(min(pace.MAX_BYTES, max(pace.MIN_BYTES, rate * pace.PACE_SECONDS)))
    return limit


def predict(layout, mode: str, nbytes: float, rate: float, limit, chunk: int,
            costs: Costs, cores: int) -> dict:
    """Seconds of one exchange of ``nbytes`` per worker over links of ``rate`` bytes/s:
    {"wire", "fill", "cpu", "message", "limit", "total"} (the module docstring)."""
    wire = layout.bound_bytes(mode, nbytes) / rate
    if layout.kind == "ring":
        return {"wire": wire, "fill": 0.0, "cpu": 0.0, "message": None, "limit": None,
                "total": wire + 2 * costs.latency}
    if limit == "auto":
        # the pace counts the bytes a call sends over network links: co-located, not
        # the share of the server on the worker's own host (shared memory)
        network = nbytes * (1 if layout.kind == "dedicated" else (layout.workers - 1) / layout.workers)
        limit = paced(lambda lim: predict(layout, mode, nbytes, rate, lim, chunk, costs,
                                          cores)["total"], network)
    w, s, f = layout.workers, layout.servers, PUSH_FRACTION[mode]
    p = message_bytes(nbytes / s, limit, chunk)
    link = wire
    if layout.kind == "dedicated":
        sent_received = layout.link_bytes(mode, nbytes)
        workers = [sent_received[h] for h in layout.worker_hosts]
        servers = [sent_received[h] for h in layout.server_hosts]
        # the busiest direction of the pushes (workers out, servers in) and of the replies
        push = max(max(x for x, _ in workers), max(y for _, y in servers)) / rate
        reply = max(max(y for _, y in workers), max(x for x, _ in servers)) / rate
        one_round = max(w, s) * p / rate     # a message from every worker to every server
        link = max(f * one_round + reply, push + one_round)
    cpu = w * nbytes * (costs.k_w + costs.k_s) / cores
    total = max(link, cpu) + p * (costs.k_w + costs.k_s) + 2 * costs.latency
    return {"wire": wire, "fill": link - wire, "cpu": cpu, "message": p, "limit": limit,
            "total": total}


def raw_rate(info: dict) -> float | None:
    """Bytes/s of the run's raw TCP check, the two directions averaged (None: none)."""
    raw = info.get("raw") or {}
    a_to_b, b_to_a = raw.get("a_to_b_gbit"), raw.get("b_to_a_gbit")
    return (a_to_b + b_to_a) / 2 * 1e9 / 8 if a_to_b and b_to_a else None


def run_settings(data: dict) -> tuple:
    """(KVSTORE_PIPELINE_BYTES as the run's workers had it, KVSTORE_CHUNK_BYTES): as the
    run recorded them (``config.effective``), or, in older files, from its ``--env``."""
    effective = data["config"].get("effective")
    if effective:
        return effective["pipeline_bytes"], effective["chunk_bytes"]
    settings = env.read(data["config"].get("env") or {})
    limit = settings.pipeline_bytes
    if limit == "auto" and data["started"] < PACE_SINCE:
        limit = pace.MAX_BYTES
    return limit, settings.chunk_bytes


def points(data: dict, costs: Costs) -> list[dict]:
    """One row per (rate, layout, variant) median of a link.json: the prediction and
    its parts (ms), the measured median (ms) and the error (measured / predicted - 1)."""
    limit, chunk = run_settings(data)
    groups: dict[tuple[str, str, str], list[float]] = {}    # (rate, layout, mode) -> samples
    for r in data["rows"]:
        groups.setdefault((r["rate"], r["layout"], r["mode"]), []).extend(r["samples"])
    rows = []
    for (rate_name, key, mode), samples in groups.items():
        rate = raw_rate(data["rates"][rate_name])
        if rate is None:
            raise ValueError(f"{rate_name} of the run started {data['started']} has no raw TCP "
                             "rate measured (rates[rate]['raw']): the model needs it")
        layout = parse(key)
        pred = predict(layout, mode, data["nbytes"], rate, limit, chunk, costs,
                       data["machine"]["cpus"])
        measured = statistics.median(samples)
        rows.append({"rate": rate_name, "raw_gbit": rate * 8 / 1e9, "layout": key, "mode": mode,
                     "kind": layout.kind, "workers": layout.workers,
                     **{k: (v * 1e3 if k in ("wire", "fill", "cpu", "total") else v)
                        for k, v in pred.items()},
                     "measured": measured * 1e3, "error": measured / pred["total"] - 1})
    order = ("ring", "colo", "dedicated")
    rows.sort(key=lambda r: (-r["raw_gbit"], r["workers"], order.index(r["kind"]), r["layout"],
                             list(VARIANTS).index(r["mode"])))
    return rows


def default_files() -> list[str]:
    return [p for pattern in RUNS_OF_RECORD for p in sorted(glob.glob(os.path.join(RESULTS, pattern)))]


def report(paths, costs: Costs) -> str:
    """The link model's table for every link.json in ``paths``."""
    if not paths:
        raise ValueError(f"no link.json given and none of {RUNS_OF_RECORD} under {RESULTS}")
    lines = [f"Link model (benchmarks/model/link.py): k_w = {costs.k_w * 1e9:.2f}, k_s = "
             f"{costs.k_s * 1e9:.2f} ns/byte (section 6's sweep), L = {costs.latency * 1e3:.1f} ms; "
             f"error = measured / predicted - 1.", ""]
    worst: tuple[dict, str] | None = None     # (row, its file) of the largest |error|
    count = inside = 0
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if not data.get("finished"):
            raise ValueError(f"{path}: the run has not finished (no 'finished' field)")
        rows = points(data, costs)
        limit, chunk = run_settings(data)
        set_vars = ", ".join(f"{k}={v}" for k, v in (data["config"].get("env") or {}).items())
        lines += [f"{os.path.relpath(path)}: run {data['started']}, {set_vars or 'defaults'}; "
                  f"messages: {'auto (pace)' if limit == 'auto' else f'{limit / 2**20:g} MiB'}, "
                  f"chunks {chunk / 2**20:g} MiB.", "",
                  "| rate | raw TCP Gbit/s | layout | variant | message MB | wire ms | fill ms "
                  "| CPU bound ms | predicted ms | measured ms | error |",
                  "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            message = "" if r["message"] is None else f"{r['message'] / 1e6:.2f}"
            cpu = "" if r["kind"] == "ring" else f"{r['cpu']:.0f}"
            miss = abs(r["error"]) > WITHIN
            lines.append(f"| {r['rate']} | {r['raw_gbit']:.3f} | {r['layout']} | {VARIANTS[r['mode']]} | "
                         f"{message} | {r['wire']:.0f} | {r['fill']:.0f} | {cpu} | {r['total']:.0f} | "
                         f"{r['measured']:.0f} | {'**' if miss else ''}{r['error'] * 100:+.1f}%"
                         f"{'**' if miss else ''} |")
            count += 1
            inside += not miss
            if worst is None or abs(r["error"]) > abs(worst[0]["error"]):
                worst = (r, path)
        lines.append("")
    if worst is None:
        raise ValueError(f"no measured rows in {', '.join(paths)}")
    r, path = worst
    lines.append(f"Largest |error|: {r['error'] * 100:+.1f}% ({r['layout']}, {VARIANTS[r['mode']]}, "
                 f"{r['rate']}, {os.path.relpath(path)}); {inside} of {count} points within "
                 f"{WITHIN * 100:.0f} %.")
    return "\n".join(lines)
