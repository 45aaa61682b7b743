"""benchmarks/straggler/run.py's reading of the workers' logs and its tables.

Every number comes from the lines examples/common.py logs, as ``tracker.local``
prefixes them::

    [worker:0] 2026-11-25 01:03:28,123 Epoch[0] Time cost=12.300
    [worker:0] 2026-11-25 01:03:35,456 Epoch[0] Validation-accuracy=0.880000
"""

from __future__ import annotations

import datetime
import re
import statistics

from kvstore.tools.parse_log import parse_workers

# the timestamp of an epoch's last line, which parse_workers does not keep
VALIDATED = re.compile(r"^\[worker:(\d+)\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) "
                       r"Epoch\[(\d+)\] Validation-accuracy=")


def epochs_by_worker(lines, started_at: float) -> dict[int, list[dict]]:
    """{rank: [{epoch, t, val, train, time_cost}, ...]} from log ``lines``, in epoch
    order: the values as kvstore.tools.parse_log reads them, and ``t``, the time of
    the epoch's Validation-accuracy line (the end of the epoch, validation included)
    in seconds after ``started_at`` (a time.time()). Only epochs with a validation
    accuracy are kept."""
    lines = list(lines)
    ended = {}
    for line in lines:
        m = VALIDATED.match(line)
        if m:
            when = datetime.datetime.strptime(m.group(2), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            ended[int(m.group(1)), int(m.group(3))] = when - started_at
    return {rank: [{"epoch": e.epoch, "t": ended[rank, e.epoch], "val": e.validation_accuracy,
                    "train": e.train_accuracy, "time_cost": e.time}
                   for e in rows if e.validation_accuracy is not None and (rank, e.epoch) in ended]
            for rank, rows in parse_workers(lines).items()}


def steps_per_s(epochs: list[dict], batches_per_epoch: int) -> float:
    """Training steps a second over the logged epochs (validation excluded)."""
    return batches_per_epoch * len(epochs) / sum(e["time_cost"] for e in epochs)


def summarize(data: dict) -> dict:
    """T and, per configuration, the step rates and the accuracies the tables show."""
    cfg, rows = data["config"], data["rows"]
    slow = str(cfg["workers"] - 1)
    done = {r["config"]: r["workers"]["0"][-1]["t"] for r in rows}
    pool = [r["config"] for r in rows if r["slowed"]] or [r["config"] for r in rows]
    first = min(pool, key=done.__getitem__)
    horizon = done[first]
    out = []
    for r in rows:
        w0 = r["workers"]["0"]
        by_t = [e for e in w0 if e["t"] <= horizon]
        fast = [steps_per_s(r["workers"][k], cfg["batches_per_epoch"]) for k in r["workers"] if k != slow]
        out.append({"config": r["config"], "fast_steps_s": statistics.fmean(fast),
                    "slowed_steps_s": steps_per_s(r["workers"][slow], cfg["batches_per_epoch"]),
                    "worker0_done_s": done[r["config"]],
                    "at_T": {"epoch": by_t[-1]["epoch"], "val": by_t[-1]["val"]} if by_t else None,
                    "worker0_final": w0[-1]["val"], "slowed_final": r["workers"][slow][-1]["val"],
                    "slowed_done_s": r["workers"][slow][-1]["t"], "wall_s": r["wall_s"],
                    "stopped_fraction": (r["throttle"] or {}).get("stopped_fraction"),
                    "job_cores": r["job_cores"], "other_cores": r["other_cores"]})
    return {"T": horizon, "T_from": first, "rows": out}


def shown_command(cfg: dict) -> str:
    return (f"python -m tracker.local -n {cfg['workers']} -s {cfg['servers']} [--env KVSTORE_STALENESS=s] "
            f"python examples/train_mnist.py --kvstore K --network {cfg['network']} "
            f"--num-examples {cfg['num_examples']} --num-epochs {cfg['num_epochs']}")


def _curve_table(data: dict, rank: str) -> list[str]:
    epochs = range(data["config"]["num_epochs"])
    lines = ["| store | " + " | ".join(f"epoch {e}" for e in epochs) + " |",
             "|---|" + "---:|" * len(epochs)]
    for r in data["rows"]:
        cells = [f"{e['t']:.1f} s: {e['val']:.4f}" for e in r["workers"][rank]]
        lines.append(f"| {r['config']} | " + " | ".join(cells) + " |")
    return lines


def _preamble(data: dict) -> list[str]:
    cfg, m, s = data["config"], data["machine"], data["summary"]
    period = cfg["stop"] + cfg["run"]
    return [f"## Accuracy after a fixed time with a straggler: W={cfg['workers']}, S={cfg['servers']}", "",
            f"Machine: {m.get('cpu_model', '?')}, {m['cpus']} cores, {m.get('mem_total', '?')}; "
            f"run {data['started']} .. {data['finished']}; {data['version']}. Shared with other jobs: "
            f"`uptime` before: {data['uptime_before']}; after: {data['uptime_after']}.", "",
            f"The job: `{shown_command(cfg)}` (Fashion-MNIST, each worker "
            f"{cfg['num_examples'] // cfg['workers']} images an epoch, {cfg['batches_per_epoch']} steps of "
            f"{cfg['batch_size']}; the learning rate is the example's, scaled by 1/W for dist_async and "
            f"dist_ssp). Worker {cfg['workers'] - 1} is slowed from outside (`benchmarks/harness/throttle.py`): "
            f"stopped (SIGSTOP) {cfg['stop'] * 1e3:.0f} ms of every {period * 1e3:.0f} ms, so it gets at "
            f"most {cfg['run'] / period:.0%} of the wall time; `unslowed` is dist_sync without it (the "
            "reference). Times are seconds since the job was launched (start-up included), at the end of an "
            "epoch's validation, from the workers' log lines; accuracies are `Validation-accuracy` (the "
            "10,000 test images); steps/s are an epoch's steps over its `Time cost` (its training, from the "
            "end of this worker's previous validation: under dist_sync and dist_ssp a fast worker's epoch "
            "includes waiting for the slowed one, whose own rate excludes that, so it can look faster). "
            f"**T = {s['T']:.1f} s**, the time {s['T_from']}'s worker 0 needed for all its epochs (the "
            "fastest slowed configuration); 'at T' is worker 0's latest epoch finished by then. 'Cores busy' "
            f"is CPU time over the job's wall time ({m['cpus']} cores): the job's processes', and the other "
            "processes' on this machine (/proc/stat minus the job's).", ""]


def _summary_table(data: dict) -> list[str]:
    rows, slow = data["summary"]["rows"], data["config"]["workers"] - 1
    lines = [f"| store | fast workers, steps/s | vs unslowed | worker {slow}, steps/s | worker {slow} stopped "
             f"| worker 0 done, s | **accuracy at T** (epoch) | worker 0 final | worker {slow} final (done, s) "
             "| job wall s | cores busy: job, others |", "|---|" + "---:|" * 10]
    ref = next((r for r in rows if r["config"] == "unslowed"), None)
    for r in rows:
        ratio = f"{r['fast_steps_s'] / ref['fast_steps_s']:.2f}x" if ref else ""
        stopped = "" if r["stopped_fraction"] is None else f"{r['stopped_fraction']:.0%}"
        at = "none" if r["at_T"] is None else f"**{r['at_T']['val']:.4f}** ({r['at_T']['epoch']})"
        lines.append(f"| {r['config']} | {r['fast_steps_s']:.1f} | {ratio} | {r['slowed_steps_s']:.1f} | "
                     f"{stopped} | {r['worker0_done_s']:.1f} | {at} | {r['worker0_final']:.4f} | "
                     f"{r['slowed_final']:.4f} ({r['slowed_done_s']:.1f}) | {r['wall_s']:.1f} | "
                     f"{r['job_cores']:.2f}, {r['other_cores']:.2f} |")
    return lines


def markdown(data: dict) -> str:
    slow = data["config"]["workers"] - 1
    return "\n".join([*_preamble(data), *_summary_table(data), "",
                      "### Worker 0: end of each epoch (s) and its validation accuracy", "",
                      *_curve_table(data, "0"), "",
                      f"### Worker {slow} (slowed): end of each epoch (s) and its validation accuracy", "",
                      *_curve_table(data, str(slow)), ""])
