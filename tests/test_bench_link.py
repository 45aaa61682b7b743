"""benchmarks/link.py at tiny size: two network namespaces joined by a rate-limited veth
pair, gloo and ours (tcp; uncompressed, 2bit, fp16) across it. Needs root and network
namespaces (skipped otherwise). Never asserts on speed: timings are only checked to exist."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from services import NETNS_PREFIX as PREFIX, namespaces

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow


def test_link_benchmark_tiny(netns_ok, tmp_path):
    pytest.importorskip("torch")
    before = {n for n in namespaces() if n.startswith(PREFIX)}
    out_dir = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "benchmarks.link", "--model", "tiny", "--rates", "1gbit",
                        "--iters", "2", "--launches", "1", "--out-dir", str(out_dir)],
                       cwd=REPO, capture_output=True, text=True, timeout=55)
    after = {n for n in namespaces() if n.startswith(PREFIX)}
    if p.returncode == 0 and "skipped: the emulated network" in p.stdout:
        pytest.skip(p.stdout.strip().splitlines()[-1])
    assert p.returncode == 0, f"stdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    data = json.loads((out_dir / "link.json").read_text())
    assert (out_dir / "link.md").read_text().startswith("# Gradient exchange over an emulated link")
    # no namespace of this run (nor any new kvlink- one) is left behind
    assert set(data["namespaces"]).isdisjoint(namespaces())
    assert after - before == set()
    assert data["failures"] == []
    raw = data["rates"]["1gbit"]["raw"]
    assert raw["a_to_b_gbit"] > 0 and raw["b_to_a_gbit"] > 0
    got = {(e["contender"], e["mode"]): e for e in data["summary"]["1gbit"]}
    for want in [("gloo", "flat"), ("ours", "pushpull"), ("ours", "pushpull_2bit"),
                 ("ours", "pushpull_fp16")]:
        assert want in got, f"no result for {want}: {sorted(got)}"
        e = got[want]
        assert e["n"] == 2 and e["median"] > 0 and e["model_ms"] > 0
    # ours really ran across the link: servers on both namespaces' addresses, worker 0
    # reaching its own machine's server through shared memory and the other over tcp
    ours = [L for L in data["launches"] if L["contender"] == "ours"]
    assert ours and ours[0]["transports"] == ["shm", "tcp"]
    assert [u.split(":")[1].lstrip("/") for u in ours[0]["server_urls"]] == [
        data["addresses"]["A"], data["addresses"]["B"]]
    for L in data["launches"]:   # traffic crossed the veth in both directions
        assert L["link_bytes"]["a_to_b"] > 0 and L["link_bytes"]["b_to_a"] > 0
