"""The report of benchmarks.link: the bytes each launch should put on every link
(benchmarks/harness/layouts.py has the wire model), the summary of the samples per rate,
layout and variant against their wire bounds, the targets of issue 18, the
half-rate check, and link.md."""

from __future__ import annotations

from benchmarks.harness import common
from benchmarks.harness.layouts import VARIANTS, parse

KIND_ORDER = ("ring", "colo", "dedicated")


def expected_link_bytes(layout, modes, exchanges: int, nbytes: int) -> dict:
    """{host: {"tx", "rx"}}: the payload bytes every host of ``layout`` should send
    and receive during one launch: every exchange of every mode (warm-up
    included), and for ours rank 0's init of the servers (kv.init: its values win)."""
    out = {h: {"tx": 0.0, "rx": 0.0} for h in layout.hosts}
    for mode in modes:
        for h, (sent, received) in layout.link_bytes(mode, nbytes).items():
            out[h]["tx"] += exchanges * sent
            out[h]["rx"] += exchanges * received
    for h, (sent, received) in layout.init_bytes(nbytes).items():
        out[h]["tx"] += sent
        out[h]["rx"] += received
    return out


def summarise(rows, rates_info, nbytes) -> dict:
    """{rate: [entry per (layout, mode)]}: median and spread (ms), the wire bound at
    the nominal rate and at the raw TCP rate measured, and the ratio to gloo's flat
    ring over the same worker hosts at that rate."""
    out = {}
    for rate, info in rates_info.items():
        b_nominal = info["qdisc"]["bits_per_s"] / 8
        raw = info.get("raw") or {}
        a_to_b, b_to_a = raw.get("a_to_b_gbit"), raw.get("b_to_a_gbit")
        b_raw = ((a_to_b + b_to_a) / 2 * 1e9 / 8) if a_to_b and b_to_a else None
        groups: dict[tuple[str, str], list[dict]] = {}    # (layout, mode) -> its rows
        for r in rows:
            if r["rate"] == rate:
                groups.setdefault((r["layout"], r["mode"]), []).append(r)
        entries = []
        for (key, mode), rs in groups.items():
            layout = parse(key)
            st = common.stats([s for r in rs for s in r["samples"]])
            e = {"layout": key, "kind": layout.kind, "workers": layout.workers,
                 "servers": layout.servers, "contender": layout.contender, "mode": mode,
                 "variant": VARIANTS[mode], "hosts": len(layout.hosts),
                 **{k: (v * 1e3 if k != "n" else v) for k, v in st.items()},
                 "launch_medians_ms": [common.stats(r["samples"])["median"] * 1e3 for r in rs],
                 "model_ms": layout.bound_ms(mode, nbytes, b_nominal),
                 "model_at_raw_ms": layout.bound_ms(mode, nbytes, b_raw) if b_raw else None,
                 "worker_cpu_s": _mean([r.get("cpu_s") for r in rs]),
                 "bytes_sent": _mean([r.get("bytes_sent") for r in rs]),
                 "bytes_received": _mean([r.get("bytes_received") for r in rs])}
            e["measured_over_model"] = e["median"] / e["model_ms"]
            if e["model_at_raw_ms"]:
                e["measured_over_model_at_raw"] = e["median"] / e["model_at_raw_ms"]
            entries.append(e)
        rings = {e["workers"]: e for e in entries if (e["kind"], e["mode"]) == ("ring", "flat")}
        for e in entries:
            ring = rings.get(e["workers"])
            e["vs_gloo_flat"] = e["median"] / ring["median"] if ring else None
        entries.sort(key=lambda e: (e["workers"], KIND_ORDER.index(e["kind"]), -e["servers"],
                                    list(VARIANTS).index(e["mode"])))
        out[rate] = entries
    return out


def targets(entries) -> list[dict]:
    """Issue 18's targets for the layouts measured at one rate: (what, measured,
    target, met)."""
    by = {(e["layout"], e["mode"]): e for e in entries}
    found = []

    def add(what, value, limit):
        if value is not None:
            found.append({"what": what, "measured": value, "target": limit, "met": value <= limit})
    for w in sorted({e["workers"] for e in entries}):
        ded = by.get((f"dedicated:{w}x{w}", "pushpull"))
        if ded and w == 4:
            add(f"dedicated W={w}, S={w}: time / gloo ring (flat)", ded["vs_gloo_flat"], 0.75)
            add(f"dedicated W={w}, S={w}: time / its wire bound", ded["measured_over_model"], 1.10)
        colo = by.get((f"colo:{w}", "pushpull"))
        if colo:
            add(f"co-located W={w}: time / gloo ring (flat)", colo["vs_gloo_flat"], 0.95)
        two = by.get((f"colo:{w}", "pushpull_2bit"))
        if two:
            add(f"co-located W={w}, 2bit: time / gloo ring (flat)", two["vs_gloo_flat"], 0.5)
    return found


def halving(summary: dict, half: dict | None) -> list[dict]:
    """The layouts run again at half the first rate: median there / median at the
    first rate (2.0 when the link is the bottleneck, less when the CPU is)."""
    if not half or half["rate"] not in summary:
        return []
    first = {(e["layout"], e["mode"]): e for e in next(iter(summary.values()))}
    return [{"layout": e["layout"], "mode": e["mode"], "full_ms": first[k]["median"],
             "half_ms": e["median"], "ratio": e["median"] / first[k]["median"]}
            for e in summary[half["rate"]] if (k := (e["layout"], e["mode"])) in first]


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _f(x, fmt="{:.1f}", none=""):
    return none if x is None else fmt.format(x)


def markdown(data: dict) -> str:
    m, cfg = data["machine"], data["config"]
    lines = [
        "# Gradient exchange over an emulated link (`python -m benchmarks.link`)",
        "",
        f"Run {data['started']} .. {data['finished']}, command: `{data['command']}`.",
        f"Machine: {m.get('cpu_model', m.get('processor'))}, {m['cpus']} cores (shared by every "
        f"emulated host and by other work), {m.get('mem_total', '?')}, {m['platform']}; "
        f"load average {data['load_start']:.2f} at the start, "
        f"{min(data['loads']):.2f}-{max(data['loads']):.2f} before the launches, "
        f"{data['load_end']:.2f} at the end.",
        "Versions: " + "; ".join(f"{k}: {v}" for k, v in data["versions"].items()) + ".",
        "",
        f"Workload: {cfg['model']} parameter set, {data['tensors']} fp32 tensors, "
        f"N = {data['nbytes'] / 1e6:.1f} MB per worker. Hosts: network namespaces, each with "
        "its own link to one bridge (a veth pair, tc tbf on both ends: full duplex, MTU 1500); "
        "worker hosts A, B, C, D, server hosts S0..S3. Layouts: ring = gloo over the W worker "
        "hosts; colo = a worker and a server on each of W hosts (shared memory within a host, "
        "tcp between); dedicated WxS = W worker hosts + S server hosts (all tcp). "
        f"{cfg['launches']} launch(es) per layout and rate, {cfg['iters']} timed exchanges "
        f"each after {cfg['warmup']} warm-up; every sum verified exactly.",
        "",
        "Wire bound = bytes on the busiest link direction / link rate (benchmarks/harness/layouts.py): "
        "ring and colo 2N(W-1)/W (colo with a compressed push: (f+1)N(W-1)/W, f = 1/16 for "
        "2bit); dedicated max(N, W*N/S). 'At raw TCP rate' uses the TCP payload rate measured "
        "between A and B with both directions busy (excludes TCP/IP/Ethernet headers, ~4.4 % "
        "at MTU 1500).",
        "",
    ]
    for rate, entries in data["summary"].items():
        info = data["rates"][rate]
        raw = info.get("raw") or {}
        lines += [f"## {rate}", "",
                  f"tc: `{info['qdisc']['tc']}` on both ends of every host's link. Raw TCP bulk "
                  f"transfer A<->B, both directions at once "
                  f"({raw.get('bytes_each_way', 0) / 1e6:.0f} MB each): "
                  f"**{_f(raw.get('a_to_b_gbit'), '{:.3f}')}** / "
                  f"**{_f(raw.get('b_to_a_gbit'), '{:.3f}')}** Gbit/s "
                  f"(nominal {info['qdisc']['bits_per_s'] / 1e9:g})."
                  + (f" **Warning: {info['warning']}**" if info.get("warning") else ""), "",
                  "| layout | contender | variant | median ms | p10-p90 ms | wire bound ms "
                  "| measured/bound | bound at raw TCP rate ms | measured/that | vs gloo ring "
                  "(flat, same W) | worker MB sent/recv per exchange | worker CPU s/exchange | n |",
                  "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for e in entries:
            sent = (f"{e['bytes_sent'] / 1e6:.1f} / {e['bytes_received'] / 1e6:.1f}"
                    if e.get("bytes_sent") is not None else "")
            lines.append(
                f"| {e['layout']} | {e['contender']} | {e['variant']} | **{e['median']:.0f}** | "
                f"{e['p10']:.0f}-{e['p90']:.0f} | {e['model_ms']:.0f} | "
                f"{e['measured_over_model']:.2f} | {_f(e['model_at_raw_ms'], '{:.0f}')} | "
                f"{_f(e.get('measured_over_model_at_raw'), '{:.2f}')} | "
                f"{_f(e['vs_gloo_flat'], '{:.2f}x')} | {sent} | "
                f"{_f(e['worker_cpu_s'], '{:.3f}')} | {e['n']} |")
        found = targets(entries)
        if found:
            lines += ["", "Targets (issue 18), at this rate:", "",
                      "| target | measured | limit | met |", "|---|---:|---:|---|"]
            lines += [f"| {t['what']} | {t['measured']:.2f} | <= {t['target']:.2f} | "
                      f"{'yes' if t['met'] else '**no**'} |" for t in found]
        lines.append("")
    halves = halving(data["summary"], cfg.get("half_rate"))
    if halves:
        first = next(iter(data["summary"]))
        lines += [f"## Is the link the bottleneck? {first} against {cfg['half_rate']['rate']}", "",
                  "The same layouts at half the rate: where the link limits, the time doubles; "
                  "where this machine's CPU does, it grows less.", "",
                  f"| layout | variant | median ms at {first} | at {cfg['half_rate']['rate']} "
                  "| ratio |", "|---|---|---:|---:|---:|"]
        lines += [f"| {h['layout']} | {VARIANTS[h['mode']]} | {h['full_ms']:.0f} | "
                  f"{h['half_ms']:.0f} | **{h['ratio']:.2f}** |" for h in halves]
        lines.append("")
    for L in data["launches"]:
        if L.get("timeline"):
            lines += [f"## Link use over the last exchange: {L['layout']} at {L['rate']}", "",
                      "Every host's link, 100 ms a row: % of the rate it sent / received "
                      "(benchmarks/link/timeline.py: the bridge ports' counters every 20 ms).", "",
                      "```", L["timeline"].rstrip("\n"), "```", ""]
    lines += ["## Bytes on the links per launch", "",
              "Counted by every host's interface (`ip -s link` tx/rx bytes: packets as the device "
              "sees them; with TSO/GSO one set of headers per segment of up to 64 KB, so "
              "~payload), every exchange of the launch (warm-up too) plus set-up and barriers; "
              "'model' is the payload the wire model says must cross (ours: + rank 0's init).",
              "",
              "| rate | layout | launch | busiest link direction MB | model MB | ratio | all hosts "
              "sent MB | model MB | launch s | servers' CPU s | load before |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for L in data["launches"]:
        got = [v for c in (L.get("link_bytes") or {}).values() for v in c.values() if v is not None]
        want = [v for c in L["model_link_bytes"].values() for v in c.values()]
        sent_bytes = [c["tx"] for c in (L.get("link_bytes") or {}).values() if c["tx"] is not None]
        servers = L.get("servers_usage") or {}
        cpu = sum(u.get("cpu_s", 0) for u in servers.values()) if servers else None
        busiest, model = (max(got) if got else None), max(want)
        lines.append(
            f"| {L['rate']} | {L['layout']} | {L['launch'] + 1} | {_f(busiest and busiest / 1e6)} | "
            f"{model / 1e6:.1f} | {_f(busiest and busiest / model, '{:.3f}')} | "
            f"{sum(sent_bytes) / 1e6:.1f} | "
            f"{sum(c['tx'] for c in L['model_link_bytes'].values()) / 1e6:.1f} | "
            f"{L['seconds']:.1f} | {_f(cpu)} | {L['load_before']:.2f} |")
    if data["failures"]:
        lines += ["", "## Failures", ""] + [f"- {f}" for f in data["failures"]]
    return "\n".join(lines) + "\n"
