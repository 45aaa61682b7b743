"""Before and after of each data-path technique, interleaved in one session.

    python -m benchmarks.techniques --before b8f66fa --rounds 3
    python -m benchmarks.techniques --record                 # into benchmarks/results/techniques
    python -m benchmarks.techniques --model tiny --steps 3,4 --rounds 1   # a smoke run of two steps

Each configuration is one launch of ``python -m benchmarks.pushpull`` (ResNet-50,
W=2, S=2 unless given) with settings that switch on one technique after another;
the configurations take turns, the order rotating every round, so that the
shared machine's drift hits all of them alike. ``--before REF`` adds the code of
that git commit (extracted with ``git archive``) as the first step. Writes
``techniques.json`` (every sample) and ``techniques.md`` to --out-dir, by default
a new scratch directory (printed), or with ``--record`` to
benchmarks/results/techniques.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import click

from benchmarks.harness.output import ResultsDir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUTPUT = ResultsDir("techniques", "techniques")
RECORD_DIR = OUTPUT.record_dir
NO_PIPE = {"KVSTORE_PIPELINE_BYTES": "0"}

# (name, settings): transports/contenders/-w/-s for benchmarks.pushpull and extra environment
LADDER = [
    ("one-pass sum", {"transports": "tcp", "env": {"KVSTORE_MALLOC_TUNING": "0", **NO_PIPE}}),
    ("+ malloc tuning", {"transports": "tcp", "env": NO_PIPE}),
    ("+ pipelining = tcp today", {"transports": "tcp"}),
    ("ipc", {"transports": "ipc"}),
    ("shm (default on one host)", {"transports": "shm"}),
    ("W=1 S=1 tcp, no pipelining", {"transports": "tcp", "w": 1, "s": 1, "env": NO_PIPE}),
    ("W=1 S=1 tcp, pipelining", {"transports": "tcp", "w": 1, "s": 1}),
    ("gloo (reference)", {"contenders": "gloo"}),
]


def _run(cwd: str, c: dict, iters: int, out_dir: str, model: str = "resnet50") -> dict:
    args = [sys.executable, "-m", "benchmarks.pushpull", "--model", model, "--contenders", c.get("contenders", "ours"),
            "--transports", c.get("transports", "tcp"), "-w", str(c.get("w", 2)), "-s", str(c.get("s", 2)),
            "--launches", "1", "--iters", str(iters), "--warmup", "3", "--latency-iters", "0",
            "--async-pushes", "0", "--no-chart", "--out-dir", out_dir, "--name", "step"]
    for k, v in c.get("env", {}).items():
        args += ["--env", f"{k}={v}"]
    p = subprocess.run(args, capture_output=True, text=True, cwd=cwd)
    if p.returncode != 0:
        raise click.ClickException(f"{' '.join(args)} failed:\n{p.stderr[-3000:]}")
    with open(os.path.join(out_dir, "step.json")) as f:
        return json.load(f)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--before", metavar="GIT_REF", help="Also run this commit's code first (e.g. b8f66fa).")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--iters", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--model", type=click.Choice(["resnet50", "tiny"]), default="resnet50", show_default=True)
@click.option("--steps", default="", metavar="N,N,...",
              help=f"Only these steps of the ladder (1-{len(LADDER)}, in its order) [default: all].")
@OUTPUT.click_options
def main(before, rounds, iters, model, steps, out_dir):
    """Time the technique ladder, interleaved; print and save medians per step."""
    try:
        chosen = sorted({int(n) for n in steps.split(",") if n.strip()}) or list(range(1, len(LADDER) + 1))
    except ValueError:
        raise click.BadParameter(f"{steps!r} is not a list of step numbers", param_hint="--steps") from None
    if not all(1 <= n <= len(LADDER) for n in chosen):
        raise click.BadParameter(f"steps are 1-{len(LADDER)}, got {steps!r}", param_hint="--steps")
    ladder = [LADDER[n - 1] for n in chosen]
    work = tempfile.mkdtemp(prefix="kvtech-")
    if before:
        old = os.path.join(work, "before")
        os.makedirs(old)
        archive = subprocess.run(["git", "-C", REPO, "archive", before], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", old], input=archive.stdout, check=True)
        for venv in (".venv-mxnet", ".venv-ray"):
            if os.path.isdir(os.path.join(REPO, "benchmarks", venv)):
                os.symlink(os.path.join(REPO, "benchmarks", venv), os.path.join(old, "benchmarks", venv))
        ladder.insert(0, (f"before ({before})", {"transports": "tcp", "cwd": old}))
    os.makedirs(out_dir, exist_ok=True)
    samples: dict = {}
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    for r in range(rounds):
        order = ladder[r % len(ladder):] + ladder[:r % len(ladder)]
        for name, c in order:
            data = _run(c.get("cwd", REPO), c, iters, work, model)
            for row in data["rows"]:
                if row["kind"] != "exchange":
                    continue
                s = samples.setdefault(f"{name} | {row['contender']} {row['variant']}",
                                       {"times": [], "worker_cpu_s": [], "server_cpu_s_per_job": []})
                s["times"] += row["samples"]
                s["worker_cpu_s"].append(row.get("cpu_s"))
                usage = row.get("server_usage_total") or {}
                if usage:
                    s["server_cpu_s_per_job"].append(sum(u["cpu_s"] for u in usage.values()))
            click.echo(f"round {r + 1}/{rounds}: {name} done", err=True)
    lines = [f"Technique ladder, {started} .. {time.strftime('%Y-%m-%d %H:%M:%S')}, {rounds} "
             f"interleaved rounds x {iters} timed exchanges ({'ResNet-50, 102.2 MB per worker' if model == 'resnet50' else model}).", "",
             "| step | variant | median ms | n | worker CPU ms/exchange | servers' CPU s/job |",
             "|---|---|---:|---:|---:|---:|"]
    for key, s in samples.items():
        step, variant = key.split(" | ", 1)
        cpu = [x for x in s["worker_cpu_s"] if x is not None]
        srv = s["server_cpu_s_per_job"]
        lines.append(f"| {step} | {variant} | **{statistics.median(s['times']) * 1e3:.1f}** | "
                     f"{len(s['times'])} | {statistics.median(cpu) * 1e3:.1f} | "
                     f"{statistics.median(srv):.2f} |" if srv else
                     f"| {step} | {variant} | **{statistics.median(s['times']) * 1e3:.1f}** | "
                     f"{len(s['times'])} | {statistics.median(cpu) * 1e3:.1f} | |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "techniques.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, "techniques.json"), "w") as f:
        json.dump({"started": started, "rounds": rounds, "iters": iters, "samples": samples}, f)
    click.echo(text)
    click.echo(f"results in {out_dir}")


if __name__ == "__main__":
    main()
