"""benchmarks/host_reduce/run.py at tiny size: 2 emulated worker hosts of 2 workers each
and 2 server hosts, pushpull with and without KVSTORE_HOST_REDUCE. Needs root and
network namespaces (skipped otherwise). Never asserts on speed: timings are only
checked to exist; the bytes each worker host's link sent show that with it on the
workers of a host summed there and pushed once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from services import NETNS_PREFIX as PREFIX, namespaces

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.slow


def test_host_reduce_benchmark_tiny(netns_ok, tmp_path):
    out_dir = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "benchmarks.host_reduce", "--model", "tiny",
                        "--rates", "1gbit", "--iters", "2", "--launches", "1",
                        "--out-dir", str(out_dir)],
                       cwd=REPO, capture_output=True, text=True, timeout=55)
    if p.returncode == 0 and "skipped: the emulated network" in p.stdout:
        pytest.skip(p.stdout.strip().splitlines()[-1])
    assert p.returncode == 0, f"stdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    assert (out_dir / "host_reduce.md").read_text().startswith("# Summing on the host")
    data = json.loads((out_dir / "host_reduce.json").read_text())
    assert data["failures"] == []
    # no namespace of this run is left behind (others' runs may come and go meanwhile)
    assert data["namespaces"] and all(n.startswith(PREFIX) for n in data["namespaces"])
    assert set(data["namespaces"]).isdisjoint(namespaces())
    assert data["config"]["worker_hosts"] == ["A", "B", "A", "B"]
    runs = {L["variant"]: L for L in data["launches"]}
    assert sorted(runs) == ["direct", "host_reduce"]
    for run in runs.values():
        assert len(run["samples"]) == 2 and all(s > 0 for s in run["samples"])
        assert run["transports"] == ["tcp", "tcp"]   # worker 0 on A, both servers elsewhere
    # each worker host pushes once for its two workers: about half of what it sends direct
    for host in ("A", "B"):
        sent = {v: runs[v]["link_bytes"][host]["tx"] for v in runs}
        assert sent["direct"] > 0 and sent["host_reduce"] < 0.7 * sent["direct"], (host, sent)
    summary = data["summary"]["1gbit"]
    assert summary["direct"]["n"] == summary["host_reduce"]["n"] == 2
