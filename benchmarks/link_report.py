"""The report of benchmarks.link: the wire-time model of docs/performance.md section 6
for two machines, the bytes each launch should put on the link, the summary of the
samples per rate and contender, and link.md."""

from __future__ import annotations

from benchmarks import common

VARIANTS = {("gloo", "flat"): "one flat all_reduce",
            ("gloo", "buckets"): "25 MB buckets (DDP)",
            ("ours", "pushpull"): "tcp pushpull",
            ("ours", "pushpull_2bit"): "tcp pushpull, 2bit compression",
            ("ours", "pushpull_fp16"): "tcp pushpull, fp16 compression"}
# fraction of M that one push carries on the wire (2bit: 4 values per byte; fp16: 2 bytes)
PUSH_FRACTION = {"pushpull": 1.0, "pushpull_2bit": 1 / 16, "pushpull_fp16": 0.5,
                 "flat": 1.0, "buckets": 1.0}


def model_ms(mode: str, nbytes: int, bytes_per_s: float, n: int = 2) -> float:
    """Wire time per exchange, docs/performance.md section 6, N machines, one worker each,
    servers co-located: 2*(N-1)/N * M/B; a compressed push shrinks its half of the traffic."""
    push = PUSH_FRACTION[mode] * nbytes
    return 1e3 * (n - 1) / n * (push + nbytes) / bytes_per_s


def expected_link_bytes(contender: str, modes, exchanges: int, nbytes: int) -> dict:
    """Payload bytes that should cross the link in each direction during one launch:
    every exchange, warm-up included; for ours, A->B also carries rank 0's init of the
    remote server's half (kv.init: rank 0's values win)."""
    total = sum(exchanges * (PUSH_FRACTION[m] * nbytes / 2 + nbytes / 2) for m in modes)
    return {"a_to_b": total + (nbytes / 2 if contender == "ours" else 0), "b_to_a": total}


def summarise(rows, rates_info, nbytes) -> dict:
    out = {}
    for rate, info in rates_info.items():
        b_nominal = info["qdisc"]["bits_per_s"] / 8
        raw = info.get("raw") or {}
        gbits = [raw.get("a_to_b_gbit"), raw.get("b_to_a_gbit")]
        b_raw = (sum(gbits) / 2 * 1e9 / 8) if all(gbits) else None
        groups = {}
        for r in rows:
            if r["rate"] == rate:
                groups.setdefault((r["contender"], r["mode"]), []).append(r)
        entries = []
        for (contender, mode), rs in groups.items():
            samples = [s for r in rs for s in r["samples"]]
            st = common.stats(samples)
            launch_medians = [common.stats(r["samples"])["median"] for r in rs]
            e = {"contender": contender, "mode": mode, "variant": VARIANTS[(contender, mode)],
                 **{k: (v * 1e3 if k != "n" else v) for k, v in st.items()},
                 "launch_medians_ms": [m * 1e3 for m in launch_medians],
                 "model_ms": model_ms(mode, nbytes, b_nominal),
                 "model_at_raw_ms": model_ms(mode, nbytes, b_raw) if b_raw else None,
                 "worker_cpu_s": _mean([r.get("cpu_s") for r in rs]),
                 "bytes_sent": _mean([r.get("bytes_sent") for r in rs]),
                 "bytes_received": _mean([r.get("bytes_received") for r in rs])}
            e["measured_over_model"] = e["median"] / e["model_ms"]
            if e["model_at_raw_ms"]:
                e["measured_over_model_at_raw"] = e["median"] / e["model_at_raw_ms"]
            entries.append(e)
        gloo = next((e for e in entries if (e["contender"], e["mode"]) == ("gloo", "flat")), None)
        for e in entries:
            e["vs_gloo_flat"] = e["median"] / gloo["median"] if gloo else None
        order = list(VARIANTS)
        entries.sort(key=lambda e: order.index((e["contender"], e["mode"])))
        out[rate] = entries
    return out


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _f(x, fmt="{:.1f}", none=""):
    return none if x is None else fmt.format(x)


def markdown(data: dict) -> str:
    m = data["machine"]
    cfg = data["config"]
    mb = data["nbytes"] / 1e6
    lines = [
        "# Gradient exchange over an emulated link (`python -m benchmarks.link`)",
        "",
        f"Run {data['started']} .. {data['finished']}, command: `{data['command']}`.",
        f"Machine: {m.get('cpu_model', m.get('processor'))}, {m['cpus']} cores (shared by both "
        f"\"machines\" and by other work), {m.get('mem_total', '?')}, {m['platform']}; "
        f"load average {data['load_start']:.2f} at the start, "
        f"{min(data['loads']):.2f}-{max(data['loads']):.2f} before the launches, "
        f"{data['load_end']:.2f} at the end.",
        "Versions: " + "; ".join(f"{k}: {v}" for k, v in data["versions"].items()) + ".",
        "",
        f"Workload: {cfg['model']} parameter set, {data['tensors']} fp32 tensors, M = {mb:.1f} MB "
        f"per worker; W = 2 workers, one per \"machine\" (network namespace), N = 2; ours with "
        f"S = 2 servers, one per machine (shared memory to its own, tcp across); gloo ranks 0 and 1 the same "
        f"way. Link: a veth pair with a tc tbf rate limit on both ends (MTU 1500). "
        f"{cfg['launches']} interleaved launches per contender and rate, {cfg['iters']} timed "
        f"exchanges each after {cfg['warmup']} warm-up; every result verified.",
        "",
        "Model (docs/performance.md section 6): wire time per exchange = 2*(N-1)/N * M/B = M/B "
        "at N=2 (each direction carries a worker's push of the remote half and its server's "
        "reply to the remote worker: the same bytes as a ring all-reduce); with a compressed "
        "push: (M_push/2 + M/2)/B, M_push = M/16 (2bit) or M/2 (fp16). B = the tbf rate "
        "(nominal); the 'at raw TCP rate' column uses the TCP payload rate measured between "
        "the namespaces with both directions busy (which excludes TCP/IP/Ethernet headers, "
        "~4.4 % at MTU 1500).",
        "",
    ]
    for rate, entries in data["summary"].items():
        info = data["rates"][rate]
        raw = info.get("raw") or {}
        lines += [f"## {rate}",
                  "",
                  f"tc: `{info['qdisc']['tc']}` on both veth ends. Raw TCP bulk transfer, both "
                  f"directions at once ({raw.get('bytes_each_way', 0) / 1e6:.0f} MB each): "
                  f"A->B **{_f(raw.get('a_to_b_gbit'), '{:.3f}')}** Gbit/s, B->A "
                  f"**{_f(raw.get('b_to_a_gbit'), '{:.3f}')}** Gbit/s "
                  f"(nominal {info['qdisc']['bits_per_s'] / 1e9:g})."
                  + (f" **Warning: {info['warning']}**" if info.get("warning") else ""),
                  "",
                  "| contender | variant | median ms | p10-p90 ms | launch medians ms | model ms "
                  "| measured/model | model at raw TCP rate ms | measured/that | vs gloo flat "
                  "| worker MB sent/recv per exchange | worker CPU s/exchange | n |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for e in entries:
            sent = (f"{e['bytes_sent'] / 1e6:.1f} / {e['bytes_received'] / 1e6:.1f}"
                    if e.get("bytes_sent") is not None else "")
            lines.append(
                f"| {e['contender']} | {e['variant']} | **{e['median']:.1f}** | "
                f"{e['p10']:.1f}-{e['p90']:.1f} | "
                f"{min(e['launch_medians_ms']):.1f}-{max(e['launch_medians_ms']):.1f} | "
                f"{e['model_ms']:.1f} | {e['measured_over_model']:.2f} | "
                f"{_f(e['model_at_raw_ms'])} | {_f(e.get('measured_over_model_at_raw'), '{:.2f}')} | "
                f"{_f(e['vs_gloo_flat'], '{:.2f}x')} | {sent} | "
                f"{_f(e['worker_cpu_s'], '{:.3f}')} | {e['n']} |")
        lines += ["", _reading(entries), ""]
    lines += ["## Bytes on the link per launch",
              "",
              "Counted by the veth ends (`ip -s link` tx bytes: packets as the device sees them; "
              "with TSO/GSO one set of headers per segment of up to 64 KB, so ~payload), every "
              "exchange of the launch (warm-up too) plus set-up and barriers; 'model' is the "
              "payload the model says must cross in that direction (ours A->B: + rank 0's init "
              "of the remote half).",
              "",
              "| rate | launch | contender | A->B MB | model MB | ratio | B->A MB | model MB | ratio "
              "| launch s | servers' CPU s | load before |",
              "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for L in data["launches"]:
        c = L.get("link_bytes") or {}
        cells = []
        for d in ("a_to_b", "b_to_a"):
            got, want = c.get(d), L["model_link_bytes"][d]
            cells += [_f(got and got / 1e6), f"{want / 1e6:.1f}", _f(got and got / want, "{:.3f}")]
        servers = L.get("servers_usage") or {}
        cpu = sum(u.get("cpu_s", 0) for u in servers.values()) if servers else None
        lines.append(f"| {L['rate']} | {L['launch'] + 1} | {L['contender']} | "
                     + " | ".join(cells) + f" | {L['seconds']:.1f} | {_f(cpu)} | "
                     f"{L['load_before']:.2f} |")
    if data["failures"]:
        lines += ["", "## Failures", ""] + [f"- {f}" for f in data["failures"]]
    return "\n".join(lines) + "\n"


def _reading(entries) -> str:
    """One computed sentence per rate: ours vs gloo, and what compression bought vs the model."""
    by = {(e["contender"], e["mode"]): e for e in entries}
    gloo, ours = by.get(("gloo", "flat")), by.get(("ours", "pushpull"))
    parts = []
    if gloo and ours:
        parts.append(f"Uncompressed, ours/gloo flat = {ours['median'] / gloo['median']:.2f}; "
                     f"measured/model at the raw TCP rate: gloo "
                     f"{_f(gloo.get('measured_over_model_at_raw'), '{:.2f}')}, ours "
                     f"{_f(ours.get('measured_over_model_at_raw'), '{:.2f}')}.")
    if ours:
        for mode, name in (("pushpull_2bit", "2bit"), ("pushpull_fp16", "fp16")):
            e = by.get(("ours", mode))
            if e:
                got = 1 - e["median"] / ours["median"]
                want = 1 - e["model_ms"] / ours["model_ms"]
                parts.append(f"{name}: {abs(got) * 100:.0f} % {'faster' if got >= 0 else 'slower'} "
                             f"than ours uncompressed (the wire model: {want * 100:.0f} % faster).")
    return "Reading: " + " ".join(parts) if parts else ""
