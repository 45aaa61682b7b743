"""examples/train_sparse.py --dynamic: the wide part a table of dynamic rows (each
cross its own exact id, rows made by the first push, evicted by age or budget), in a
dist_sync job of real processes (tracker.local, 2 workers, 2 servers) and in one
process with the local store taking the same steps: the table's counters agree
(rows made and evicted depend only on which crosses each round pushes), and a
budget keeps every server under it."""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from test_examples import ROOT, mnist_dir, run  # noqa: F401  (mnist_dir: a fixture)
pytestmark = pytest.mark.timeout(300)
STEPS, BATCH = 8, 4      # small batches: a step shows some of the 10 labels' bars, so rows go unused


def args(data_dir, steps):
    return ["examples/train_sparse.py", "--data-dir", str(data_dir), "--num-examples", str(steps * 2 * BATCH),
            "--num-epochs", "1", "--disp-batches", "2", "--dynamic"]
COUNTERS = re.compile(r"Wide-rows=(\d+) Max-rows-per-server=(\d+) Created=(\d+) Evicted=(\d+) "
                      r"\(age (\d+), budget (\d+)\) Hit-rate=([\d.]+)")


def counters(log, worker=None):
    prefix = r"\[worker:%d\] .*" % worker if worker is not None else ""
    found = re.findall(prefix + COUNTERS.pattern, log)
    assert found, log[-3000:]
    rows, most, created, evicted, age, budget, hit = found[-1]
    return {"rows": int(rows), "max_rows": int(most), "created": int(created), "evicted": int(evicted),
            "age": int(age), "budget": int(budget), "hit_rate": float(hit)}


def test_dynamic_wide_table_trains_in_dist_sync_as_in_one_process(mnist_dir):  # noqa: F811
    dist = run(["-n", "2", "-s", "2", sys.executable, *args(mnist_dir, STEPS), "--kvstore", "dist_sync",
                "--batch-size", str(BATCH), "--evict-after", "2"])
    assert re.search(r"\[worker:0\] .*Epoch\[0\] Validation-accuracy=[\d.]+", dist)
    p = subprocess.run([sys.executable, *args(mnist_dir, STEPS), "--kvstore", "local", "--batch-size",
                        str(2 * BATCH), "--evict-after", "2"], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    got, want = counters(dist, 0), counters(p.stderr)
    assert got["created"] > 100 and got["age"] > 0           # rows were made and aged out
    for k in ("rows", "created", "evicted", "age"):
        assert got[k] == want[k], (k, got, want)
    # each server logs its table's counters as it shuts down
    assert re.search(r"\[server:1\] .*server 1: dynamic rows of key 'wide' \(chunk 1\): \d+ rows, \d+ created, "
                     r"\d+ evicted \(\d+ by age, 0 by budget\), hit rate [\d.]+ over \d+ ids pulled", dist)


def test_a_row_budget_keeps_every_server_under_it(mnist_dir):  # noqa: F811
    dist = run(["-n", "2", "-s", "2", sys.executable, *args(mnist_dir, STEPS), "--kvstore", "dist_sync",
                "--batch-size", str(BATCH), "--row-budget", "250"])
    got = counters(dist, 1)
    assert got["max_rows"] <= 250 and got["budget"] > 0 and got["age"] == 0
