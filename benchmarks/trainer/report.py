"""The report of benchmarks.trainer: the summary of the step times, the step-time
prediction of docs/performance.md section 6 for --link (from the run's own compute
time, the link's rate, the wire bytes of the placement and the last gradient
bucket), and the markdown."""

from __future__ import annotations

import statistics

from benchmarks.harness import common, layouts
from benchmarks.trainer.contenders import CONTENDERS

# the first bucket DDP fills is capped at 1 MiB (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES),
# the others at bucket_cap_mb = 25 MiB
DDP_FIRST_BUCKET = 1 << 20
DDP_BUCKET = 25 << 20


def last_bucket_bytes(sizes: list[int], bucket_bytes: int | None = None) -> dict:
    """Bytes in the last gradient bucket that backward completes (parameters become
    ready roughly in reverse order): the Trainer's (flushed at >= ``bucket_bytes`` from
    hooks, the rest sent as backward ends; None: the model-sized default,
    kvstore.torch.bucket_bytes_for) and DDP's (1 MiB first bucket, then 25 MiB)."""
    from kvstore.torch import bucket_bytes_for
    if bucket_bytes is None:
        bucket_bytes = bucket_bytes_for(sum(sizes), sizes[0] if sizes else 0)
    bucket, last = 0, 0
    for n in reversed(sizes):
        bucket += n
        if bucket >= bucket_bytes:
            last, bucket = bucket, 0
    trainer = bucket or last
    try:
        import torch.distributed as dist
        first = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", DDP_FIRST_BUCKET)
    except ImportError:
        first = DDP_FIRST_BUCKET
    buckets, cur, cap = [], 0, first
    for n in reversed(sizes):   # as torch's compute_bucket_assignment_by_size: add, then cut
        cur += n
        if cur >= cap:
            buckets.append(cur)
            cur, cap = 0, DDP_BUCKET
    if cur or not buckets:
        buckets.append(cur)
    return {"trainer": trainer, "ddp": buckets[-1], "ddp_buckets": buckets}


# docs/performance.md section 6 calibration (this machine, tcp): CPU s per byte of a
# worker's exchange and of a server's share, the pipeline piece, one small round trip
K_W, K_S, PIECE, LATENCY = 0.79e-9, 0.84e-9, 8 << 20, 0.6e-3


def wire_bytes(link: dict):
    """(ours, DDP): functions from n gradient bytes per worker to the bytes an exchange
    puts on the busiest link direction. Two machines: n for both (2(N-1)/N n at N = 2);
    a --layout: its own (benchmarks/harness/layouts.py ``bound_bytes``) and, for DDP, the ring
    over its worker hosts, 2n(W-1)/W."""
    if not link.get("layout"):
        return (lambda n: n), (lambda n: n)
    layout = layouts.parse(link["layout"])
    ring = layouts.Layout("ring", layout.workers, 0)
    return (lambda n: layout.bound_bytes("pushpull", n)), (lambda n: ring.bound_bytes("pushpull", n))


def predict(data: dict) -> dict:
    """--link: the step times docs/performance.md section 6 predicts, from this run's
    own compute time, the link's rate and the placement's wire bytes, next to the
    measured medians.

    T_c = forward + backward of ours without overlap (rank 0's median: all W workers
    computing at once, nothing on the wire); T_wire = the busiest link direction's bytes
    / B (:func:`wire_bytes`: M at N = 2 machines; a layout's own, DDP's ring 2M(W-1)/W);
    T_cpu = max(M*k_w, (W*M/S)*k_s) + p*(k_w + k_s) (a server's share of the pushes);
    T_x = max(T_wire, T_cpu) + 2L. No overlap: T_c + T_x. Overlap (section 6):
    max(T_c, T_x) + the last bucket's exchange. 'Push-only overlap' (the Trainer before
    a53461d: pushes from backward hooks, every pull in step(); two machines only): per
    direction half of T_wire is pushes and half replies, so only the pushes could hide
    under backward: T_fwd + max(T_bwd, T_x/2) + T_x/2. Since a53461d each hook starts a
    pushpull, so replies travel during backward too and section 6's full-overlap
    formula applies."""
    cfg, rows, summ = data["config"], data["rows"], data["summary"]
    m = cfg["num_params"] * 4
    info = data["link"]
    ours_wire, ddp_wire = wire_bytes(info)
    bps = {"nominal": info["qdisc"]["bits_per_s"] / 8}
    raw = info.get("raw") or {}
    if raw.get("a_to_b_gbit") and raw.get("b_to_a_gbit"):
        bps["raw"] = min(raw["a_to_b_gbit"], raw["b_to_a_gbit"]) * 1e9 / 8

    def med(names, part):
        xs = [t for r in rows if r["contender"] in names and r.get("parts") for t in r["parts"][part]]
        return statistics.median(xs) if xs else None
    noov = ("ours-nooverlap-server", "ours-nooverlap-worker")
    t_fwd, t_bwd = med(noov, "forward"), med(noov, "backward")
    w, s = cfg["workers"], cfg["servers"]
    if t_fwd is None and "floor" in summ:   # no run without overlap: the floor's share
        t_fwd, t_bwd = summ["floor"]["median"] / w / 3, summ["floor"]["median"] / w * 2 / 3
    if t_fwd is None:
        return {}
    t_c = t_fwd + t_bwd
    piece = min(PIECE, m / s)     # a piece is at most one server's share
    t_cpu = max(m * K_W, w * m / s * K_S) + piece * (K_W + K_S)
    last = data["last_bucket_bytes"]
    out = {"M_bytes": m, "wire_bytes": ours_wire(m), "wire_bytes_ddp": ddp_wire(m),
           "T_fwd": t_fwd, "T_bwd": t_bwd, "T_c": t_c, "T_cpu": t_cpu,
           "T_x_measured_nooverlap": med(noov, "step"), "rates": {}}
    for which, b in bps.items():
        t_x = max(ours_wire(m) / b, t_cpu) + 2 * LATENCY
        t_x_ddp = max(ddp_wire(m) / b, t_cpu) + 2 * LATENCY
        pred = {"T_wire": ours_wire(m) / b, "T_x": t_x, "T_wire_ddp": ddp_wire(m) / b,
                "T_x_ddp": t_x_ddp, "nooverlap": t_c + t_x,
                "overlap_docs": max(t_c, t_x) + ours_wire(last["trainer"]) / b + 2 * LATENCY,
                "ddp_docs": max(t_c, t_x_ddp) + ddp_wire(last["ddp"]) / b + 2 * LATENCY}
        if not info.get("layout"):   # two machines only (see above)
            pred["overlap_push_only"] = t_fwd + max(t_bwd, t_x / 2) + t_x / 2
        out["rates"][which] = pred
    predicted = {"ours-overlap-server": ("overlap_docs", "overlap_push_only"),
                 "ours-overlap-worker": ("overlap_docs", "overlap_push_only"),
                 "ours-nooverlap-server": ("nooverlap", None),
                 "ours-nooverlap-worker": ("nooverlap", None),
                 "ddp": ("ddp_docs", None)}
    out["by_contender"] = {}
    for name, (docs, refined) in predicted.items():
        if name not in summ:
            continue
        e = {"measured": summ[name]["median"]}
        for which, pred in out["rates"].items():
            e[f"docs_{which}"] = pred[docs]
            if refined in pred:
                e[f"push_only_{which}"] = pred[refined]
        out["by_contender"][name] = e
    return out


def summarise(rows: list[dict], ddp_name: str = "ddp", workers: int = 2) -> dict:
    out = {}
    for name in CONTENDERS:
        mine = [r for r in rows if r["contender"] == name]
        if not mine:
            continue
        samples = [t for r in mine for t in r["times"]]
        s = common.stats(samples)
        out[name] = {"shown": CONTENDERS[name].shown, **s,
                     "launch_medians": [statistics.median(r["times"]) for r in mine],
                     "loadavg_before": [r["loadavg_before"] for r in mine],
                     "cpu_s_per_step": statistics.fmean(r["cpu_s"] for r in mine)}
        servers = [r["servers_cpu_s"] for r in mine if r.get("servers_cpu_s") is not None]
        if servers:   # ours: what its S servers used per timed step, all of them together
            out[name]["servers_cpu_s_per_step"] = statistics.fmean(servers)
        # the whole job's CPU per step (rank 0's times W, the servers'): what a step costs
        # where every core is busy, and steadier than the wall time under others' load
        ranks = 1 if CONTENDERS[name].kind == "floor" else workers
        out[name]["job_cpu_s_per_step"] = ranks * out[name]["cpu_s_per_step"] + \
            out[name].get("servers_cpu_s_per_step", 0.0)
        parts = [r["parts"] for r in mine if r.get("parts")]
        if parts:   # rank 0's forward (with zero_grad), backward, step() medians
            out[name]["parts_median"] = {k: statistics.median(t for p in parts for t in p[k])
                                         for k in ("forward", "backward", "step")}
    base = out.get(ddp_name, {}).get("median")
    base_cpu = out.get(ddp_name, {}).get("job_cpu_s_per_step")
    for name, s in out.items():
        s["vs_ddp"] = s["median"] / base if base and s.get("median") else None
        s["job_cpu_vs_ddp"] = s["job_cpu_s_per_step"] / base_cpu if base_cpu else None
    if "floor" in out:
        out["floor"]["per_worker_share"] = out["floor"]["median"] / workers
    return out


def markdown(data: dict) -> str:
    cfg, summ, m = data["config"], data["summary"], data["machine"]
    ms = 1e3
    lines = ["# One training step: ours vs torch DDP (gloo) vs no communication", "",
             f"{cfg['network']}{'-' + str(cfg['num_layers']) if cfg['num_layers'] else ''} on "
             f"3x{cfg['image_size']}x{cfg['image_size']} synthetic inputs, {cfg['num_params']:,} "
             f"parameters ({cfg['num_params'] * 4 / 1e6:.1f} MB of fp32 gradients), b={cfg['batch_size']} "
             f"per worker, W={cfg['workers']} workers, S={cfg['servers']} servers (ours), SGD lr="
             f"{cfg['lr']} momentum={cfg['momentum']} wd={cfg['wd']}; every process "
             f"`torch.set_num_threads(1)`. {data['launches']} interleaved launches x "
             f"{cfg['iters']} timed steps (+{cfg['warmup']} warm-up) per contender; rank 0's step "
             "times (zero_grad + forward + backward + exchange + update; an untimed barrier "
             "before each step).", "",
             f"Run {data['started']} - {data['finished']}: `{data['command']}`", "",
             f"Machine: {m.get('cpu_model', m.get('processor'))}, {m['cpus']} CPUs, "
             f"{m.get('mem_total', '?')}, {m['platform']}; {', '.join(f'{k} {v}' for k, v in data['versions'].items())}.",
             "",
             "**Caveat: this is a shared 2-core machine; other jobs may have run during this "
             "run.** The 1-minute load average before each launch is in the last column "
             "(a load above ~1 before a launch means someone else was using a core).", "",
             "| contender | median ms | p10-p90 ms | per-launch medians ms | vs DDP | worker CPU ms/step | servers' CPU ms/step | job CPU ms/step (vs DDP) | steps | load avg before each launch |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for name, s in summ.items():
        if not s.get("n"):
            continue
        ratio = f"{s['vs_ddp']:.2f}x" if s.get("vs_ddp") else "-"
        cpu_ratio = f" ({s['job_cpu_vs_ddp']:.2f}x)" if s.get("job_cpu_vs_ddp") else ""
        lines.append(
            f"| {s['shown']} | {s['median'] * ms:.1f} | {s['p10'] * ms:.1f}-{s['p90'] * ms:.1f} | "
            f"{', '.join(f'{x * ms:.1f}' for x in s['launch_medians'])} | {ratio} | "
            f"{s['cpu_s_per_step'] * ms:.0f} | "
            f"{format(s['servers_cpu_s_per_step'] * ms, '.1f') if 'servers_cpu_s_per_step' in s else '-'} | "
            f"{s['job_cpu_s_per_step'] * ms:.0f}{cpu_ratio} | {s['n']} | "
            f"{', '.join(f'{x:.2f}' for x in s['loadavg_before'])} |")
    kinds = sorted({t for r in data["rows"] for t in (r.get("transports") or [])})
    if kinds:
        lines += ["", f"Ours' data plane, as rank 0's client reports it for every server: "
                      f"{', '.join(kinds)} ("
                      + ("checked for every worker: shared memory to a server on its own emulated "
                         "host, tcp to the others)." if data.get("link")
                         else "the default on one host).")]
    buckets = sorted({r["bucket_bytes"] for r in data["rows"] if r.get("bucket_bytes")})
    if buckets:
        lines += ["", f"Ours' buckets (the Trainer's bucket_bytes): {', '.join(f'{b:,}' for b in buckets)} bytes."]
    if "floor" in summ:
        lines += ["", f"Perfect scaling would be the floor's time / W = "
                      f"{summ['floor']['per_worker_share'] * ms:.1f} ms per step (each worker "
                      "computing b on its own free core, with a free exchange)."]
    if data.get("link"):
        lines += _link_markdown(data)
    chk = data["correctness"]
    lines += ["", "## Correctness", "",
              f"After {cfg['warmup'] + cfg['iters']} steps (warm-up + timed), every worker's "
              "parameters of every launch against one process trained on the concatenated "
              f"batches ({chk['reference']}), `numpy.allclose(rtol={cfg['rtol']}, "
              f"atol={cfg['atol']})`; ours also against DDP of the same round. Largest absolute "
              "difference over all launches and ranks; in parentheses: reported, not checked. "
              "Servers updating run torch SGD's twin (torch's own step, bit for bit), checked "
              "against the single-process loop with the servers' update on a `local` store.", "",
              "| contender | vs reference, torch SGD | vs reference, servers' update on a local store | vs DDP | checks | passed |",
              "|---|---:|---:|---:|---:|---|"]

    def cell(c, which):
        if which not in c["max_abs"]:
            return "-"
        text = f"{c['max_abs'][which]:.2e}"
        return text if c["checked"].get(which) else f"({text})"
    for name, c in chk["by_contender"].items():
        lines.append(f"| {CONTENDERS[name].shown} | {cell(c, 'reference')} | "
                     f"{cell(c, 'reference-kvsgd')} | {cell(c, 'ddp')} | {c['checks']} | "
                     f"{'yes' if c['ok'] else '**NO**'} |")
    lines += ["", f"Overall: {'passed' if chk['ok'] else '**FAILED**'}."]
    if data["failures"]:
        lines += ["", "## Failures", ""] + [f"- {f.splitlines()[0]}" for f in data["failures"]]
    return "\n".join(lines) + "\n"


def _link_markdown(data: dict) -> list[str]:
    """--link: the hosts, where each step's time went, the bytes on every host's link,
    and measured vs predicted."""
    info, summ, ms = data["link"], data["summary"], 1e3
    raw = info.get("raw") or {}
    q = info.get("qdisc") or {}
    layout = info.get("layout")
    lines = ["", f"## Over the emulated link ({info['rate']}{', ' + layout if layout else ''})", "",
             f"{len(info['addresses'])} network namespaces ("
             + (f"layout `{layout}`: {info['layout_described']}" if layout else "two machines")
             + f"), each joined to one bridge by its own veth pair, `tc {q.get('tc', '?')}` on both "
             "ends (as `python -m benchmarks.link`); "
             + "; ".join(f"{h} ({a}) runs {info['sides'].get(h, 'nothing')}"
                         for h, a in info["addresses"].items())
             + '. All "machines" share this host\'s cores. Raw TCP bulk transfer between A and B, '
             'both directions at once: '
             + (f"A->B **{raw['a_to_b_gbit']:.3f}**, B->A **{raw['b_to_a_gbit']:.3f}** Gbit/s."
                if raw else f"not measured ({info.get('raw_error', '?')})."),
             "",
             "Where rank 0's step went (medians of each part; forward includes zero_grad; "
             "ours with overlap starts a pushpull per bucket from backward hooks, so its backward "
             "includes handing buckets to the store and its step() waits for what is still on "
             "the wire; DDP "
             "all-reduces its buckets inside backward, so its step() is the optimizer only):", "",
             "| contender | step ms | forward ms | backward ms | step() ms |",
             "|---|---:|---:|---:|---:|"]
    for name, s in summ.items():
        pm = s.get("parts_median")
        if pm:
            lines.append(f"| {s['shown']} | {s['median'] * ms:.1f} | {pm['forward'] * ms:.1f} | "
                         f"{pm['backward'] * ms:.1f} | {pm['step'] * ms:.1f} |")
    lines += _bytes_markdown(data)
    pr = data.get("prediction") or {}
    if not pr.get("rates"):
        return lines
    last = data["last_bucket_bytes"]
    wire = ("T_wire = 2(N-1)/N M/B = M/B (N = 2)" if not layout else
            f"T_wire = the busiest link direction's bytes / B: ours {pr['wire_bytes'] / 1e6:.1f} MB "
            f"({layout}, benchmarks/harness/layouts.py), DDP's ring over the worker hosts 2M(W-1)/W = "
            f"{pr['wire_bytes_ddp'] / 1e6:.1f} MB")
    lines += ["", "### Measured vs predicted (docs/performance.md section 6)", "",
              f"M = {pr['M_bytes'] / 1e6:.1f} MB; T_c = forward + backward of ours without overlap "
              f"(rank 0's median, all {data['config']['workers']} workers computing at once) = "
              f"{pr['T_fwd'] * ms:.1f} + {pr['T_bwd'] * ms:.1f} = **{pr['T_c'] * ms:.1f} ms**; "
              f"T_cpu = max(M k_w, (W M/S) k_s) + p (k_w + k_s) = {pr['T_cpu'] * ms:.1f} ms "
              f"(section 6's k_w, k_s); T_x = max(T_wire, T_cpu) + 2L with {wire}, L = 0.6 ms; "
              "measured exchange of ours without overlap (its step()): "
              + (f"**{pr['T_x_measured_nooverlap'] * ms:.1f} ms**. "
                 if pr.get("T_x_measured_nooverlap") else "- . ")
              + f"Last bucket backward completes: the Trainer's {last['trainer'] / 1e6:.2f} MB, "
              f"DDP's {last['ddp'] / 1e6:.2f} MB (buckets "
              f"{', '.join(f'{b / 1e6:.1f}' for b in last['ddp_buckets'])} MB).", ""]
    for which, p in pr["rates"].items():
        lines.append(f"- B = {which} rate: T_wire = {p['T_wire'] * ms:.1f} ms, T_x = "
                     f"{p['T_x'] * ms:.1f} ms" + ("." if not layout else
                                                  f"; DDP's T_wire = {p['T_wire_ddp'] * ms:.1f} ms, "
                                                  f"T_x = {p['T_x_ddp'] * ms:.1f} ms."))
    columns = ("docs_nominal", "docs_raw") + (() if layout else ("push_only_raw",))
    lines += ["",
              "Predicted step: no overlap T_c + T_x; overlap, as section 6 states it, max(T_c, T_x) "
              "+ the last bucket's exchange (for DDP: its own T_x and last bucket)"
              + ("." if layout else
                 "; and 'push-only overlap', what the Trainer did before a53461d (pushes from "
                 "backward hooks, every pull waiting for step(); at N = 2 half of each "
                 "direction's bytes are pushes, half replies): T_fwd + max(T_bwd, T_x/2) + "
                 "T_x/2."), "",
              "| contender | measured ms | predicted, section 6 (nominal B) ms | measured/pred. "
              "| predicted, section 6 (raw TCP B) ms | measured/pred. |"
              + ("" if layout else " push-only overlap (raw B) ms | measured/pred. |"),
              "|---|---:|" + "---:|---:|" * len(columns)]
    for name, e in pr["by_contender"].items():
        cells = []
        for key in columns:
            if e.get(key):
                cells += [f"{e[key] * ms:.1f}", f"{e['measured'] / e[key]:.2f}"]
            else:
                cells += ["-", "-"]
        lines.append(f"| {CONTENDERS[name].shown} | {e['measured'] * ms:.1f} | " + " | ".join(cells) + " |")
    for mode in ("server", "worker"):
        a, b = summ.get(f"ours-overlap-{mode}"), summ.get(f"ours-nooverlap-{mode}")
        if a and b:
            gain = 1 - a["median"] / b["median"]
            lines.append("")
            lines.append(f"Overlap, {'servers' if mode == 'server' else 'workers'} updating: "
                         f"{a['median'] * ms:.1f} vs {b['median'] * ms:.1f} ms without, "
                         f"{abs(gain) * 100:.0f} % {'faster' if gain >= 0 else 'slower'}.")
    return lines


def _bytes_markdown(data: dict) -> list[str]:
    """The bytes every host's interface sent / received per launch (mean over the
    launches), per step; with a layout also its wire model per step (ours: pushpull,
    DDP: the ring over the worker hosts)."""
    info, cfg = data["link"], data["config"]
    hosts = list(info["addresses"])
    steps = cfg["warmup"] + cfg["iters"]
    lines = ["", f"The bytes each host's link carried, sent / received in MB per step (a "
                 f"launch's interface counters / its {steps} steps, mean over the launches; "
                 "they include the start-up: ours' kv.init, DDP's broadcast of the weights):", "",
             "| contender | " + " | ".join(hosts) + " |", "|---|" + "---:|" * len(hosts)]

    def cells(per_host):
        return " | ".join(f"{per_host[h][0] / 1e6:.1f} / {per_host[h][1] / 1e6:.1f}"
                          if h in per_host and None not in per_host[h] else "-" for h in hosts)
    for name, s in data["summary"].items():
        got = [r["host_bytes"] for r in data["rows"] if r["contender"] == name and r.get("host_bytes")]
        mean = {h: tuple(statistics.fmean(g[h][d] for g in got) / steps
                         if all(g.get(h, {}).get(d) is not None for g in got) else None
                         for d in ("tx", "rx")) for h in hosts} if got else {}
        lines.append(f"| {s['shown']} | {cells(mean)} |")
    if info.get("layout"):
        layout = layouts.parse(info["layout"])
        m = cfg["num_params"] * 4
        for what, model in ((f"model: ours, {layout.key}", layout),
                            ("model: DDP's ring", layouts.Layout("ring", layout.workers, 0))):
            lines.append(f"| *{what}* | {cells(model.link_bytes('pushpull', m))} |")
    return lines
