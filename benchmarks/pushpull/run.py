"""Gradient exchange of the ResNet-50 parameter set: ours against its peers, side by side.

    python -m benchmarks.pushpull --setup-peers      # once: MXNet and Ray venvs
    python -m benchmarks.pushpull                    # W=2, S=2, 3 interleaved launches
    python -m benchmarks.pushpull --profile          # + where our time goes (cProfile)
    python -m benchmarks.pushpull --contenders ours --before HEAD   # this tree vs the last commit

Contenders, all on the same bytes (161 fp32 tensors, 102.2 MB), the same W, this
machine, each verifying the summed result of every iteration:

  ours      dist_sync push-then-pull and pushpull through tracker's launcher,
            per transport (KVSTORE_TRANSPORT: tcp, ipc, and shm = the default
            on one host; hosts = W emulated hosts, server r with worker r, tcp
            between hosts and shm within); per-key latency; dist_async updates/s
  gloo      torch.distributed: all_reduce per tensor, one flat, 25 MB buckets
  mxnet     MXNet 1.9.1's dist_sync kvstore (benchmarks/.venv-mxnet)
  ray       a Ray actor parameter server as in Ray's docs (benchmarks/.venv-ray)
  ceilings  ZeroMQ one-way tcp/ipc for the same bytes, numpy copy/add, our
            server's sum/update in process
  ours@REF  with --before REF: ours as commit REF has it (a temporary git
            worktree; its launcher, servers and workers run from there), to
            show "no slowdown against the commit before" in one run

Each launch of each contender runs warm-up iterations, then timed ones; launches
are interleaved (the order rotates every round). Writes a markdown table, a JSON
file and a PNG chart to --out-dir (default: a new scratch directory; ``--record``:
benchmarks/results); exits 1 if any contender fails or returns a
wrong sum, 0 otherwise (skipped peers are reported, not failures).
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
import tempfile
import time

import click

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    __package__ = "benchmarks.pushpull"

from benchmarks.harness import common  # noqa: E402
from benchmarks.harness.output import ResultsDir  # noqa: E402
from benchmarks.pushpull import report  # noqa: E402
from benchmarks.harness.contenders import ceilings, gloo, ours  # noqa: E402
from benchmarks.harness.contenders.base import Failed, RunConfig, Skip  # noqa: E402
from benchmarks.harness.peers import mxnet_peer  # noqa: E402
from benchmarks.harness.peers import ray_peer  # noqa: E402
from benchmarks.harness.peers import venvs  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUTPUT = ResultsDir("pushpull", "")


def _ours_version() -> str:
    return common.kvstore_version()


CONTENDERS = {
    "ours": (_ours_version, ours.run),
    "gloo": (gloo.version, gloo.run),
    "mxnet": (mxnet_peer.version, mxnet_peer.run),
    "ray": (ray_peer.version, ray_peer.run),
    "ceilings": (ceilings.version, ceilings.run),
}


def _csv(ctx, param, value):
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    known = {"contenders": CONTENDERS, "transports": ours.TRANSPORTS,
             "compression": ("2bit", "1bit", "fp16")}.get(param.name)
    if known is not None:
        bad = [v for v in items if v not in known]
        if bad:
            raise click.BadParameter(f"unknown {', '.join(bad)}; choose from {', '.join(known)}")
    return items


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-w", "--workers", type=click.IntRange(min=1), default=2, show_default=True,
              help="W: worker processes (gloo ranks, Ray worker actors).")
@click.option("-s", "--servers", type=click.IntRange(min=1), default=2, show_default=True,
              help="S: server processes of ours and of MXNet (Ray's docs use one server actor).")
@click.option("--model", type=click.Choice(["resnet50", "tiny"]), default="resnet50",
              show_default=True, help="Parameter set (tiny: for tests).")
@click.option("--iters", type=click.IntRange(min=1), default=8, show_default=True,
              help="Timed iterations per launch and variant.")
@click.option("--warmup", type=click.IntRange(min=0), default=3, show_default=True,
              help="Untimed iterations before them.")
@click.option("--launches", type=click.IntRange(min=1), default=3, show_default=True,
              help="Launches of every contender, interleaved.")
@click.option("--contenders", callback=_csv, default=",".join(CONTENDERS), show_default=True,
              help="Which to run (comma-separated).")
@click.option("--transports", callback=_csv, default=",".join(ours.TRANSPORTS), show_default=True,
              help="Our transports to try (unavailable ones are skipped with the reason).")
@click.option("--compression", callback=_csv, default="2bit,1bit,fp16", show_default=True,
              help="Gradient compression types to time ours with (pushpull over tcp and shm; "
                   "empty: none).")
@click.option("--latency-iters", type=click.IntRange(min=0), default=200, show_default=True,
              help="Timed single-key exchanges per size (0: skip latency).")
@click.option("--latency-sizes", default="1,1024,16384", show_default=True,
              help="fp32 values per key for the latency test.")
@click.option("--async-pushes", type=click.IntRange(min=0), default=500, show_default=True,
              help="Pushes per worker and repetition in the dist_async test (0: skip it).")
@click.option("--name", default="pushpull", show_default=True, help="Base name of the result files.")
@click.option("--setup-peers", is_flag=True,
              help="Create benchmarks/.venv-mxnet and .venv-ray (pip install) before running.")
@click.option("--setup-only", is_flag=True, help="With --setup-peers: set up, then exit.")
@click.option("--profile", is_flag=True,
              help="Also run ours once per transport (tcp, shm) under cProfile (worker 0 and "
                   "every server) and report where the time goes.")
@click.option("--env", "env_pairs", multiple=True, metavar="NAME=VALUE",
              help="Extra environment variable for every process of every contender (repeatable), "
                   "e.g. to try a setting: --env MALLOC_MMAP_THRESHOLD_=33554432.")
@click.option("--no-chart", is_flag=True, help="Skip the PNG (no matplotlib needed).")
@click.option("--timeout", type=click.FloatRange(min=1), default=600, show_default=True,
              help="Seconds one launch may take before it is stopped and the run fails.")
@click.option("--before", metavar="REF",
              help="Also run ours as git commit REF has it (checked out into a temporary "
                   "worktree, PYTHONPATH pointing there), interleaved launch by launch with this "
                   "tree; its rows are labelled ours@REF. Needs ours in --contenders.")
@OUTPUT.click_options
def main(workers, servers, model, iters, warmup, launches, contenders, transports, compression,
         latency_iters,
         latency_sizes, async_pushes, out_dir, name, setup_peers, setup_only, profile, env_pairs,
         no_chart, timeout, before):
    """Time one full gradient exchange of ResNet-50 (W workers, S servers): ours vs
    torch gloo, MXNet 1.9.1, a Ray actor PS and the machine's ceilings."""
    if setup_peers:
        for peer in venvs.PEERS.values():
            ok, line = venvs.setup(peer, log=lambda m: click.echo(m, err=True))
            click.echo(f"[setup] {peer.name}: {'ready, ' if ok else 'NOT usable: '}{line}", err=True)
        if setup_only:
            return
    if before and "ours" not in contenders:
        raise click.BadParameter("compares ours with ours@REF: add ours to --contenders",
                                 param_hint="--before")
    extra_env = {}
    for pair in env_pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not NAME=VALUE", param_hint="--env")
        extra_env[key] = value
    os.makedirs(out_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="kvbench-")
    cfg = RunConfig(workers=workers, servers=servers, model=model, iters=iters, warmup=warmup,
                    latency_iters=latency_iters,
                    latency_sizes=tuple(int(x) for x in latency_sizes.split(",") if x),
                    async_pushes=async_pushes, transports=transports, compression=compression,
                    work_dir=work,
                    timeout=timeout, env=extra_env, profile=profile)
    info = {"machine": common.machine(), "versions": {}, "skipped": {},
            "config": {k: v for k, v in cfg.__dict__.items() if k != "work_dir"},
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    info["versions"]["python"] = platform.python_version()
    with contextlib.ExitStack() as stack:      # the worktree of --before, removed at the end
        runners = dict(CONTENDERS)
        if before:
            try:
                tree, commit = stack.enter_context(ours.worktree(before))
            except Failed as e:
                raise click.BadParameter(str(e), param_hint="--before") from None
            label = f"ours@{before}"
            runners[label] = (lambda: f"kvstore {commit} (git worktree of {before})",
                              lambda cfg, n: ours.run_in_tree(tree, label, cfg, n))
            at = contenders.index("ours") + 1      # right after ours: they alternate in every launch
            contenders = contenders[:at] + (label,) + contenders[at:]
        active = []
        for c in contenders:
            version, _ = runners[c]
            try:
                info["versions"][c] = version()
                active.append(c)
            except Skip as e:
                info["skipped"][c] = str(e)
        if "ours" in active:
            _, why = ours.available_transports(cfg)
            for line in why:
                info["skipped"][line.split(":")[0]] = line.split(": ", 1)[1]
        _echo_header(info, cfg, launches)
        rows, failures = _launches(runners, active, cfg, launches, info)
    summary = report.summarise(rows, cfg)
    profile_text = None
    if profile and "ours" in active and not failures:
        texts, summary["profile"] = [], {}
        for t in [t.name for t in ours.available_transports(cfg)[0] if t.name in ("tcp", "shm")]:
            click.echo(f"  profiling ours ({t}) under cProfile ...", err=True)
            try:
                text, summary["profile"][t] = report.profile_ours(cfg, t)
                texts.append(text)
            except Failed as e:
                failures.append(f"ours (profile, {t}): {e}")
        profile_text = "\n\n".join(texts) or None
    data = {**info, "failures": failures, "summary": summary, "rows": rows,
            "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    table = report.markdown(data)
    paths = {"json": os.path.join(out_dir, f"{name}.json"), "md": os.path.join(out_dir, f"{name}.md")}
    common.write_json(paths["json"], data)
    with open(paths["md"], "w") as f:
        f.write(table)
    if profile_text:
        paths["profile"] = os.path.join(out_dir, f"{name}-profile.txt")
        with open(paths["profile"], "w") as f:
            f.write(profile_text)
    if not no_chart and rows:
        paths["png"] = os.path.join(out_dir, f"{name}.png")
        why = report.chart(data, paths["png"])
        if why:
            click.echo(f"no chart: {why}", err=True)
            paths.pop("png")
    click.echo(table)
    for kind, p in paths.items():
        click.echo(f"{kind}: {os.path.relpath(p)}")
    if failures:
        click.echo("\nFAILED:\n" + "\n".join(failures), err=True)
        sys.exit(1)


def _launches(runners: dict, active: list, cfg, launches: int, info: dict) -> tuple[list, list]:
    """Every launch runs each active contender once, the order rotating every launch
    (drift on a shared machine then hits all of them alike): (rows, failures)."""
    rows, failures = [], []
    for launch_no in range(launches):
        order = active[launch_no % max(1, len(active)):] + active[:launch_no % max(1, len(active))]
        for c in order:
            load = os.getloadavg()[0]
            t0 = time.monotonic()
            try:
                got = runners[c][1](cfg, launch_no)
            except Skip as e:
                info["skipped"][c] = str(e)
                click.echo(f"  launch {launch_no + 1}/{launches} {c}: skipped: {e}", err=True)
                continue
            except (Failed, common.WrongResult) as e:
                failures.append(f"{c} (launch {launch_no + 1}): {e}")
                click.echo(f"  launch {launch_no + 1}/{launches} {c}: FAILED: {e}", err=True)
                continue
            for r in got:
                r["load_before"] = load
            rows += got
            click.echo(f"  launch {launch_no + 1}/{launches} {c}: {len(got)} results in "
                       f"{time.monotonic() - t0:.1f}s (load average before: {load:.2f})", err=True)
    return rows, failures


def _echo_header(info, cfg, launches) -> None:
    m = info["machine"]
    click.echo(f"machine: {m.get('cpu_model', m.get('processor'))}, {m['cpus']} cpus, "
               f"{m.get('mem_total', '?')}, {m['platform']}", err=True)
    for k, v in info["versions"].items():
        click.echo(f"version: {k}: {v}", err=True)
    for k, v in info["skipped"].items():
        click.echo(f"skipped: {k}: {v}", err=True)
    click.echo(f"W={cfg.workers} S={cfg.servers} model={cfg.model} launches={launches} "
               f"iters={cfg.iters} (+{cfg.warmup} warm-up) per launch", err=True)


if __name__ == "__main__":
    main()
