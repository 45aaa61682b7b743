"""Gradient exchange of ResNet-50 over an emulated network link between two "machines".

    sudo python -m benchmarks.link                      # 1gbit and 4gbit, 2 interleaved launches
    python -m benchmarks.link --rates 10gbit --iters 20  # other rates (tc syntax: kbit, mbit, gbit)

Checks the step-time model of docs/performance.md section 6: with one worker per
machine and the servers co-located with the workers, a parameter server moves the
same bytes per link direction as a ring all-reduce, 2*(N-1)/N * M/B; and shows what
gradient compression (2bit, fp16: only the push half of the traffic shrinks) buys on
a slow link.

Two network namespaces ("machines" A and B, created here, removed at the end, even on
Ctrl-C or failure) joined by a veth pair, a token-bucket rate limit (tc tbf) on both
ends. First a raw TCP bulk transfer in both directions at once checks that the
emulated rate is real; then, per rate, interleaved launches of

  gloo  torch.distributed gloo, rank 0 in A (the rendezvous on A's address), rank 1 in B:
        one flat all_reduce (and DDP-style 25 MB buckets)
  ours  scheduler, server 0 and worker 0 in A; server 1 and worker 1 in B;
        the default transport: shared memory to the server on the same machine, tcp
        across the link (as a job over two real machines);
        pushpull of all 161 tensors: uncompressed, 2bit, fp16

Every process is started as ``ip netns exec NS PYTHON ...`` (an argument list) with the
environment a launcher would set (tracker/control/env.py ``for_process`` and a job secret, in
the environment only). The workers are benchmarks/contenders/{ours,gloo}_worker.py,
which verify every result. Writes link.md and link.json (every sample) to --out-dir.
Needs root (network namespaces); without it prints a "skipped" line and exits 0.

The namespaces, veth, tbf, link counters, raw TCP check and process placement are
benchmarks/netns.py (shared with ``benchmarks.trainer --link``); the wire-time model,
the summary and link.md are benchmarks/link_report.py.
"""


from __future__ import annotations

import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time

import click

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "benchmarks"

from benchmarks import common  # noqa: E402
from benchmarks.link_report import expected_link_bytes, markdown, summarise  # noqa: E402
from tracker.cli import parse_env  # noqa: E402
from benchmarks.netns import (Failed, Link, SetupFailed, gloo_ranks, on_sigterm,  # noqa: E402
                              parse_rate, ps_job, raw_check, server_urls,
                              expected_transports)
from benchmarks.contenders.base import read_result  # noqa: E402
from benchmarks.procs import GroupFailed, run_group  # noqa: E402
from benchmarks.resnet50_shapes import model_shapes  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTENDERS_DIR = os.path.join(REPO, "benchmarks", "contenders")
OURS_WORKER = os.path.join(CONTENDERS_DIR, "ours_worker.py")
GLOO_WORKER = os.path.join(CONTENDERS_DIR, "gloo_worker.py")
SERVER = os.path.join(CONTENDERS_DIR, "server_wrapper.py")   # kvstore.server's main + CPU stats
DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "link")

OURS_MODES = ("pushpull", "pushpull_2bit", "pushpull_fp16")
GLOO_MODES = ("flat", "buckets")


# -- one launch of each contender ------------------------------------------------------------

def run_ours(link: Link, cfg: dict, tag: str) -> dict:
    work = cfg["work"]
    out = os.path.join(work, f"{tag}.json")
    stats_dir = os.path.join(work, f"{tag}-servers")
    os.makedirs(stats_dir, exist_ok=True)
    worker = [sys.executable, OURS_WORKER, "--task", "sync", "--model", cfg["model"],
              "--modes", ",".join(OURS_MODES), "--iters", str(cfg["iters"]),
              "--warmup", str(cfg["warmup"]), "--latency-iters", "0", "--out", out]
    procs = ps_job(link, 2, 2, [sys.executable, SERVER], worker,
                   {"KVSTORE_LOG_LEVEL": "WARNING", "BENCH_SERVER_STATS": stats_dir,
                    **cfg.get("env", {})})
    try:
        run_group(procs, os.path.join(work, f"{tag}.log"), cfg["timeout"])
    except GroupFailed as e:
        raise Failed(f"ours ({tag}): {e}") from None
    res = read_result(out, f"ours ({tag})")
    kinds, urls = res.get("transports"), res.get("server_urls") or []
    if kinds is not None and list(kinds) != expected_transports(2):
        raise Failed(f"ours ({tag}): the client used {kinds}, not {expected_transports(2)}")
    if len(urls) != 2 or not all(u.startswith(w) for u, w in zip(urls, server_urls(link, 2))):
        raise Failed(f"ours ({tag}): servers at {urls}; expected server 0 on {link.addr['A']} "
                     f"and server 1 on {link.addr['B']} (tcp)")
    res["servers_usage"] = {f[:-5]: read_result(os.path.join(stats_dir, f), "server stats")
                            for f in sorted(os.listdir(stats_dir)) if f.endswith(".json")}
    return res


def run_gloo(link: Link, cfg: dict, tag: str) -> dict:
    work = cfg["work"]
    out = os.path.join(work, f"{tag}.json")
    argv = [sys.executable, GLOO_WORKER, "--model", cfg["model"], "--modes",
            ",".join(cfg["gloo_modes"]), "--iters", str(cfg["iters"]), "--warmup",
            str(cfg["warmup"]), "--latency-iters", "0", "--out", out]
    try:
        run_group(gloo_ranks(link, argv, 2, "gloo rank", {}), os.path.join(work, f"{tag}.log"),
                  cfg["timeout"])
    except GroupFailed as e:
        raise Failed(f"gloo ({tag}): {e}") from None
    return read_result(out, f"gloo ({tag})")


def _versions() -> dict:
    v = {"python": platform.python_version(), "kernel": platform.release(),
         "ours": common.kvstore_version()}
    try:
        import zmq
        v["pyzmq"] = f"pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()})"
    except ImportError:
        pass
    import numpy
    v["numpy"] = numpy.__version__
    try:
        import torch
        v["gloo"] = f"torch {torch.__version__}"
    except ImportError:
        pass
    try:
        v["iproute2"] = subprocess.run(["ip", "-V"], capture_output=True, text=True,
                                       timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return v


def _gloo_available() -> str | None:
    try:
        import torch.distributed as dist
    except ImportError as e:
        return f"torch is not installed ({e})"
    if not dist.is_available() or not dist.is_gloo_available():
        return "this torch build has no gloo backend"
    return None


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--rates", default="1gbit,4gbit", show_default=True,
              help="Link rates to emulate (tc units, comma-separated).")
@click.option("--model", type=click.Choice(["resnet50", "tiny"]), default="resnet50",
              show_default=True, help="Parameter set (tiny: for tests).")
@click.option("--iters", type=click.IntRange(min=1), default=10, show_default=True,
              help="Timed exchanges per launch and variant.")
@click.option("--warmup", type=click.IntRange(min=0), default=3, show_default=True,
              help="Untimed exchanges before them.")
@click.option("--launches", type=click.IntRange(min=1), default=2, show_default=True,
              help="Launches of each contender per rate, interleaved (the order alternates).")
@click.option("--gloo-modes", default=",".join(GLOO_MODES), show_default=True,
              help="gloo variants: flat and/or buckets.")
@click.option("--check-seconds", type=click.FloatRange(min=0.01), default=None,
              help="Duration of the raw TCP check per direction at the nominal rate "
                   "[default: 1.0, tiny: 0.1].")
@click.option("--out-dir", type=click.Path(file_okay=False), default=DEFAULT_OUT,
              show_default=True, help="Where link.md and link.json go.")
@click.option("--timeout", type=click.FloatRange(min=1), default=600, show_default=True,
              help="Seconds one launch may take before it is stopped and the run fails.")
@click.option("--env", "env_pairs", multiple=True, metavar="NAME=VALUE",
              help="Extra environment variable for our processes (repeatable), e.g. "
                   "KVSTORE_PIPELINE_BYTES=4194304.")
def main(rates, model, iters, warmup, launches, gloo_modes, check_seconds, out_dir, timeout,
         env_pairs):
    """Time the gradient exchange of ResNet-50 between two emulated machines (network
    namespaces joined by a rate-limited veth pair): gloo against ours (tcp across the link),
    uncompressed and compressed, against the wire time the step-time model predicts."""
    rate_list = [r.strip().lower() for r in rates.split(",") if r.strip()]
    try:
        for r in rate_list:
            parse_rate(r)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--rates")
    if not rate_list:
        raise click.BadParameter("no rate given", param_hint="--rates")
    gmodes = tuple(m.strip() for m in gloo_modes.split(",") if m.strip())
    bad = [m for m in gmodes if m not in GLOO_MODES]
    if bad or "flat" not in gmodes:
        raise click.BadParameter(f"choose from {', '.join(GLOO_MODES)} (flat is required)",
                                 param_hint="--gloo-modes")
    if check_seconds is None:
        check_seconds = 0.1 if model == "tiny" else 1.0
    shapes = model_shapes(model)
    nbytes = 4 * sum(math.prod(s) for s in shapes)
    signal.signal(signal.SIGTERM, on_sigterm)
    link = Link()
    work = tempfile.mkdtemp(prefix="kvlink-")
    extra = parse_env(env_pairs, "--env")
    cfg = {"model": model, "iters": iters, "warmup": warmup, "launches": launches,
           "gloo_modes": gmodes, "timeout": timeout, "work": work, "env": extra}
    data = {"command": " ".join(["python -m benchmarks.link", *sys.argv[1:]]),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "load_start": os.getloadavg()[0],
            "machine": common.machine(), "versions": _versions(), "nbytes": nbytes,
            "tensors": len(shapes), "namespaces": list(link.ns.values()),
            "addresses": dict(link.addr), "devices": dict(link.dev),
            "config": {k: v for k, v in cfg.items() if k != "work"} | {"rates": rate_list,
                                                                      "check_seconds": check_seconds},
            "rates": {}, "launches": [], "rows": [], "failures": [], "skipped": {}}
    gloo_why = _gloo_available()
    if gloo_why:
        data["skipped"]["gloo"] = gloo_why
        click.echo(f"skipped: gloo: {gloo_why}", err=True)
    interrupted = False
    try:
        try:
            link.up()
        except SetupFailed as e:
            click.echo(f"skipped: the emulated network cannot be set up here (needs root and "
                       f"network namespaces): {e}")
            return
        click.echo(f"link: namespaces {link.ns['A']} ({link.addr['A']}, {link.dev['A']}) <-> "
                   f"{link.ns['B']} ({link.addr['B']}, {link.dev['B']}); work dir {work}", err=True)
        contenders = ["gloo", "ours"] if not gloo_why else ["ours"]
        for rate in rate_list:
            run_rate(link, rate, check_seconds, contenders, cfg, nbytes, data)
    except KeyboardInterrupt:
        interrupted = True
        data["failures"].append("interrupted")
        click.echo("interrupted: cleaning up", err=True)
    finally:
        errors = link.down()
        for e in errors:
            click.echo(f"cleanup: {e}", err=True)
        data["failures"] += [f"cleanup: {e}" for e in errors]
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


def run_rate(link: Link, rate: str, check_seconds: float, contenders: list[str], cfg: dict,
             nbytes: int, data: dict) -> None:
    """One rate: the tbf limit, the raw TCP check, then ``cfg["launches"]`` interleaved
    launches of every contender; samples, launches and failures go into ``data``."""
    info = {"qdisc": link.set_rate(rate)}
    data["rates"][rate] = info
    nbits = parse_rate(rate)
    try:
        info["raw"] = raw_check(link, rate, check_seconds)
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
               + (f" (warning: {info['warning']})" if info.get("warning") else ""),
               err=True)
    launches, iters, warmup = cfg["launches"], cfg["iters"], cfg["warmup"]
    for launch_no in range(launches):
        order = contenders if launch_no % 2 == 0 else contenders[::-1]
        for c in order:
            tag = f"{c}-{rate}-{launch_no}"
            load = os.getloadavg()[0]
            before = link.counters()
            t0 = time.monotonic()
            try:
                res = (run_gloo if c == "gloo" else run_ours)(link, cfg, tag)
            except Failed as e:
                data["failures"].append(f"{c} at {rate} (launch {launch_no + 1}): {e}")
                click.echo(f"  {rate} launch {launch_no + 1} {c}: FAILED: {e}", err=True)
                continue
            counted = link.sent_since(before)
            modes = OURS_MODES if c == "ours" else cfg["gloo_modes"]
            data["launches"].append({
                "rate": rate, "launch": launch_no, "contender": c, "load_before": load,
                "seconds": time.monotonic() - t0, "link_bytes": counted,
                "model_link_bytes": expected_link_bytes(c, modes, iters + warmup, nbytes),
                "worker_usage_total": res.get("usage_total"),
                "servers_usage": res.get("servers_usage"),
                "transports": res.get("transports"), "server_urls": res.get("server_urls"),
                "torch_threads": res.get("torch_threads")})
            for mode in modes:
                d = res["modes"][mode]
                data["rows"].append({
                    "rate": rate, "contender": c, "mode": mode, "launch": launch_no,
                    "samples": d["times"], "unit": "s", "cpu_s": d.get("cpu_s"),
                    "minor_faults": d.get("minor_faults"),
                    "bytes_sent": d.get("bytes_sent"),
                    "bytes_received": d.get("bytes_received"), "load_before": load})
            click.echo(f"  {rate} launch {launch_no + 1}/{launches} {c}: "
                       f"{time.monotonic() - t0:.1f}s (load average before: {load:.2f})",
                       err=True)


if __name__ == "__main__":
    main()
