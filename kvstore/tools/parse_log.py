"""Summarise MXNet-format training logs: one markdown table per log, optionally a plot.

    python -m kvstore.tools.parse_log job.log [other.log ...] [--plot curves.png]

Recognised lines, with any prefix before ``Epoch[`` (the launcher's ``[worker:0] ``,
a logging timestamp, ...); older MXNet releases print ``Iteration[N]`` (and
``Iter[N] Batch``) instead of ``Epoch[N]``, which is read the same way::

    Epoch[0] Batch [20]\tSpeed: 1234.56 samples/sec\taccuracy=0.500000
    Epoch[0] Train-accuracy=0.900000
    Epoch[0] Time cost=12.300
    Epoch[0] Validation-accuracy=0.880000
    Epoch[0] Comm-sent-bytes=123456789        # bytes this worker sent to the servers
    Epoch[0] Comm-received-bytes=123456789    # ... and received from them, that epoch

When a log holds the epoch lines of several workers (``[worker:N]`` prefixes), the
table shows the lowest rank's (worker 0's), and a second table every worker's values
side by side. Without prefixes the workers' lines cannot be told apart: a value that
appears several times for one epoch (one per worker) is averaged, as MXNet's own
parse_log does. Speed is the mean over the epoch's Batch lines; MB are 10^6 bytes.
Values a log does not have are left as empty cells.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Iterable

import click

WORKER = re.compile(r"\[worker:(\d+)\]")
NUMBER = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf)"
# (field of EpochRow, pattern after "Epoch[k]"); the Batch pattern also takes "Batch [0-20]"
PATTERNS = [
    ("speeds", re.compile(r"\s*Batch\s*\[[\d\s-]+\]\s*Speed:\s*" + NUMBER + r"\s*samples/sec")),
    ("train_accuracy", re.compile(r"\s*Train-accuracy=" + NUMBER)),
    ("validation_accuracy", re.compile(r"\s*Validation-accuracy=" + NUMBER)),
    ("time", re.compile(r"\s*Time cost=" + NUMBER)),
    ("sent_bytes", re.compile(r"\s*Comm-sent-bytes=" + NUMBER)),
    ("received_bytes", re.compile(r"\s*Comm-received-bytes=" + NUMBER)),
]
EPOCH = re.compile(r"(?:Epoch|Iteration|Iter)\[(\d+)\]")
COLUMNS = ["epoch", "train-accuracy", "validation-accuracy", "time (s)", "speed (samples/s)",
           "sent (MB)", "received (MB)"]


@dataclass
class EpochRow:
    epoch: int
    train_accuracy: float | None = None
    validation_accuracy: float | None = None
    time: float | None = None
    speed: float | None = None             # mean of the epoch's Batch lines
    sent_bytes: float | None = None
    received_bytes: float | None = None
    speeds: list[float] | None = None      # every Batch line's speed


def worker_ranks(lines: Iterable[str]) -> list[int]:
    """The ranks of the ``[worker:N]`` prefixes on the epoch lines of ``lines``, sorted."""
    return sorted({int(m.group(1)) for line in lines if (m := WORKER.search(line)) and EPOCH.search(line)})


def select_worker(lines: list[str]) -> tuple[list[str], int | None]:
    """With epoch lines of several workers, keep the lines of the lowest rank (worker 0):
    returns the lines and that rank; otherwise all lines and None."""
    ranks = worker_ranks(lines)
    if len(ranks) < 2:
        return lines, None
    chosen = []
    for line in lines:
        m = WORKER.search(line)
        if m and int(m.group(1)) == ranks[0]:
            chosen.append(line)
    return chosen, ranks[0]


def parse(lines: Iterable[str]) -> list[EpochRow]:
    """One EpochRow per epoch seen (sorted by epoch), from the lines of one log. With
    several workers in the log, only worker 0's lines count (see select_worker). A
    value given several times for one epoch (several workers without prefixes) is
    the mean of them."""
    lines, _ = select_worker(list(lines))
    return _rows(lines)


def repeats(lines: Iterable[str]) -> int:
    """The most times one value (other than Batch speeds) appears for one epoch in
    ``lines``: the number of workers whose lines a log without prefixes mixes."""
    seen: dict = {}
    for epoch, name, _ in _values(lines):
        if name != "speeds":
            seen[(epoch, name)] = seen.get((epoch, name), 0) + 1
    return max(seen.values(), default=0)


def _values(lines: Iterable[str]):
    """(epoch, name, match) of every line with an epoch value of PATTERNS."""
    for line in lines:
        m = EPOCH.search(line)
        if not m:
            continue
        rest = line[m.end():]
        for name, pattern in PATTERNS:
            found = pattern.match(rest)
            if found:
                yield int(m.group(1)), name, found
                break


def parse_workers(lines: Iterable[str]) -> dict[int, list[EpochRow]]:
    """{rank: its rows} for the workers of a log with ``[worker:N]`` prefixes on
    their epoch lines (empty without)."""
    lines = list(lines)
    by_rank: dict[int, list[str]] = {}
    for line in lines:
        m = WORKER.search(line)
        if m:
            by_rank.setdefault(int(m.group(1)), []).append(line)
    return {rank: _rows(by_rank[rank]) for rank in worker_ranks(lines)}


def _rows(lines: Iterable[str]) -> list[EpochRow]:
    rows: dict[int, EpochRow] = {}
    values: dict[tuple[int, str], list[float]] = {}
    for epoch, name, found in _values(lines):
        row = rows.setdefault(epoch, EpochRow(epoch))
        value = float(found.group(1))
        if name == "speeds":
            row.speeds = (row.speeds or []) + [value]
        else:
            values.setdefault((epoch, name), []).append(value)
    for (epoch, name), seen in values.items():
        setattr(rows[epoch], name, sum(seen) / len(seen))   # several workers: their mean
    for row in rows.values():
        if row.speeds:
            row.speed = sum(row.speeds) / len(row.speeds)
    return [rows[k] for k in sorted(rows)]


def _cell(value: float | None, digits: int, scale: float = 1.0) -> str:
    if value is None:
        return ""
    if math.isnan(value):
        return "nan"
    return f"{value / scale:.{digits}f}"


def to_markdown(rows: list[EpochRow]) -> str:
    """A markdown table: epoch | train-accuracy | validation-accuracy | time (s) |
    speed (samples/s) | sent (MB) | received (MB); missing values are empty cells."""
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---:" for _ in COLUMNS) + "|"]
    for r in rows:
        cells = [str(r.epoch), _cell(r.train_accuracy, 4), _cell(r.validation_accuracy, 4),
                 _cell(r.time, 2), _cell(r.speed, 1), _cell(r.sent_bytes, 2, 1e6),
                 _cell(r.received_bytes, 2, 1e6)]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def to_markdown_per_worker(per_worker: dict[int, list[EpochRow]]) -> str:
    """A markdown table with one column per worker for each value any worker has:
    ``epoch | train-accuracy w0 | train-accuracy w1 | ...``."""
    fields = [("train-accuracy", "train_accuracy", 4, 1.0),
              ("validation-accuracy", "validation_accuracy", 4, 1.0), ("time (s)", "time", 2, 1.0),
              ("speed (samples/s)", "speed", 1, 1.0), ("sent (MB)", "sent_bytes", 2, 1e6),
              ("received (MB)", "received_bytes", 2, 1e6)]
    ranks = sorted(per_worker)
    by_epoch = {rank: {r.epoch: r for r in rows} for rank, rows in per_worker.items()}
    epochs = sorted({e for rows in by_epoch.values() for e in rows})
    present = [f for f in fields
               if any(getattr(r, f[1]) is not None for rows in per_worker.values() for r in rows)]
    header = ["epoch"] + [f"{title} w{rank}" for title, *_ in present for rank in ranks]
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    for epoch in epochs:
        cells = [str(epoch)]
        for _, attr, digits, scale in present:
            for rank in ranks:
                row = by_epoch[rank].get(epoch)
                cells.append(_cell(None if row is None else getattr(row, attr), digits, scale))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def labels_for(paths: list[str]) -> list[str]:
    """Legend labels: file names, or the paths as given where two file names are the same."""
    names = [os.path.basename(p) for p in paths]
    return [n if names.count(n) == 1 else p for n, p in zip(names, paths)]


def plot(logs: list[tuple[str, list[EpochRow]]], path: str) -> None:
    """Accuracy per epoch (train dashed, validation solid) and time per epoch, side by
    side, one colour per log. Needs matplotlib (imported here, not at module load)."""
    plt = _pyplot()
    fig, (acc_ax, time_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (label, rows), color in zip(logs, _colors(len(logs))):
        def series(name):
            pts = [(r.epoch, getattr(r, name)) for r in rows if getattr(r, name) is not None]
            return [p[0] for p in pts], [p[1] for p in pts]
        x, y = series("train_accuracy")
        if x:
            acc_ax.plot(x, y, "--", marker=".", color=color, label=f"{label} train")
        x, y = series("validation_accuracy")
        if x:
            acc_ax.plot(x, y, "-", marker="o", color=color, label=f"{label} validation")
        x, y = series("time")
        if x:
            time_ax.plot(x, y, "-", marker="o", color=color, label=label)
    acc_ax.set(title="accuracy (train dashed, validation solid)", xlabel="epoch", ylabel="accuracy")
    time_ax.set(title="time per epoch", xlabel="epoch", ylabel="time (s)")
    for ax in (acc_ax, time_ax):
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed), or a clear error."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise click.ClickException(
            f"--plot needs matplotlib, which is not installed ({e}): pip install matplotlib") from e
    return plt


def _colors(n: int) -> list[str]:
    palette = ["C%d" % i for i in range(10)]
    return [palette[i % len(palette)] for i in range(n)]


@click.command(help=__doc__.split("\n\n")[0], context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("logs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True),
              help="Also draw accuracy and time per epoch of every log into this PNG.")
def main(logs: tuple[str, ...], plot_path: str | None) -> None:
    if plot_path:
        _pyplot()                          # fail before any output when matplotlib is missing
    parsed, failed = [], []
    for path, label in zip(logs, labels_for(list(logs))):
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        _, worker = select_worker(lines)
        rows = parse(lines)
        click.echo(f"## {path}\n")
        if worker is not None:
            ranks = worker_ranks(lines)
            click.echo(f"{len(ranks)} workers in this log (ranks {', '.join(map(str, ranks))}): "
                       f"using worker {worker}'s lines (every worker's values follow)\n")
        elif rows and (n := repeats(lines)) > 1:
            click.echo(f"up to {n} values per epoch and no [worker:N] prefixes (several workers?): "
                       "each cell is their mean\n")
        if not rows:
            click.echo(f"{path}: no epoch lines found (expected MXNet-format lines such as "
                       f"'Epoch[0] Train-accuracy=0.9' or 'Epoch[0] Time cost=12.3')\n", err=True)
            failed.append(path)
            continue
        click.echo(to_markdown(rows) + "\n")
        if worker is not None:
            click.echo("every worker:\n\n" + to_markdown_per_worker(parse_workers(lines)) + "\n")
        parsed.append((label, rows))
    if plot_path and parsed:
        plot(parsed, plot_path)
        click.echo(f"plot written to {plot_path}")
    if failed:
        raise click.ClickException(f"no epochs in {', '.join(failed)}")


if __name__ == "__main__":
    main()
