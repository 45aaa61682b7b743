"""benchmarks/emulated_ipc at tiny size: dist_device_sync jobs (2 workers, 2 GPU
servers, real processes) on emulated GPUs in every layout. Never asserts on speed:
timings are only checked to exist; every sum is checked by the job itself, and the
layouts' key counts and the transport are checked here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.harness.key_layouts import buckets, layout

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_layouts_hold_the_same_values_in_161_19_and_1_keys():
    sizes = {name: layout(name) for name in ("keys", "buckets", "flat")}
    assert {name: len(s) for name, s in sizes.items()} == {"keys": 161, "buckets": 19, "flat": 1}
    assert len({sum(s) for s in sizes.values()}) == 1
    assert buckets([3, 1, 2, 5, 1], 4) == [4, 7, 1]      # closed once a bucket reaches the cap
    with pytest.raises(ValueError, match="unknown layout 'rows'"):
        layout("rows")


@pytest.mark.slow
def test_emulated_ipc_benchmark_tiny(tmp_path):
    out_dir = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "benchmarks.emulated_ipc", "--scale", "4096", "--iters", "2",
                        "--warmup", "1", "--out-dir", str(out_dir)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"stdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    assert (out_dir / "emulated_ipc.md").read_text().startswith("# The cuda_ipc data plane on emulated GPUs")
    results = json.loads((out_dir / "emulated_ipc.json").read_text())["results"]
    assert {name: r["keys"] for name, r in results.items()} == {"keys": 161, "buckets": 19, "flat": 1}
    for r in results.values():
        assert r["transports"] == ["cuda_ipc"]
        assert len(r["samples_ms"]) == 2 and all(s > 0 for s in r["samples_ms"])
        assert len(r["cpu_samples_ms"]) == 2 and r["cpu_ms"] >= 0      # worker 0's CPU time per call
    assert "of worker 0's CPU" in (out_dir / "emulated_ipc.md").read_text()
