"""benchmarks/trainer/run.py --link at tiny size: the contenders split over two network
namespaces joined by a rate-limited veth pair (ours over tcp, DDP over gloo across the
veth, the floor on A; ours with and without overlap, the servers and the workers
updating, each once: the four combinations differ in the Trainer, which
tests/benchmarks/test_bench_trainer.py runs all of, not in what crosses the link),
every worker's weights checked; and over a --layout's hosts (dedicated: worker hosts
A, B and a server host S0). Needs root and network namespaces (skipped otherwise).
Never asserts on speed: timings are only checked to exist."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from services import NETNS_PREFIX as PREFIX, namespaces

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from benchmarks.harness import layouts  # noqa: E402
from benchmarks.trainer import run as trainer  # noqa: E402

pytestmark = pytest.mark.slow
LINKED = ("ours-overlap-server", "ours-nooverlap-worker", "ddp", "floor")

# mlp: no BatchNorm, so the floor is checked too; 1 warm-up + 2 timed steps, 1 launch
TINY = ["--link", "1gbit", "--network", "mlp", "--batch-size", "4", "--image-size", "8",
        "--iters", "2", "--warmup", "1", "--launches", "1", "--timeout", "40",
        "--link-check-seconds", "0.1"]


def run_link(tmp_path, *args):
    """The benchmark as a user runs it (skips the test where namespaces cannot be
    built); returns the finished process."""
    p = subprocess.run([sys.executable, "-m", "benchmarks.trainer", *TINY, *args, "--out-dir",
                        str(tmp_path), "--work-dir", str(tmp_path / "work")], cwd=REPO,
                       capture_output=True, text=True, timeout=220, stdin=subprocess.DEVNULL)
    # (about 45 s alone on 2 cores, twice that beside 3 other xdist workers)
    if p.returncode == 0 and "skipped: the emulated network" in p.stdout:
        pytest.skip(p.stdout.strip().splitlines()[-1])
    return p


def passed(p, tmp_path, name: str) -> dict:
    """The run's JSON, after checking that it passed, every check it made passed, and
    its namespaces are gone."""
    assert p.returncode == 0, f"stdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert set(data["link"]["namespaces"].values()).isdisjoint(namespaces())
    assert data["failures"] == []
    chk = data["correctness"]
    assert chk["ok"] and set(chk["by_contender"]) == set(data["contenders"])
    assert all(c["ok"] for c in chk["checks"] if c["checked"])
    assert all(b["ok"] and b["checks"] > 0 for b in chk["by_contender"].values())
    assert not os.path.exists(data["work_dir"])
    return data


@pytest.mark.timeout(240)
def test_trainer_over_the_link_tiny(netns_ok, tmp_path):
    pytest.importorskip("torch")
    before = {n for n in namespaces() if n.startswith(PREFIX)}
    p = run_link(tmp_path, "-w", "2", "-s", "2", "--contenders", ",".join(LINKED))  # W=2, S=2 as of record
    after = {n for n in namespaces() if n.startswith(PREFIX)}
    assert after - before == set(), "a namespace was left behind"
    data = passed(p, tmp_path, "trainer-link-1gbit")
    assert not (tmp_path / "trainer.json").exists()       # the default run's files are untouched
    # every contender ran and has positive medians
    assert set(data["summary"]) == set(LINKED)
    for name, s in data["summary"].items():
        assert s["n"] == 2 and s["median"] > 0 and s["p10"] > 0, (name, s)
        assert all(v > 0 for v in s["parts_median"].values()), (name, s)
    # the correctness check ran for every contender and passed
    assert set(data["correctness"]["by_contender"]) == set(LINKED)
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


@pytest.mark.timeout(240)
def test_trainer_over_a_dedicated_layout_tiny(netns_ok, tmp_path):
    """dedicated:2x1: workers (and DDP's ranks) on A and B, the one server on S0, so
    every byte of ours crosses a link; two contenders keep it short (ours without
    overlap gives T_c; DDP is checked against the reference, ours against both)."""
    pytest.importorskip("torch")
    p = run_link(tmp_path, "--layout", "dedicated:2x1",
                 "--contenders", "ours-nooverlap-worker,ddp")
    data = passed(p, tmp_path, "trainer-link-1gbit-dedicated-2x1")
    assert not (tmp_path / "trainer-link-1gbit.json").exists()
    assert data["config"]["workers"] == 2 and data["config"]["servers"] == 1   # the layout's
    assert set(data["correctness"]["by_contender"]) == {"ours-nooverlap-worker", "ddp"}
    assert data["correctness"]["by_contender"]["ours-nooverlap-worker"]["checks"] == 4
    link = data["link"]
    addr = link["addresses"]
    assert set(addr) == {"A", "B", "S0"} and link["layout"] == "dedicated:2x1"
    assert link["worker_hosts"] == ["A", "B"] and link["server_hosts"] == ["S0"]
    ours = [r for r in data["rows"] if r["contender"] == "ours-nooverlap-worker"]
    assert len(ours) == 1
    # every worker checked its transports in the run; rank 0's are in the row: tcp to S0
    assert ours[0]["transports"] == ["tcp"]
    assert [u.split(":")[1].lstrip("/") for u in ours[0]["server_urls"]] == [addr["S0"]]
    for host in ("A", "B", "S0"):       # ours' traffic crossed every host's link both ways
        assert ours[0]["host_bytes"][host]["tx"] > 0 and ours[0]["host_bytes"][host]["rx"] > 0
    # the prediction uses the layout's wire bytes: S0's link carries 2M, DDP's ring M
    pred, m = data["prediction"], data["config"]["num_params"] * 4
    assert pred["wire_bytes"] == layouts.parse("dedicated:2x1").bound_bytes("pushpull", m) == 2 * m
    assert pred["wire_bytes_ddp"] == m
    assert set(pred["by_contender"]) == {"ours-nooverlap-worker", "ddp"}
    md = (tmp_path / "trainer-link-1gbit-dedicated-2x1.md").read_text()
    assert "Over the emulated link (1gbit, dedicated:2x1)" in md and "Overall: passed" in md
    assert "model: ours, dedicated:2x1" in md


def test_a_layout_sets_w_and_s_and_a_mismatch_is_an_error(capsys):
    args = trainer.parse_args(["--link", "1gbit", "--layout", "dedicated:4x2"])
    assert (args.workers, args.servers, args.name) == (4, 2, "trainer-link-1gbit-dedicated-4x2")
    assert trainer.parse_args(["--link", "1gbit", "--layout", "colo:3", "-w", "3"]).servers == 3
    for argv, why in ((["--link", "1gbit", "--layout", "dedicated:4x2", "-w", "2"],
                       "--workers 2 disagrees with --layout dedicated:4x2"),
                      (["--link", "1gbit", "--layout", "dedicated:4x2", "-s", "4"],
                       "--servers 4 disagrees with --layout dedicated:4x2"),
                      (["--layout", "dedicated:2x2"], "it needs --link RATE"),
                      (["--link", "1gbit", "--layout", "ring:2"], "ring is gloo's layout")):
        with pytest.raises(SystemExit) as e:
            trainer.parse_args(argv)
        assert e.value.code == 2 and why in capsys.readouterr().err, argv
