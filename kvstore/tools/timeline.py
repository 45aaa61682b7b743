"""Merge the timeline files of a job (``KVSTORE_TIMELINE=DIR``) into one, summarise
where the time went, and optionally draw it.

    python -m kvstore.tools.timeline DIR [--png FILE] [--top N]

Reads ``DIR/worker-*.json`` and ``DIR/server-*.json`` (kvstore/timeline.py; a file
cut short by a crash is read up to its last complete event), writes
``DIR/timeline.json`` (every process on one clock, which starts at the job's first
event; open it in https://ui.perfetto.dev or chrome://tracing) and prints:

- per worker: its window (its first store call to its last event), the time its threads spent inside
  kvstore calls (sending, waiting for replies, copying out), of that the time waiting
  for replies, the rest as compute, and the bytes it moved by transport;
- the keys whose messages were longest in flight (a message's time is shared evenly
  among its chunks);
- per server: requests handled, time handling them (sums, updates), time replying,
  rounds completed.

``--png FILE`` draws every process's lanes over time, from the first store call on,
with matplotlib (an optional dependency: ``pip install matplotlib``).
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field

import click

from kvstore.fileio import atomic_write

FILE = re.compile(r"(worker|server)-(\d+)\.json$")
MERGED = "timeline.json"
# --png: how each kind of span is drawn (its kind -> colour, label)
STYLE = {"call": ("tab:blue", "worker: send / stage (push, init: whole call)"),
         "wait": ("tab:red", "worker: wait for replies"), "copy": ("tab:orange", "worker: copy out"),
         "step": ("tab:gray", "trainer: step"), "server": ("tab:green", "server: handle (sum / update)"),
         "reply": ("tab:purple", "server: reply")}


@dataclass
class Process:
    role: str
    rank: int
    events: list
    other: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.role} {self.rank}"


def load(directory: str) -> list[Process]:
    """Every process's file in ``directory``, workers first, by rank. Raises
    click.ClickException when there is none or one cannot be read."""
    found = []
    for path in glob.glob(os.path.join(directory, "*.json")):
        m = FILE.search(os.path.basename(path))
        if m:
            found.append((m.group(1) != "worker", int(m.group(2)), m.group(1), path))
    if not found:
        raise click.ClickException(f"no worker-R.json or server-R.json in {directory} "
                                   "(was the job run with KVSTORE_TIMELINE set to it?)")
    processes = []
    for _, rank, role, path in sorted(found):
        with open(path, encoding="utf-8") as f:
            data = _parse(f.read(), path)
        processes.append(Process(role, rank, data.get("traceEvents", []), data.get("otherData", {})))
    return processes


def _parse(text: str, path: str) -> dict:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    # a process that died before closing its file: keep its complete events
    cut = text.rfind(",\n")
    try:
        return json.loads((text[:cut] if cut >= 0 else text.rstrip()) + "]}")
    except json.JSONDecodeError as e:
        raise click.ClickException(f"{path} is not a timeline file: {e}") from None


def merge(processes: list[Process]) -> dict:
    """One trace: each process a pid of its own (workers 1.., servers 1001..),
    timestamps from the earliest event (its Unix time in ``otherData``)."""
    t0 = min((e["ts"] for p in processes for e in p.events if "ts" in e), default=0.0)
    events = []
    for p in processes:
        pid = (p.role != "worker") * 1000 + p.rank + 1
        for e in p.events:
            if e.get("name") == "trace_end":
                continue
            e = dict(e, pid=pid)
            if "ts" in e:
                e["ts"] = round(e["ts"] - t0, 3)
            events.append(e)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"t0_unix_us": t0, "processes": {p.name: p.other for p in processes}}}


def _spans(p: Process, cat: str | None = None):
    return [e for e in p.events if e.get("ph") == "X" and (cat is None or e.get("cat") == cat)]


def summarize(processes: list[Process], top: int = 10) -> dict:
    """The numbers :func:`render` prints (seconds, bytes)."""
    workers: list[dict] = []
    servers: list[dict] = []
    keys: dict[str, list] = defaultdict(lambda: [0.0, 0])   # key -> [seconds in flight, messages]
    for p in processes:
        spans = _spans(p)
        # a worker's window opens with its first store call (not kvstore.create's connections)
        first = [e["ts"] for e in _spans(p, "call")] or [e["ts"] for e in spans]
        window = (max(e["ts"] + e["dur"] for e in spans) - min(first)) / 1e6 if spans else 0.0
        if p.role == "worker":
            inside = sum(e["dur"] for e in _spans(p, "worker")) / 1e6
            waiting = sum(e["dur"] for e in _spans(p, "worker") if e["name"].startswith("wait ")) / 1e6
            for e in _spans(p, "request"):
                chunks = e.get("args", {}).get("chunks") or []
                for chunk in chunks:
                    entry = keys[repr(chunk[0])]
                    entry[0] += e["dur"] / len(chunks) / 1e6
                    entry[1] += 1
            workers.append({"rank": p.rank, "window": window, "in_kvstore": inside, "waiting": waiting,
                            "compute": max(window - inside, 0.0),
                            "calls": len(_spans(p, "call")),
                            "requests": sum(e["name"] != "queued" for e in _spans(p, "request")),
                            "bytes": p.other.get("comm_stats", {})})
        else:
            handled = _spans(p, "server")
            servers.append({"rank": p.rank, "requests": len(handled),
                            "handling": sum(e["dur"] for e in handled) / 1e6,
                            "replying": sum(e["dur"] for e in _spans(p, "reply")) / 1e6,
                            "rounds": sum(e.get("name") == "round complete" for e in p.events)})
    ranked = sorted(keys.items(), key=lambda kv: -kv[1][0])[:top]
    return {"workers": workers, "servers": servers,
            "keys": [{"key": k, "in_flight": t, "messages": n} for k, (t, n) in ranked]}


def render(summary: dict) -> str:
    lines = ["workers (seconds; compute = window - in kvstore):",
             (f"{'worker':>6} {'window':>9} {'compute':>9} {'in kvstore':>10} {'waiting':>9} "
              f"{'calls':>6} {'messages':>8}  MB sent/received by transport")]
    for w in summary["workers"]:
        moved = ", ".join(f"{t} {b.get('sent', 0) / 1e6:.2f}/{b.get('received', 0) / 1e6:.2f}"
                          for t, b in sorted(w["bytes"].items())) or "-"
        lines.append(f"{w['rank']:>6} {w['window']:>9.3f} {w['compute']:>9.3f} {w['in_kvstore']:>10.3f} "
                     f"{w['waiting']:>9.3f} {w['calls']:>6} {w['requests']:>8}  {moved}")
    if summary["keys"]:
        lines += ["", "keys by time in flight (all workers; a message's time shared among its chunks):",
                  f"{'key':>24} {'ms':>9} {'messages':>8}"]
        lines += [f"{k['key']:>24} {k['in_flight'] * 1e3:>9.2f} {k['messages']:>8}" for k in summary["keys"]]
    if summary["servers"]:
        lines += ["", f"{'server':>6} {'requests':>8} {'handling s':>10} {'replying s':>10} {'rounds':>7}"]
        lines += [f"{s['rank']:>6} {s['requests']:>8} {s['handling']:>10.3f} {s['replying']:>10.3f} "
                  f"{s['rounds']:>7}" for s in summary["servers"]]
    return "\n".join(lines)


def draw(merged: dict, processes: list[Process], path: str) -> None:
    """A PNG of every process's thread lanes (workers: send, wait, copy out, trainer
    steps; servers: handling, replying) over time. Needs matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = [p.name for p in processes]
    pids = {(p.role != "worker") * 1000 + p.rank + 1: i for i, p in enumerate(processes)}
    bars: dict = defaultdict(list)
    for e in merged["traceEvents"]:
        kind = _kind(e) if e.get("ph") == "X" else None
        if kind is not None:
            bars[(pids[e["pid"]], kind)].append((e["ts"] / 1e3, max(e["dur"] / 1e3, 1e-3)))
    fig, ax = plt.subplots(figsize=(12, 1.5 + 0.6 * len(names)))
    for (row, kind), spans in sorted(bars.items(), key=lambda item: item[0][1] == "reply"):
        # a trainer's steps as a thin bar under the worker's calls
        ax.broken_barh(spans, (row + 0.32, 0.12) if kind == "step" else (row - 0.3, 0.6),
                       facecolors=STYLE[kind][0])
    ax.set_yticks(range(len(names)), names)
    ax.set_ylim(len(names) - 0.5, -0.5)
    # from the first store call: the job's start-up (connections, configure) is not training
    calls = [e["ts"] / 1e3 for e in merged["traceEvents"] if e.get("cat") == "call"]
    ends = [e["ts"] / 1e3 + e["dur"] / 1e3 for e in merged["traceEvents"] if e.get("ph") == "X"]
    if calls and ends:
        ax.set_xlim(min(calls) - 0.01 * (max(ends) - min(calls)), max(ends))
    ax.set_xlabel("ms since the job's first event")
    ax.legend(handles=[Patch(color=c, label=label) for c, label in STYLE.values()], loc="lower center",
              bbox_to_anchor=(0.5, 1.0), ncol=3, fontsize="small", frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _kind(event: dict) -> str | None:
    """Which :data:`STYLE` draws a span (None: not drawn)."""
    cat, name = event.get("cat"), event.get("name", "")
    if cat == "worker":
        return "wait" if name.startswith("wait ") else "copy" if name.startswith("copy out") else "call"
    if cat == "trainer":
        return "step" if name == "step" else None
    return cat if cat in ("server", "reply") else None


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--png", "png", type=click.Path(dir_okay=False), help="Also draw the timeline into this PNG (matplotlib).")
@click.option("--top", type=click.IntRange(min=0), default=10, show_default=True, help="Keys to list.")
def main(directory: str, png: str | None, top: int) -> None:
    """Merge DIRECTORY's timeline files into DIRECTORY/timeline.json and summarise them."""
    if png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.ClickException("--png needs matplotlib, which is not installed "
                                       "(pip install matplotlib)") from None
    processes = load(directory)
    merged = merge(processes)
    out = os.path.join(directory, MERGED)
    with atomic_write(out) as f:
        f.write(json.dumps(merged).encode())
    workers = sum(p.role == "worker" for p in processes)
    spans = [e for e in merged["traceEvents"] if e.get("ph") == "X"]
    length = max((e["ts"] + e["dur"] for e in spans), default=0) / 1e6
    click.echo(f"{len(processes)} processes ({workers} workers, {len(processes) - workers} servers), "
               f"{length:.3f} s, merged into {out} (open it in https://ui.perfetto.dev or chrome://tracing)\n")
    click.echo(render(summarize(processes, top)))
    if png:
        draw(merged, processes, png)
        click.echo(f"\ndrew {png}")


if __name__ == "__main__":
    sys.exit(main())
