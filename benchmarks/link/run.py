"""Gradient exchange of ResNet-50 over emulated machines: gloo's ring against the
parameter server co-located with the workers and on dedicated server hosts.

    sudo python -m benchmarks.link                                   # every layout at 500mbit
    python -m benchmarks.link --layouts ring:4,dedicated:4x4 --rates 1gbit --iters 5
    python -m benchmarks.link --half-rate ring:4,dedicated:4x4       # + those at 250mbit

H emulated hosts (benchmarks/harness/netns.py ``Cluster``: a network namespace each, created
here and removed at the end, even on Ctrl-C or failure), each with its own link of
the same rate to one bridge (a veth pair, tc tbf on both ends: full duplex). Worker
hosts are A, B, C, D; server hosts S0..S3. Layouts (benchmarks/harness/layouts.py):

  ring:W           torch.distributed gloo, rank r on worker host r: one flat all_reduce
                   and DDP-style 25 MB buckets
  colo:W           ours, server r and worker r on worker host r (shared memory to the
                   server on the same host, tcp to the others, as a job over W machines)
  dedicated:WxS    ours, worker r on worker host r, server s on server host s (tcp)

Ours: pushpull of all 161 tensors (co-located also with 2bit compression); the
scheduler on host A. For each layout and variant the table gives the wire bound
(the bytes on the busiest link direction / the link rate) next to the measured
median. ``--half-rate`` runs some layouts again at half the first rate: where the
link, not this machine's CPU, is the bottleneck, the time doubles. First a raw TCP
bulk transfer between A and B, both directions at once, checks that the emulated
rate is real.

Every process is started as ``ip netns exec NS PYTHON ...`` (an argument list) with
the environment a launcher would set (tracker/control/env.py ``for_process``; the
job secret in the environment only). The workers are
benchmarks/harness/contenders/{ours,gloo}_worker.py, which verify every sum exactly. Writes
link.md and link.json (every sample) to --out-dir (default: a new scratch directory;
``--record``: benchmarks/results/link). Needs root (network namespaces);
without it prints a "skipped" line and exits 0. The wire model, the summary and
link.md are benchmarks/link/report.py.
"""


from __future__ import annotations

import math
import os
import signal
import sys
import tempfile
import time
from typing import Any

import click

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    __package__ = "benchmarks.link"

from benchmarks.harness import common, layouts as layout_specs  # noqa: E402
from benchmarks.harness.output import ResultsDir  # noqa: E402
from benchmarks.harness.contenders.base import read_result  # noqa: E402
from benchmarks.harness.contenders.gloo import WORKER as GLOO_WORKER  # noqa: E402
from benchmarks.harness.exchange import effective_settings, modes_of, run_ours, versions  # noqa: E402
from benchmarks.harness.layouts import Layout  # noqa: E402
from benchmarks.harness.netns import Cluster, Failed, gloo_ranks, on_sigterm, parse_rate, raw_check  # noqa: E402
from benchmarks.harness.procs import GroupFailed, run_group  # noqa: E402
from benchmarks.harness.resnet50_shapes import model_shapes  # noqa: E402
from benchmarks.link.report import expected_link_bytes, markdown, summarise  # noqa: E402
from benchmarks.link.timeline import Sampler, render  # noqa: E402
from tracker.cli import parse_env  # noqa: E402

OUTPUT = ResultsDir("link", "link")

DEFAULT_LAYOUTS = ("ring:2,colo:2,dedicated:2x2,dedicated:2x1,"
                   "ring:4,colo:4,dedicated:4x4,dedicated:4x2")
OURS_MODES = ("pushpull", "pushpull_2bit", "pushpull_fp16")
GLOO_MODES = ("flat", "buckets")


# -- one launch of a layout (ours: benchmarks.harness.exchange.run_ours) -------------------------

def run_gloo(cluster: Cluster, layout: Layout, cfg: dict, tag: str) -> dict:
    work = cfg["work"]
    out = os.path.join(work, f"{tag}.json")
    argv = [sys.executable, GLOO_WORKER, "--model", cfg["model"], "--modes",
            ",".join(modes_of(layout, cfg)), "--iters", str(cfg["iters"]), "--warmup",
            str(cfg["warmup"]), "--latency-iters", "0", "--out", out]
    try:
        run_group(gloo_ranks(cluster, argv, layout.workers, "gloo rank", {},
                             hosts=layout.worker_hosts),
                  os.path.join(work, f"{tag}.log"), cfg["timeout"])
    except GroupFailed as e:
        raise Failed(f"gloo ({tag}): {e}") from None
    return read_result(out, f"gloo ({tag})")


def _gloo_available() -> str | None:
    try:
        import torch.distributed as dist
    except ImportError as e:
        return f"torch is not installed ({e})"
    if not dist.is_available() or not dist.is_gloo_available():
        return "this torch build has no gloo backend"
    return None


def _modes(text: str, allowed, option: str, required: str | None = None) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in allowed]
    if bad or not modes or (required and required not in modes):
        raise click.BadParameter(f"choose from {', '.join(allowed)}"
                                 + (f" ({required} is required)" if required else ""),
                                 param_hint=option)
    return modes


def half_rate(rate: str) -> str:
    return f"{parse_rate(rate) / 2 / 1e6:g}mbit"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--rates", default="500mbit", show_default=True,
              help="Link rates to emulate (tc units, comma-separated).")
@click.option("--layouts", "layout_text", default=DEFAULT_LAYOUTS, show_default=True,
              help="ring:W, colo:W, dedicated:WxS (comma-separated).")
@click.option("--half-rate", "half_text", default="", metavar="LAYOUTS",
              help="Run these layouts again at half the first rate (is the link the bottleneck?).")
@click.option("--timeline", "timeline_text", default="", metavar="LAYOUTS",
              help="For these layouts, sample every link's use every 20 ms and show the last "
                   "exchange in 100 ms steps (where the time goes).")
@click.option("--model", type=click.Choice(["resnet50", "tiny"]), default="resnet50",
              show_default=True, help="Parameter set (tiny: for tests).")
@click.option("--iters", type=click.IntRange(min=1), default=5, show_default=True,
              help="Timed exchanges per launch and variant.")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True,
              help="Untimed exchanges before them.")
@click.option("--launches", type=click.IntRange(min=1), default=1, show_default=True,
              help="Launches of each layout per rate, interleaved (the order alternates).")
@click.option("--gloo-modes", default=",".join(GLOO_MODES), show_default=True,
              help="gloo variants (ring): flat and/or buckets.")
@click.option("--colo-modes", default="pushpull,pushpull_2bit", show_default=True,
              help="Ours co-located: pushpull, pushpull_2bit, pushpull_fp16.")
@click.option("--dedicated-modes", default="pushpull", show_default=True,
              help="Ours on dedicated server hosts: the same choices.")
@click.option("--check-seconds", type=click.FloatRange(min=0.01), default=None,
              help="Duration of the raw TCP check per direction at the nominal rate "
                   "[default: 1.0, tiny: 0.1].")
@click.option("--timeout", type=click.FloatRange(min=1), default=600, show_default=True,
              help="Seconds one launch may take before it is stopped and the run fails.")
@click.option("--env", "env_pairs", multiple=True, metavar="NAME=VALUE",
              help="Extra environment variable for our processes (repeatable), e.g. "
                   "KVSTORE_PIPELINE_BYTES=4194304.")
@OUTPUT.click_options
def main(rates, layout_text, half_text, timeline_text, model, iters, warmup, launches, gloo_modes, colo_modes,
         dedicated_modes, check_seconds, out_dir, timeout, env_pairs):
    """Time the gradient exchange of ResNet-50 between emulated machines (network
    namespaces, each with its own rate-limited link to one bridge): gloo's ring
    against ours co-located and on dedicated server hosts, each against its wire bound."""
    rate_list = [r.strip().lower() for r in rates.split(",") if r.strip()]
    try:
        for r in rate_list:
            parse_rate(r)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--rates")
    if not rate_list:
        raise click.BadParameter("no rate given", param_hint="--rates")
    try:
        chosen = layout_specs.parse_list(layout_text)
        halved = layout_specs.parse_list(half_text)
        sampled = {layout.key for layout in layout_specs.parse_list(timeline_text)}
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--layouts / --half-rate / --timeline")
    if not chosen:
        raise click.BadParameter("no layout given", param_hint="--layouts")
    modes = {"ring": _modes(gloo_modes, GLOO_MODES, "--gloo-modes", "flat"),
             "colo": _modes(colo_modes, OURS_MODES, "--colo-modes"),
             "dedicated": _modes(dedicated_modes, OURS_MODES, "--dedicated-modes")}
    if check_seconds is None:
        check_seconds = 0.1 if model == "tiny" else 1.0
    shapes = model_shapes(model)
    nbytes = 4 * sum(math.prod(s) for s in shapes)
    gloo_why = _gloo_available()
    if gloo_why:
        chosen = [layout for layout in chosen if layout.kind != "ring"]
        halved = [layout for layout in halved if layout.kind != "ring"]
    plan = [(rate, chosen) for rate in rate_list] + ([(half_rate(rate_list[0]), halved)]
                                                     if halved else [])
    signal.signal(signal.SIGTERM, on_sigterm)
    cluster = Cluster(layout_specs.hosts_for(chosen + halved))
    work = tempfile.mkdtemp(prefix="kvlink-")
    cfg = {"model": model, "iters": iters, "warmup": warmup, "launches": launches,
           "modes": modes, "timeout": timeout, "work": work, "timeline": sorted(sampled),
           "env": parse_env(env_pairs, "--env")}
    data = {"command": " ".join(["python -m benchmarks.link", *sys.argv[1:]]),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "load_start": os.getloadavg()[0],
            "machine": common.machine(), "versions": versions(), "nbytes": nbytes,
            "tensors": len(shapes), "namespaces": [cluster.switch, *cluster.ns.values()],
            "addresses": dict(cluster.addr), "devices": dict(cluster.dev),
            "config": {k: v for k, v in cfg.items() if k != "work"} | {
                "rates": rate_list, "check_seconds": check_seconds,
                "layouts": [layout.key for layout in chosen],
                # what our processes ran with (defaults change between versions)
                "effective": effective_settings(cfg["env"]),
                "half_rate": {"rate": plan[-1][0], "layouts": [la.key for la in halved]}
                if halved else None},
            "rates": {}, "launches": [], "rows": [], "failures": [], "skipped": {}}
    if gloo_why:
        data["skipped"]["gloo"] = gloo_why
        click.echo(f"skipped: gloo (the ring layouts): {gloo_why}", err=True)
    interrupted = False
    try:
        if not cluster.up_or_skip():
            return
        click.echo(f"cluster: {len(cluster.hosts)} hosts "
                   + ", ".join(f"{h} {cluster.addr[h]}" for h in cluster.hosts)
                   + f" on bridge {cluster.switch}; work dir {work}", err=True)
        for rate, these in plan:
            run_rate(cluster, rate, check_seconds, these, cfg, nbytes, data)
    except KeyboardInterrupt:
        interrupted = True
        data["failures"].append("interrupted")
        click.echo("interrupted: cleaning up", err=True)
    finally:
        errors = cluster.down()
        for problem in errors:
            click.echo(f"cleanup: {problem}", err=True)
        data["failures"] += [f"cleanup: {problem}" for problem in errors]
    if interrupted:   # leave the results of an earlier, complete run in place
        click.echo("interrupted: no results written", err=True)
        sys.exit(130)
    data["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    data["load_end"] = os.getloadavg()[0]
    data["loads"] = [L["load_before"] for L in data["launches"]] or [data["load_start"]]
    data["summary"] = summarise(data["rows"], {r: i for r, i in data["rates"].items()
                                               if "raw" in i}, nbytes)
    table = markdown(data)
    os.makedirs(out_dir, exist_ok=True)
    common.write_json(os.path.join(out_dir, "link.json"), data)
    with open(os.path.join(out_dir, "link.md"), "w") as f:
        f.write(table)
    click.echo(table)
    click.echo(f"md: {os.path.relpath(os.path.join(out_dir, 'link.md'))}")
    click.echo(f"json: {os.path.relpath(os.path.join(out_dir, 'link.json'))}")
    if data["failures"]:
        click.echo("\nFAILED:\n" + "\n".join(data["failures"]), err=True)
        sys.exit(1)
    click.echo(f"(logs in {work})", err=True)


def run_rate(cluster: Cluster, rate: str, check_seconds: float, chosen: list[Layout], cfg: dict,
             nbytes: int, data: dict) -> None:
    """One rate: the tbf limit on every link, the raw TCP check, then
    ``cfg["launches"]`` interleaved launches of every layout; samples, launches and
    failures go into ``data``."""
    info: dict[str, Any] = {"qdisc": cluster.set_rate(rate), "layouts": [layout.key for layout in chosen]}
    data["rates"][rate] = info
    nbits = parse_rate(rate)
    try:
        info["raw"] = raw_check(cluster, rate, check_seconds)
    except Failed as e:
        data["failures"].append(f"raw TCP check at {rate}: {e}")
        click.echo(f"  {rate}: raw TCP check FAILED: {e}", err=True)
        return
    raw = info["raw"]
    low = min(raw["a_to_b_gbit"], raw["b_to_a_gbit"]) * 1e9
    if low < 0.85 * nbits:
        info["warning"] = (f"the raw TCP rate ({low / 1e9:.2f} Gbit/s) is below 85 % of "
                           f"the nominal {nbits / 1e9:g} Gbit/s: this machine cannot "
                           "drive the emulated link at full rate")
    click.echo(f"  {rate}: raw TCP both ways at once: A->B {raw['a_to_b_gbit']:.3f}, "
               f"B->A {raw['b_to_a_gbit']:.3f} Gbit/s"
               + (f" (warning: {info['warning']})" if info.get("warning") else ""), err=True)
    for launch_no in range(cfg["launches"]):
        for layout in (chosen if launch_no % 2 == 0 else chosen[::-1]):
            launch(cluster, rate, layout, launch_no, cfg, nbytes, data)


def launch(cluster: Cluster, rate: str, layout: Layout, launch_no: int, cfg: dict, nbytes: int,
           data: dict) -> None:
    """One launch of ``layout``: its samples (rows), bytes on every link, failures."""
    tag = f"{layout.key.replace(':', '')}-{rate}-{launch_no}"
    load = os.getloadavg()[0]
    before = cluster.host_counters()
    sampled = os.path.join(cfg["work"], f"{tag}-links.jsonl")
    t0 = time.monotonic()
    try:
        run = run_gloo if layout.kind == "ring" else run_ours
        if layout.key in cfg["timeline"]:
            with Sampler(cluster, sampled):
                res = run(cluster, layout, cfg, tag)
        else:
            res = run(cluster, layout, cfg, tag)
    except Failed as e:
        data["failures"].append(f"{layout.key} at {rate} (launch {launch_no + 1}): {e}")
        click.echo(f"  {rate} {layout.key} launch {launch_no + 1}: FAILED: {e}", err=True)
        return
    seconds = time.monotonic() - t0
    after = cluster.host_counters()
    counted = cluster.counted(before, after, layout.hosts)
    modes = modes_of(layout, cfg)
    data["launches"].append({
        "rate": rate, "layout": layout.key, "launch": launch_no, "contender": layout.contender,
        "load_before": load, "seconds": seconds, "link_bytes": counted,
        "model_link_bytes": expected_link_bytes(layout, modes, cfg["iters"] + cfg["warmup"],
                                                nbytes),
        "worker_usage_total": res.get("usage_total"), "servers_usage": res.get("servers_usage"),
        "transports": res.get("transports"), "server_urls": res.get("server_urls"),
        "torch_threads": res.get("torch_threads"),
        "timeline": render(sampled, cluster.hosts, layout.hosts, layout.worker_hosts,
                           parse_rate(rate) / 8)
        if layout.key in cfg["timeline"] else None})
    for mode in modes:
        d = res["modes"][mode]
        data["rows"].append({
            "rate": rate, "layout": layout.key, "contender": layout.contender, "mode": mode,
            "launch": launch_no, "samples": d["times"], "unit": "s", "cpu_s": d.get("cpu_s"),
            "minor_faults": d.get("minor_faults"), "bytes_sent": d.get("bytes_sent"),
            "bytes_received": d.get("bytes_received"), "load_before": load})
    click.echo(f"  {rate} {layout.key} launch {launch_no + 1}/{cfg['launches']}: {seconds:.1f}s "
               f"(load average before: {load:.2f}); medians: " + ", ".join(
                   f"{m} {common.stats(res['modes'][m]['times'])['median'] * 1e3:.0f} ms"
                   for m in modes), err=True)


if __name__ == "__main__":
    main()
