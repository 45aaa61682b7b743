"""How long a replicated dist_sync job (``KVSTORE_REPLICAS=1``) pauses when a
server dies, and what replication costs a step when none does.

    python -m benchmarks.failover                    # W=2, S=3, 5 kills per kind
    python -m benchmarks.failover --record           # into benchmarks/results/failover
    python -m benchmarks.failover --runs 1 --steps 12 # a smoke run
    python -m benchmarks.failover --link 1gbit        # the cost over emulated 1 Gbit/s links (root):
                                                      # benchmarks/failover/link.py

Each run is a real job (``python -m tracker.local``) of benchmarks/failover/worker.py:
pushpulls of KEYS keys cut over every server, SGD with momentum on the servers,
deterministic sums. Per variant:

- ``no replicas``, ``no replicas, tcp`` and ``replicas``, no fault: the median step
  (replication's cost, co-located: with replicas the workers use plain ZeroMQ tcp
  instead of shared memory, which the second row isolates, and each round's sum
  goes to the backup before the reply);
- ``SIGKILL`` (the launcher sees the exit at once) and ``SIGSTOP`` (only the
  heartbeats, ``--heartbeat-timeout``): a random server stopped at a random moment
  of a random step (a delay of up to 1.5 median steps after the step starts); the
  pause is worker 0's longest wait for a round after the signal (:func:`pause`),
  against the median step of that run.

Every run's final weights (worker 0's digest) are compared with the first
``no replicas`` run's: with deterministic sums a failover must leave them equal,
bit for bit (the ``same weights`` column counts the runs that do).

Reported, never asserted (docs/reliability.md quotes the run of record). Writes
``failover.md`` and ``failover.json`` to a scratch directory (printed), or to
``--out-dir`` / with ``--record`` to benchmarks/results/failover.
"""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import subprocess
import sys

import click

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    __package__ = "benchmarks.failover"

from benchmarks.harness.output import ResultsDir  # noqa: E402
from benchmarks.harness.pause import pause  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, "benchmarks", "failover", "worker.py")
OUTPUT = ResultsDir("failover", "failover")


def job(workers: int, servers: int, env: dict, timeout: float) -> tuple[int, str]:
    """One launch; (exit status, worker 0's output)."""
    full = {**{k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")},
            "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p), **env}
    cmd = [sys.executable, "-m", "tracker.local", "-n", str(workers), "-s", str(servers),
           "--output-ranks", "0", "--kill-grace", "1", sys.executable, WORKER]
    out = subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    return out.returncode, out.stdout + out.stderr


def timings(output: str) -> tuple[list[float], float | None, str | None]:
    """(the end time of each step, the kill's time or None, the final weights' digest
    or None) from worker 0's lines."""
    ends = [float(t) for _, t in re.findall(r"step (\d+) (\d+\.\d+)", output)]
    kill = re.search(r"kill (\d+\.\d+)", output)
    digest = re.search(r"digest (\w+)", output)
    return ends, float(kill.group(1)) if kill else None, digest.group(1) if digest else None


VARIANTS = ("no replicas", "no replicas, tcp", "replicas", "SIGKILL", "SIGSTOP")


def measure(workers, servers, steps, keys, size, runs, heartbeat_timeout, seed,
            only: tuple = VARIANTS) -> list[dict]:
    rng = random.Random(seed)
    base = {"KVSTORE_DETERMINISTIC": "1", "STEPS": str(steps), "KEYS": str(keys), "SIZE": str(size),
            "KVSTORE_HEARTBEAT_INTERVAL": str(min(1.0, heartbeat_timeout / 5)),
            "KVSTORE_HEARTBEAT_TIMEOUT": str(heartbeat_timeout), "KVSTORE_TIMEOUT": "60"}
    variants = [("no replicas", {}, None), ("no replicas, tcp", {"KVSTORE_TRANSPORT": "tcp", "KVSTORE_DATA_CHANNEL": "0"}, None),
                ("replicas", {"KVSTORE_REPLICAS": "1"}, None),
                ("SIGKILL", {"KVSTORE_REPLICAS": "1"}, "SIGKILL"), ("SIGSTOP", {"KVSTORE_REPLICAS": "1"}, "SIGSTOP")]
    variants = [v for v in variants if v[0] in only]
    code, output = job(workers, servers, base, timeout=120)       # the reference weights
    reference = timings(output)[2]
    ends = timings(output)[0]
    typical = statistics.median([b - a for a, b in zip(ends, ends[1:])]) if len(ends) > 2 else 0.01
    if code != 0 or reference is None:
        raise click.ClickException(f"the reference job failed:\n{output[-3000:]}")
    rows = []
    for run in range(runs):
        for name, extra, signal_name in variants:
            env = {**base, **extra}
            victim = step = None
            if signal_name:
                victim, step = rng.randrange(servers), rng.randrange(steps // 3, 2 * steps // 3)
                env.update(KILL=f"{victim}:{step}", KILL_SIGNAL=signal_name,
                           KILL_DELAY=f"{rng.uniform(0, 1.5 * typical):.4f}")
            code, output = job(workers, servers, env, timeout=120 + 3 * heartbeat_timeout)
            ends, kill, digest = timings(output)
            gaps = [b - a for a, b in zip(ends, ends[1:])]
            row = {"variant": name, "run": run, "exit": code, "steps": len(ends),
                   "median_step_ms": 1e3 * statistics.median(gaps) if gaps else None,
                   "same_weights": digest == reference}
            if kill is not None and step is not None and len(ends) > step:
                row.update(victim=victim, at_step=step, delay_s=float(env["KILL_DELAY"]),
                           pause_s=pause(ends, kill))
            if code != 0:
                row["tail"] = output[-2000:]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "tail"}), file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict], workers: int, servers: int, keys: int, size: int, heartbeat_timeout: float) -> str:
    lines = [f"W={workers}, S={servers}, {keys} keys x {size} fp32 ({keys * size * 4 / 1e6:.1f} MB per worker), "
             f"KVSTORE_HEARTBEAT_TIMEOUT={heartbeat_timeout:g}, deterministic sums, one machine "
             "(processes share its cores).", "",
             "| variant | runs | exit 0 | same weights | median step (ms) | pause: the longest wait for a round after the signal (s) |",
             "|---|---:|---:|---:|---:|---|"]
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        steps = [r["median_step_ms"] for r in mine if r["median_step_ms"] is not None]
        pauses = sorted(r["pause_s"] for r in mine if "pause_s" in r)
        shown = "-" if not pauses else (f"median {statistics.median(pauses):.3f}, min {pauses[0]:.3f}, "
                                        f"max {pauses[-1]:.3f} ({', '.join(f'{p:.3f}' for p in pauses)})")
        same = sum(bool(r.get("same_weights")) for r in mine)
        median = f"{statistics.median(steps):.1f}" if steps else "-"
        lines.append(f"| {name} | {len(mine)} | {sum(r['exit'] == 0 for r in mine)} | {same} | {median} | {shown} |")
    return "\n".join(lines) + "\n"


@click.command()
@click.option("--workers", default=2, show_default=True)
@click.option("--servers", default=3, show_default=True)
@click.option("--steps", default=30, show_default=True)
@click.option("--keys", default=8, show_default=True)
@click.option("--size", default=65536, show_default=True, help="Values per key (fp32).")
@click.option("--runs", default=5, show_default=True, help="Launches per variant.")
@click.option("--heartbeat-timeout", default=2.0, show_default=True,
              help="KVSTORE_HEARTBEAT_TIMEOUT: what the SIGSTOP variant waits for.")
@click.option("--seed", default=20261207, show_default=True)
@click.option("--variant", "variants", multiple=True, type=click.Choice(VARIANTS),
              help="Run only these variants (repeat the option) [default: all].")
@click.option("--link", "rate", default=None, metavar="RATE",
              help="Instead: replication's cost over emulated machines with links of RATE (e.g. 1gbit; "
                   "root; benchmarks/failover/link.py); --steps, --keys, --size apply, and --runs is ignored.")
@click.option("--layouts", default="dedicated:4x2,colo:4", show_default=True,
              help="--link: the layouts (benchmarks.link's dedicated:WxS and colo:W).")
@click.option("--launches", default=5, show_default=True,
              help="--link: launch rounds (each runs every layout without and with replicas).")
@OUTPUT.click_options
def main(workers, servers, steps, keys, size, runs, heartbeat_timeout, seed, variants, rate, layouts,
         launches, out_dir) -> None:
    """Pause of a replicated job when a server dies, and replication's cost per step."""
    if rate is not None:
        from benchmarks.failover import link
        from benchmarks.harness.layouts import parse_list
        record = link.measure(rate, parse_list(layouts), steps, keys, size, launches, out_dir)
        if record is None:
            return
        text = link.table(record)
        with open(os.path.join(out_dir, "failover-link.md"), "w") as f:
            f.write("# Replication's cost over an emulated link (benchmarks/failover --link)\n\n" + text)
        with open(os.path.join(out_dir, "failover-link.json"), "w") as f:
            json.dump(record, f, indent=1)
        print(text)
        return
    rows = measure(workers, servers, steps, keys, size, runs, heartbeat_timeout, seed, variants or VARIANTS)
    text = table(rows, workers, servers, keys, size, heartbeat_timeout)
    with open(os.path.join(out_dir, "failover.md"), "w") as f:
        f.write("# Failover of replicated servers (benchmarks/failover)\n\n" + text)
    with open(os.path.join(out_dir, "failover.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
