"""benchmarks/link/timeline.py's table of the last exchange, from samples written by hand:
the windows where the workers sent must be in it even when they never sent hard
enough to mark the exchange's start (a short exchange on a loaded machine; CI's
test_link_benchmark_tiny once got only the last window, where host A sent 0)."""

from __future__ import annotations

import json

from benchmarks.link.timeline import render

RATE = 125e6          # 1 Gbit/s in bytes per second
HOSTS = ["A", "B", "S0"]
DT = 0.125            # seconds between samples (exact in binary, over render's 100 ms windows)


def write_samples(path, windows: list[tuple[float, float, float, float]]) -> None:
    """One sample per DT; each window's (A sent, B sent, S0 received, S0 sent) in %
    of RATE. Counters as the bridge port sees them: rx is what the host sent."""
    counters = [0] * 6       # A rx, A tx, B rx, B tx, S0 rx, S0 tx
    rows = [[0.0, *counters]]
    for i, (a, b, s0_in, s0_out) in enumerate(windows, start=1):
        counters[0] += int(a / 100 * RATE * DT)
        counters[2] += int(b / 100 * RATE * DT)
        counters[5] += int(s0_in / 100 * RATE * DT)
        counters[4] += int(s0_out / 100 * RATE * DT)
        rows.append([DT * i, *counters])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def sent_by(table: str, column: int) -> list[float]:
    return [float(line.split()[column].split("/")[0]) for line in table.splitlines()[1:]]


def test_a_short_exchange_shows_the_window_where_the_workers_sent(tmp_path):
    path = tmp_path / "links.jsonl"
    # idle, then the workers send at 20% (under the 30% that marks a start), then the
    # server's port drains what they sent while they are already quiet
    write_samples(path, [(0, 0, 0, 0), (20, 20, 10, 0), (0, 5, 45, 10), (0, 0, 0, 0)])
    table = render(str(path), HOSTS, HOSTS, ["A", "B"], RATE)
    assert table.splitlines()[0].split() == ["t", "s", "A", "B", "S0"], table
    assert sent_by(table, 1) == [20, 0], table          # A's column: both windows of the stretch
    assert sent_by(table, 2) == [20, 5], table


def test_a_marked_start_begins_the_table_at_the_last_exchange(tmp_path):
    path = tmp_path / "links.jsonl"
    # two exchanges, each opened by the workers sending hard, a quiet window between them
    write_samples(path, [(80, 80, 90, 0), (0, 0, 60, 40), (0, 0, 0, 0),
                         (70, 75, 90, 0), (0, 0, 50, 30)])
    table = render(str(path), HOSTS, HOSTS, ["A", "B"], RATE)
    assert sent_by(table, 1) == [70, 0], table
    assert sent_by(table, 2) == [75, 0], table


def test_no_traffic_says_so(tmp_path):
    path = tmp_path / "links.jsonl"
    write_samples(path, [(0, 0, 0, 0), (0, 0, 0, 0)])
    assert render(str(path), HOSTS, HOSTS, ["A", "B"], RATE) == "(no traffic sampled)\n"
