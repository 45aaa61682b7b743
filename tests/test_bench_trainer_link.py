"""benchmarks/trainer.py --link at tiny size: every contender split over two network
namespaces joined by a rate-limited veth pair (ours over tcp, DDP over gloo across
the veth, the floor on A), every worker's weights checked. Needs root and network
namespaces (skipped otherwise). Never asserts on speed: timings are only checked to
exist."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from services import NETNS_PREFIX as PREFIX, namespaces

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks import trainer  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.timeout(60)
def test_trainer_over_the_link_tiny(netns_ok, tmp_path):
    pytest.importorskip("torch")
    before = {n for n in namespaces() if n.startswith(PREFIX)}
    # mlp: no BatchNorm, so the floor is checked too; W=2, S=2 as the run of record
    args = ["--link", "1gbit", "--network", "mlp", "--batch-size", "4", "--image-size", "8",
            "--iters", "2", "--warmup", "1", "--launches", "1", "-w", "2", "-s", "2",
            "--timeout", "40", "--link-check-seconds", "0.1", "--out-dir", str(tmp_path),
            "--work-dir", str(tmp_path / "work")]
    p = subprocess.run([sys.executable, "-m", "benchmarks.trainer", *args], cwd=REPO,
                       capture_output=True, text=True, timeout=55, stdin=subprocess.DEVNULL)
    after = {n for n in namespaces() if n.startswith(PREFIX)}
    assert after - before == set(), "a namespace was left behind"
    if p.returncode == 0 and "skipped: the emulated network" in p.stdout:
        pytest.skip(p.stdout.strip().splitlines()[-1])
    assert p.returncode == 0, f"stdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
    data = json.loads((tmp_path / "trainer-link-1gbit.json").read_text())
    assert not (tmp_path / "trainer.json").exists()       # the default run's files are untouched
    assert set(data["link"]["namespaces"].values()).isdisjoint(namespaces())
    assert data["failures"] == []
    # every contender ran and has positive medians
    assert set(data["summary"]) == set(trainer.CONTENDERS)
    for name, s in data["summary"].items():
        assert s["n"] == 2 and s["median"] > 0 and s["p10"] > 0, (name, s)
        assert all(v > 0 for v in s["parts_median"].values()), (name, s)
    # the correctness check ran for every contender and passed
    chk = data["correctness"]
    assert chk["ok"] and set(chk["by_contender"]) == set(trainer.CONTENDERS)
    assert all(c["ok"] for c in chk["checks"] if c["checked"])
    assert all(b["ok"] and b["checks"] > 0 for b in chk["by_contender"].values())
    # ours really ran across the link: shm on its own side, tcp across; server r on side r
    addr = data["link"]["addresses"]
    for r in data["rows"]:
        if r["contender"].startswith("ours"):
            assert r["transports"] == ["shm", "tcp"]
            assert [u.split(":")[1].lstrip("/") for u in r["server_urls"]] == [addr["A"], addr["B"]]
        if r["contender"] != "floor":   # traffic crossed the veth both ways
            assert r["link_bytes"]["a_to_b"] > 0 and r["link_bytes"]["b_to_a"] > 0
    pred = data["prediction"]
    assert pred["T_c"] > 0 and pred["rates"]["nominal"]["nooverlap"] > 0
    md = (tmp_path / "trainer-link-1gbit.md").read_text()
    assert "Over the emulated link (1gbit)" in md and "Overall: passed" in md
    assert not os.path.exists(data["work_dir"])
