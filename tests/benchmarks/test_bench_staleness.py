"""benchmarks/staleness/run.py at a small size: every store and delay pattern runs, each
read of every step is checked against the store's bound by the workers, and the
table shows what the bounds imply (dist_sync misses nothing; a dist_ssp read misses
at most s steps of each other worker). Never asserts on speed."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
WORKERS, STEPS = 3, 4


def test_every_store_runs_verified_and_reads_stay_within_the_bound(tmp_path):
    p = subprocess.run([sys.executable, "-m", "benchmarks.staleness", "--out-dir", str(tmp_path),
                        "-w", str(WORKERS), "--steps", str(STEPS), "--warmup", "1", "--size", "4096",
                        "--compute", "0.005", "--delay", "0.02", "--delays", "1,r1",
                        "--configs", "dist_sync,ssp1,ssp2,dist_async"],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                       timeout=220)
    assert p.returncode == 0, p.stdout + p.stderr
    table = (tmp_path / "staleness.md").read_text()
    assert p.stdout.startswith(table)
    assert table.count("### Delayed: ") == 2
    for name in ("dist_sync", "ssp1", "ssp2", "dist_async"):
        assert len(re.findall(rf"^\| {name} \| \*\*[\d.]+\*\* \|", table, re.M)) == 2, name
    with open(tmp_path / "staleness.json") as f:
        rows = json.load(f)["rows"]
    assert [(r["delays"], r["config"]) for r in rows] == \
        [(d, c) for d in ("1", "r1") for c in ("dist_sync", "ssp1", "ssp2", "dist_async")]
    for r in rows:
        assert len(r["raw"]) == WORKERS and all(len(w["times"]) == STEPS for w in r["raw"])
        assert [w["slow"] for w in r["raw"]] == ([False] * (WORKERS - 1) + [r["delays"] == "1"])
        s = {"dist_sync": 0, "ssp1": 1, "ssp2": 2}.get(r["config"])
        if s is not None:      # a read at step t holds >= t - s pushes of each other worker
            assert r["missed_max"] <= (WORKERS - 1) * s, r
    assert all(r["missed"] == 0 for r in rows if r["config"] == "dist_sync")   # exactly t of each
