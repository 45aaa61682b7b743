"""benchmarks/sparse/run.py at a small size (every contender runs, is verified, and is in
the table; the byte counts are the ones the algorithms imply), and the point of a
row-sparse table: a worker's memory does not grow with the table the servers hold.
Never asserts on speed."""

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
DIM = 64


def bench(out_dir, *args):
    p = subprocess.run([sys.executable, "-m", "benchmarks.sparse", "--out-dir", str(out_dir), *args],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                       timeout=150)
    assert p.returncode == 0, p.stdout + p.stderr
    with open(out_dir / "sparse.json") as f:
        return p.stdout, json.load(f)


def test_every_contender_runs_verified_and_the_bytes_are_what_the_algorithms_send(tmp_path):
    rows = 200_000
    printed, data = bench(tmp_path, "--rows", str(rows), "--steps", "3", "--warmup", "1")
    table = (tmp_path / "sparse.md").read_text()
    assert printed.startswith(table)
    for name in ("ours-sgd", "ours-adam", "dense", "sparse"):
        assert re.search(rf"^\| {name} \| .* \| \*\*[\d.]+\*\* \|", table, re.M), name
    assert "Targets (issue 17): ours-sgd: " in table
    got = {r["contender"]: r for r in data["rows"]}
    # a ring all_reduce of N bytes at W=2: each rank sends N and receives N (plus headers)
    dense = got["dense"]["tcp_bytes"]["median"]
    assert 2 * rows * DIM * 4 <= dense < 1.02 * 2 * rows * DIM * 4
    # ours: the socket count (ss) and the store's own count (comm_stats) agree
    for name in ("ours-sgd", "ours-adam"):
        assert got[name]["comm_bytes"] <= got[name]["tcp_bytes"]["median"] < 1.05 * got[name]["comm_bytes"]
        # a push and a pull of the batch's rows: each row's values and index, once each way
        assert got[name]["tcp_bytes"]["median"] >= 2 * got[name]["unique_rows"] * (DIM * 4 + 8)
    assert 0 < got["dense"]["unique_rows"] <= got["dense"]["union_rows"] <= 2 * got["dense"]["unique_rows"]


def test_a_worker_stays_small_while_the_servers_hold_a_table_many_times_larger(tmp_path):
    rows = 1_600_000                       # 409.6 MB on the servers
    _, data = bench(tmp_path, "--rows", str(rows), "--contenders", "ours-sgd", "--batch", "32768",
                    "--steps", "3", "--warmup", "1")
    (row,) = data["rows"]
    table_mb = rows * DIM * 4 / 2 ** 20
    growth = row["peak_rss_mb"] - row["rss_start_mb"]      # ru_maxrss against the RSS before init
    assert row["unique_rows"] > 5000                      # the steps did move rows
    assert growth < table_mb / 4, (growth, table_mb)
