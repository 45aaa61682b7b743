"""benchmarks/per_key at tiny size: in-process dist_sync jobs (a worker and a server as
threads) in both layouts, this checkout measured twice (once as a --tree). Never
asserts on speed: timings are only checked to exist; every sum is checked by the
job itself, and the key counts and the transport are checked here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_per_key_benchmark_tiny(tmp_path):
    out_dir = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "benchmarks.per_key", "--scale", "4096", "--iters", "2",
                        "--warmup", "1", "--repeats", "1", "--tree", f"again={REPO}", "--out-dir", str(out_dir)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"stdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    assert (out_dir / "per_key.md").read_text().startswith("# Python per key")
    data = json.loads((out_dir / "per_key.json").read_text())
    assert set(data["results"]) == {"this", "again"}
    for by_layout in data["results"].values():
        assert {name: r["keys"] for name, r in by_layout.items()} == {"keys": 161, "flat": 1}
        for r in by_layout.values():
            assert r["transports"] == ["shm"]
            assert all(r[m]["median"] > 0 for m in ("worker_ms", "server_ms", "wall_ms"))


def test_a_tree_that_is_no_checkout_is_refused(tmp_path):
    p = subprocess.run([sys.executable, "-m", "benchmarks.per_key", "--tree", f"x={tmp_path}",
                        "--out-dir", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "expected LABEL=DIR" in p.stderr
