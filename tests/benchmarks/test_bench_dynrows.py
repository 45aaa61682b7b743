"""benchmarks/dynrows/run.py at a small size: a dist_sync job (2 workers, 2 servers) streams
Zipf ids over [0, 2**63) into a table of dynamic rows; every report keeps each server
under the budget, counts evictions and a hit rate, and the files are written."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(180)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_small_stream_stays_under_the_budget(tmp_path):
    p = subprocess.run([sys.executable, "-m", "benchmarks.dynrows", "--ids", "4e5", "--batch", "4096",
                        "--budget", "6000", "--evict-after", "20", "--report-every", "10", "--out-dir",
                        str(tmp_path), "--name", "small"], cwd=ROOT, capture_output=True, text=True, timeout=150,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stdout + p.stderr
    result = json.loads((tmp_path / "small.json").read_text())
    reports = result["reports"]
    assert reports[-1]["ids"] == 48 * 4096 * 2 and len(reports) == 5     # 48 steps, a report every 10 and the last
    for r in reports:
        assert max(r["rows_per_server"]) <= 6000 and 0 < r["hit_rate"] < 1
    assert reports[-1]["evicted_by_budget"] > 0
    assert reports[-1]["created"] - reports[-1]["evicted"] == sum(reports[-1]["rows_per_server"])
    assert "| ids | steps | rows per server |" in (tmp_path / "small.md").read_text()
