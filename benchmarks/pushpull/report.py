"""Turn result rows into medians, target ratios, a markdown report, a chart,
and (with --profile) a summary of where our contender's time goes."""

from __future__ import annotations

import os
import pstats
import statistics

from benchmarks.harness import common

TARGETS_DOC = "docs/performance.md"


# -- aggregation -------------------------------------------------------------------------------
def summarise(rows: list[dict], cfg) -> dict:
    groups: dict[tuple, dict] = {}
    for r in rows:
        key = (r["kind"], r["contender"], r["variant"])
        g = groups.setdefault(key, {"kind": r["kind"], "contender": r["contender"],
                                    "variant": r["variant"], "unit": r["unit"], "bytes": r["bytes"],
                                    "samples": [], "launch_medians": [], "cpu_s": [],
                                    "minor_faults": [], "passes": r.get("passes")})
        g["samples"] += r["samples"]
        if r["samples"]:
            g["launch_medians"].append(statistics.median(r["samples"]))
        for f in ("cpu_s", "minor_faults", "bytes_sent", "bytes_received"):
            if r.get(f) is not None:
                g.setdefault(f, []).append(r[f])
    out = []
    for g in groups.values():
        s = common.stats(g.pop("samples"))
        g["stats"] = s
        g["cpu_s"] = statistics.median(g["cpu_s"]) if g["cpu_s"] else None
        g["minor_faults"] = statistics.median(g["minor_faults"]) if g["minor_faults"] else None
        for f in ("bytes_sent", "bytes_received"):
            g[f] = statistics.median(g[f]) if g.get(f) else None
        out.append(g)
    summary = {"groups": out}
    summary["targets"] = targets(out, cfg)
    return summary


def _find(groups, kind, contender=None, prefix=None, exact=None):
    found = [g for g in groups if g["kind"] == kind and g["stats"].get("n")
             and (contender is None or g["contender"] == contender)
             and (prefix is None or g["variant"].startswith(prefix))
             and (exact is None or g["variant"] == exact)]
    return sorted(found, key=lambda g: g["stats"]["median"])


def _med(g) -> float:
    return g["stats"]["median"]


def targets(groups, cfg) -> list[dict]:
    """The issue's targets as measured ratios (None where a side is missing)."""
    res = []
    gloo_flat = next(iter(_find(groups, "exchange", "gloo", exact="one flat all_reduce")), None)
    ours_tcp = next(iter(_find(groups, "exchange", "ours", prefix="tcp:")), None)
    # W emulated hosts, one server each: tcp carries only what crosses hosts (a ring's bytes)
    hosts = _find(groups, "exchange", "ours", prefix="hosts:")
    hosts_plain = next(iter(g for g in hosts if "kv.empty" not in g["variant"]), None)
    hosts_best = next(iter(hosts), None)
    coloc = next(iter(sorted(_find(groups, "exchange", "ours", prefix="ipc:")
                             + _find(groups, "exchange", "ours", prefix="shm:"), key=_med)), None)
    # the same without the opt-in kv.empty() gradients: plain numpy arrays, as a user has them
    coloc_plain = next(iter(sorted([g for g in _find(groups, "exchange", "ours", prefix="ipc:")
                                    + _find(groups, "exchange", "ours", prefix="shm:")
                                    if "kv.empty" not in g["variant"]], key=_med)), None)
    ours_best = next(iter(_find(groups, "exchange", "ours")), None)
    ray = next(iter(_find(groups, "exchange", "ray")), None)
    mx = next(iter(_find(groups, "exchange", "mxnet")), None)

    def add(name, goal, num, den, ratio_ok, note=""):
        ratio = _med(num) / _med(den) if num and den else None
        res.append({"target": name, "goal": goal, "ratio": ratio,
                    "met": None if ratio is None else bool(ratio_ok(ratio)),
                    "numerator": num and f"{num['contender']} {num['variant']}",
                    "denominator": den and f"{den['contender']} {den['variant']}", "note": note})
    add("ours over TCP no slower than gloo's flat all_reduce", "ours/gloo <= 1.0",
        ours_tcp, gloo_flat, lambda r: r <= 1.0)
    if hosts_plain is not None:
        add("(the same between emulated hosts, one server per host: tcp between hosts only)",
            "ours/gloo <= 1.0", hosts_plain, gloo_flat, lambda r: r <= 1.0)
    if hosts_best is not None and hosts_best is not hosts_plain:
        add("(the same, gradients from kv.empty())", "ours/gloo <= 1.0", hosts_best, gloo_flat,
            lambda r: r <= 1.0)
    note = "" if coloc else ("no co-located transport (ipc/shm) in kvstore yet: not measurable; "
                             "the tcp ratio above is the stand-in")
    add("ours co-located at most 0.5x gloo's flat all_reduce", "ours/gloo <= 0.5",
        coloc, gloo_flat, lambda r: r <= 0.5, note)
    if coloc_plain is not None and coloc_plain is not coloc:
        add("(the same with gradients in plain numpy arrays)", "ours/gloo <= 0.5", coloc_plain,
            gloo_flat, lambda r: r <= 0.5)
    add("ours co-located faster than Ray", "ours/ray < 1.0", coloc, ray, lambda r: r < 1.0, note)
    if coloc_plain is not None and coloc_plain is not coloc:
        add("(the same with gradients in plain numpy arrays)", "ours/ray < 1.0", coloc_plain, ray,
            lambda r: r < 1.0)
    if not coloc:
        add("(stand-in) ours over TCP faster than Ray", "ours/ray < 1.0", ours_tcp, ray,
            lambda r: r < 1.0)
    add("ours at least 3x faster than MXNet's dist_sync", "mxnet/ours >= 3.0", mx, ours_best,
        lambda r: r >= 3.0)
    if coloc_plain is not None and coloc_plain is not ours_best:
        add("(the same with gradients in plain numpy arrays)", "mxnet/ours >= 3.0", mx, coloc_plain,
            lambda r: r >= 3.0)
    if ours_tcp is not None and ours_best is not ours_tcp:
        add("(the same with ours forced to tcp, as MXNet uses)", "mxnet/ours >= 3.0", mx, ours_tcp,
            lambda r: r >= 3.0)
    ceil = {"copy": next(iter(_find(groups, "ceiling", exact="numpy copy (np.copyto)")), None),
            "add": next(iter(_find(groups, "ceiling", exact="numpy add (np.add out=)")), None),
            "add3": next(iter(_find(groups, "ceiling", prefix="numpy add into a third array")), None)}
    for g in _find(groups, "ceiling", prefix="our server"):
        passes = {k: n for k, n in (g.get("passes") or {}).items() if n}
        if not passes or any(ceil.get(k) is None for k in passes):
            continue
        ideal = sum(n * _med(ceil[k]) for k, n in passes.items())
        ratio = _med(g) / ideal
        res.append({"target": f"server {g['variant'].split(': ', 1)[1].split(' (')[0]} within 2x "
                              "of numpy doing the same passes",
                    "goal": "server/numpy <= 2.0", "ratio": ratio, "met": ratio <= 2.0,
                    "numerator": g["variant"],
                    "denominator": "numpy " + " + ".join(f"{n} {k}" for k, n in passes.items())
                                   + f" = {ideal * 1e3:.1f} ms", "note": ""})
    return res


# -- markdown ------------------------------------------------------------------------------------
def _ms(x) -> str:
    return f"{x * 1e3:.1f}"


def markdown(data: dict) -> str:
    s = data["summary"]
    groups, cfg = s["groups"], data["config"]
    m = data["machine"]
    lines = [f"## Gradient exchange: {cfg['model']}, W={cfg['workers']}, S={cfg['servers']}",
             "",
             f"Machine: {m.get('cpu_model', '?')}, {m['cpus']} cores, {m.get('mem_total', '?')}; "
             f"{m['platform']}; run {data['started']} .. {data['finished']}.",
             "Versions: " + "; ".join(f"{k}: {v}" for k, v in data["versions"].items()) + ".",
             ""]
    ex = _find(groups, "exchange")
    gloo_flat = next(iter(_find(groups, "exchange", "gloo", exact="one flat all_reduce")), None)
    if ex:
        n_bytes = ex[0]["bytes"]
        lines += [f"One exchange of {n_bytes / 1e6:.1f} MB per worker (sum over W workers "
                  "delivered to every worker), verified every iteration. Medians over all timed "
                  "iterations of all launches; p10-p90 over iterations; the range of the "
                  "per-launch medians shows the drift between launches.", "",
                  "| contender | variant | median ms | p10-p90 ms | launch medians ms | GB/s per worker "
                  "| vs gloo flat | worker CPU s/iter | n |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for g in ex:
            st = g["stats"]
            lm = g["launch_medians"]
            vs = f"{st['median'] / _med(gloo_flat):.2f}x" if gloo_flat else ""
            cpu = f"{g['cpu_s']:.3f}" if g.get("cpu_s") is not None else ""
            lines.append(f"| {g['contender']} | {g['variant']} | **{_ms(st['median'])}** | "
                         f"{_ms(st['p10'])}-{_ms(st['p90'])} | {_ms(min(lm))}-{_ms(max(lm))} | "
                         f"{g['bytes'] / st['median'] / 1e9:.2f} | {vs} | {cpu} | {st['n']} |")
        lines.append("")
    co = _find(groups, "compression")
    if co:
        lines += ["Gradient compression (ours, pushpull; only worker->server traffic is compressed, "
                  "pulls are exact; every result is checked against the exact compressed sum). "
                  "MB: the messages worker 0 sent to and received from the servers per exchange, "
                  "headers included (over shm, uncompressed array data goes through shared memory "
                  "and is not counted; compressed data goes as messages):", "",
                  "| transport | compression | median ms | p10-p90 ms | vs uncompressed | "
                  "MB sent | MB received | worker CPU s/iter | n |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|"]

        def mb(b):
            return f"{b / 1e6:.1f}" if b is not None else ""
        for transport in sorted({g["variant"].split(": ", 1)[0] for g in co}):
            plain = next(iter(_find(groups, "exchange", "ours", exact=f"{transport}: pushpull")), None)
            rows = [("none", plain)] if plain else []
            rows += sorted(((g["variant"].split(", ")[-1].split()[0], g) for g in co
                            if g["variant"].startswith(f"{transport}: ")), key=lambda kg: _med(kg[1]))
            for kind, g in rows:
                st = g["stats"]
                vs = f"{st['median'] / _med(plain):.2f}x" if plain else ""
                cpu = f"{g['cpu_s']:.3f}" if g.get("cpu_s") is not None else ""
                lines.append(f"| {transport} | {kind} | **{_ms(st['median'])}** | {_ms(st['p10'])}-"
                             f"{_ms(st['p90'])} | {vs} | {mb(g.get('bytes_sent'))} | "
                             f"{mb(g.get('bytes_received'))} | {cpu} | {st['n']} |")
        lines.append("")
    ce = _find(groups, "ceiling")
    if ce:
        lines += ["Ceilings (same bytes):", "",
                  "| ceiling | median ms | p10-p90 ms | GB/s |", "|---|---:|---:|---:|"]
        for g in ce:
            st = g["stats"]
            lines.append(f"| {g['variant']} | **{_ms(st['median'])}** | {_ms(st['p10'])}-"
                         f"{_ms(st['p90'])} | {g['bytes'] / st['median'] / 1e9:.2f} |")
        lines.append("")
    la = _find(groups, "latency")
    if la:
        sizes = sorted({g["bytes"] for g in la})
        names = sorted({g["contender"] for g in la}, key=lambda c: min(
            _med(g) for g in la if g["contender"] == c))
        lines += ["Per-key latency: one small key exchanged (pushed by every worker, the sum "
                  "returned to every worker), median (p10-p90) in microseconds:", "",
                  "| contender | " + " | ".join(f"{b} B" for b in sizes) + " |",
                  "|---|" + "---:|" * len(sizes)]
        for c in names:
            cells = []
            for b in sizes:
                g = next((g for g in la if g["contender"] == c and g["bytes"] == b), None)
                st = g and g["stats"]
                cells.append(f"{st['median'] * 1e6:.0f} ({st['p10'] * 1e6:.0f}-{st['p90'] * 1e6:.0f})"
                             if st else "")
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        lines.append("")
    asy = [g for g in groups if g["kind"] == "async" and g["stats"].get("n")]
    if asy:
        lines += ["Asynchronous updates (dist_async, SGD on the servers, W workers pushing one "
                  "key as fast as they can):", "",
                  "| contender | variant | median updates/s | range |", "|---|---|---:|---:|"]
        for g in sorted(asy, key=lambda g: -g["stats"]["median"]):
            st = g["stats"]
            lines.append(f"| {g['contender']} | {g['variant']} | **{st['median']:.0f}** | "
                         f"{st['min']:.0f}-{st['max']:.0f} |")
        lines.append("")
    if s["targets"]:
        lines += ["Targets (ratios of medians measured in this run):", "",
                  "| target | goal | measured | met |", "|---|---|---:|---|"]
        for t in s["targets"]:
            val = "n/a" if t["ratio"] is None else f"{t['ratio']:.2f}"
            met = {None: "not measurable", True: "yes", False: "**no**"}[t["met"]]
            lines.append(f"| {t['target']} | {t['goal']} | {val} | {met} |")
        notes = sorted({t["note"] for t in s["targets"] if t["note"]})
        lines += [""] + [f"Note: {n}." for n in notes] + ([""] if notes else [])
    if data.get("skipped"):
        lines += ["Skipped:", ""] + [f"- {k}: {v}" for k, v in data["skipped"].items()] + [""]
    if data.get("failures"):
        lines += ["FAILED:", ""] + [f"- {f.splitlines()[0]}" for f in data["failures"]] + [""]
    return "\n".join(lines)


# -- chart ---------------------------------------------------------------------------------------
def chart(data: dict, path: str) -> str | None:
    """Write the PNG; returns why not (matplotlib missing) or None."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib is not installed ({e}); pip install matplotlib"
    groups, cfg = data["summary"]["groups"], data["config"]
    colors = {"ours": "tab:blue", "gloo": "tab:orange", "mxnet": "tab:green", "ray": "tab:purple",
              "ceiling": "tab:gray"}
    ex = _find(groups, "exchange")[::-1]
    ce = _find(groups, "ceiling")
    la = _find(groups, "latency")
    fig, axes = plt.subplots(1, 2, figsize=(15, 6.5), gridspec_kw={"width_ratios": [1.6, 1]})
    ax = axes[0]
    bars = ex + [g for g in ce][::-1]
    labels = [f"{g['contender']}: {g['variant']}" if g["contender"] != "ceiling" else g["variant"]
              for g in bars]
    med = [_med(g) * 1e3 for g in bars]
    lo = [m - g["stats"]["p10"] * 1e3 for m, g in zip(med, bars)]
    hi = [g["stats"]["p90"] * 1e3 - m for m, g in zip(med, bars)]
    y = range(len(bars))
    ax.barh(y, med, xerr=[lo, hi], color=[colors.get(g["contender"], "k") for g in bars],
            capsize=3, alpha=0.85)
    for yi, m in zip(y, med):
        ax.text(m, yi, f" {m:.0f}", va="center", fontsize=8)
    ax.set_yticks(list(y))
    ax.set_yticklabels([lb if len(lb) < 60 else lb[:57] + "..." for lb in labels], fontsize=8)
    ax.set_xlabel("ms per exchange (median, whiskers p10-p90)")
    mb = (ex or ce)[0]["bytes"] / 1e6 if (ex or ce) else 0
    ax.set_title(f"{cfg['model']} gradient exchange ({mb:.1f} MB), W={cfg['workers']}, "
                 f"S={cfg['servers']}; lower is better", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax = axes[1]
    if la:
        sizes = sorted({g["bytes"] for g in la})
        names = sorted({g["contender"] for g in la})
        width = 0.8 / len(names)
        for i, c in enumerate(names):
            vals = []
            for b in sizes:
                g = next((g for g in la if g["contender"] == c and g["bytes"] == b), None)
                vals.append(_med(g) * 1e6 if g else 0)
            shade = {"ours tcp": "tab:blue", "ours ipc": "tab:cyan", "ours shm": "navy",
                     "ours hosts": "tab:gray"}
            ax.bar([j + i * width for j in range(len(sizes))], vals, width, label=c,
                   color=shade.get(c, colors.get(c.split()[0], "k")))
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))])
        ax.set_xticklabels([f"{b} B" for b in sizes])
        ax.set_yscale("log")
        ax.set_ylabel("microseconds per single-key exchange (median)")
        ax.set_title("per-key latency (small tensors); lower is better", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    else:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# -- profile ---------------------------------------------------------------------------------------
def _top(path: str, n: int = 18) -> tuple[list[tuple], float, dict]:
    st = pstats.Stats(path)
    rows = []
    counts: dict[str, int] = {}     # calls of the socket functions
    # the type: ignores: typeshed's pstats.Stats leaves out stats and total_tt (set by load_stats)
    for (fname, line, func), (cc, nc, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
        where = f"{os.path.basename(fname)}:{line}" if line else fname
        rows.append((tt, ct, nc, f"{func} ({where})"))
        if func in ("send_multipart", "recv_multipart", "<method 'send' of 'zmq.backend.cython."
                    "_zmq.Socket' objects>", "poll"):
            counts[func] = counts.get(func, 0) + nc
    rows.sort(reverse=True)
    return rows[:n], st.total_tt, counts  # type: ignore[attr-defined]


def profile_ours(cfg, transport: str = "tcp") -> tuple[str, dict]:
    """Run one job of ours over ``transport`` with cProfile on worker 0 (timed steps
    only) and on every server (whole process). Returns (text report, summary dict)."""
    from benchmarks.harness.contenders import ours
    from dataclasses import replace
    pcfg = replace(cfg, latency_iters=0)
    tag = f"ours-profile-{transport}"
    res = ours.run_job(pcfg, ours.TRANSPORTS[transport], pcfg.worker_args(), tag, profile=True)
    exchanges = len(res["modes"]) * cfg.iters   # the worker profiles timed steps only
    text = [f"# Where our time goes: {cfg.model}, W={cfg.workers}, S={cfg.servers}, {transport}, "
            f"{exchanges} timed exchanges profiled on worker 0 (both modes)", ""]
    summary = {"exchanges_profiled": exchanges, "worker": {}, "servers": {}}
    for mode, d in res["modes"].items():
        text.append(f"worker 0, {mode}: median {statistics.median(d['times']) * 1e3:.1f} ms "
                    f"(under cProfile), {d['cpu_s'] * 1e3:.1f} ms CPU and "
                    f"{d['minor_faults']:.0f} minor page faults per exchange")
    wprof = cfg.path(f"{tag}-worker0.prof")
    top, total, counts = _top(wprof)
    summary["worker"] = {"total_s": total, "calls": counts,
                         "top": [(f, tt, nc) for tt, _, nc, f in top]}
    text += ["", f"## worker 0: {total:.2f} s profiled; top functions by own time", "",
             f"{'own s':>8} {'cum s':>8} {'calls':>8} {'per exch':>9}  function"]
    text += [f"{tt:8.3f} {ct:8.3f} {nc:8d} {nc / exchanges:9.1f}  {f}" for tt, ct, nc, f in top]
    text.append("\nmessage calls per exchange (worker 0): "
                + ", ".join(f"{k}: {v / exchanges:.1f}" for k, v in counts.items()))
    rounds = len(res["modes"]) * (cfg.iters + cfg.warmup)
    for name, usage in sorted(res.get("servers_usage", {}).items()):
        prof = cfg.path(os.path.join(f"{tag}-servers", f"{name}.prof"))
        text += ["", f"## {name}: CPU {usage['cpu_s']:.2f} s (user {usage['user_s']:.2f}, sys "
                 f"{usage['sys_s']:.2f}), {usage['minor_faults']} minor page faults over the "
                 f"whole job (~{rounds} exchanges + init; about "
                 f"{usage['minor_faults'] / rounds:.0f} faults and {usage['cpu_s'] / rounds * 1e3:.0f}"
                 f" ms CPU per exchange)"]
        if os.path.exists(prof):
            top, total, counts = _top(prof)
            summary["servers"][name] = {"usage": usage, "total_s": total, "calls": counts,
                                        "top": [(f, tt, nc) for tt, _, nc, f in top]}
            text += ["", f"{'own s':>8} {'cum s':>8} {'calls':>8}  function (whole process; "
                     "'poll' is idle waiting)"]
            text += [f"{tt:8.3f} {ct:8.3f} {nc:8d}  {f}" for tt, ct, nc, f in top]
    return "\n".join(text) + "\n", summary
