"""benchmarks/link/run.py at tiny size: emulated hosts (network namespaces, each with its
own rate-limited link to one bridge); gloo's ring over A and B, ours co-located on A
and B (tcp between them; uncompressed, 2bit, fp16) and ours on a dedicated server
host S0. Needs root and network namespaces (skipped otherwise). Never asserts on
speed: timings are only checked to exist; the bytes on the links are checked
against the wire model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from services import NETNS_PREFIX as PREFIX, namespaces

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.slow


def test_link_benchmark_tiny(netns_ok, tmp_path):
    pytest.importorskip("torch")
    before = {n for n in namespaces() if n.startswith(PREFIX)}
    out_dir = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "benchmarks.link", "--model", "tiny", "--rates", "1gbit",
                        "--iters", "2", "--launches", "1", "--layouts", "ring:2,colo:2,dedicated:2x1",
                        "--colo-modes", "pushpull,pushpull_2bit,pushpull_fp16",
                        "--timeline", "dedicated:2x1", "--out-dir", str(out_dir)],
                       cwd=REPO, capture_output=True, text=True, timeout=55)
    after = {n for n in namespaces() if n.startswith(PREFIX)}
    if p.returncode == 0 and "skipped: the emulated network" in p.stdout:
        pytest.skip(p.stdout.strip().splitlines()[-1])
    assert p.returncode == 0, f"stdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    data = json.loads((out_dir / "link.json").read_text())
    md = (out_dir / "link.md").read_text()
    assert md.startswith("# Gradient exchange over an emulated link")
    # the link use of the dedicated layout, sampled: the workers' hosts sent, the server's received
    assert "## Link use over the last exchange: dedicated:2x1 at 1gbit" in md, md
    timeline = next(L["timeline"] for L in json.loads((out_dir / "link.json").read_text())["launches"]
                    if L["layout"] == "dedicated:2x1")
    assert timeline.splitlines()[0].split() == ["t", "s", "A", "B", "S0"], timeline
    assert any(float(row.split()[1].split("/")[0]) > 0 for row in timeline.splitlines()[1:]), timeline
    # no namespace of this run (nor any new kvlink- one) is left behind
    assert set(data["namespaces"]).isdisjoint(namespaces())
    assert after - before == set()
    assert data["failures"] == []
    # the message and chunk sizes our processes ran with (no --env: the defaults)
    assert data["config"]["effective"] == {"pipeline_bytes": "auto", "chunk_bytes": 2 << 20}
    raw = data["rates"]["1gbit"]["raw"]
    assert raw["a_to_b_gbit"] > 0 and raw["b_to_a_gbit"] > 0
    got = {(e["layout"], e["mode"]): e for e in data["summary"]["1gbit"]}
    for want in [("ring:2", "flat"), ("ring:2", "buckets"), ("colo:2", "pushpull"),
                 ("colo:2", "pushpull_2bit"), ("colo:2", "pushpull_fp16"),
                 ("dedicated:2x1", "pushpull")]:
        assert want in got, f"no result for {want}: {sorted(got)}"
        e = got[want]
        assert e["n"] == 2 and e["median"] > 0 and e["model_ms"] > 0 and e["vs_gloo_flat"] > 0
    # the wire bound of a dedicated server host taking both workers' traffic: 2N / B
    n, bps = data["nbytes"], 1e9 / 8
    assert got[("dedicated:2x1", "pushpull")]["model_ms"] == pytest.approx(1e3 * 2 * n / bps)
    assert got[("colo:2", "pushpull")]["model_ms"] == pytest.approx(1e3 * n / bps)
    launches = {L["layout"]: L for L in data["launches"]}
    # ours co-located: servers on A's and B's addresses, worker 0 (on A) reaching its
    # own host's server through shared memory and the other over tcp
    colo = launches["colo:2"]
    assert colo["transports"] == ["shm", "tcp"]
    assert [u.split(":")[1].lstrip("/") for u in colo["server_urls"]] == [
        data["addresses"]["A"], data["addresses"]["B"]]
    # ours dedicated: the server on S0, reached over tcp by worker 0
    ded = launches["dedicated:2x1"]
    assert ded["transports"] == ["tcp"]
    assert ded["server_urls"][0].split(":")[1].lstrip("/") == data["addresses"]["S0"]
    for L in data["launches"]:   # traffic crossed every link of the layout, both directions,
        for host, counted in L["link_bytes"].items():   # at least what the wire model says
            model = L["model_link_bytes"][host]
            assert counted["tx"] >= 0.99 * model["tx"] and counted["rx"] >= 0.99 * model["rx"], \
                (L["layout"], host, counted, model)
            assert counted["tx"] > 0 and counted["rx"] > 0


def test_namespaces_of_a_run_that_died_are_reaped(netns_ok):
    """A run killed before it could clean up leaves kvlink-PID-... namespaces: the
    next run deletes them (their process is gone, nothing runs inside), and never
    one whose process is alive."""
    from benchmarks.harness import netns
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale, alive = f"{PREFIX}{dead.pid}-test-a", f"{PREFIX}{os.getpid()}-test-a"
    for name in (stale, alive):
        subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        assert stale in netns.reap_stale()
        assert stale not in namespaces() and alive in namespaces()
    finally:
        for name in (stale, alive):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
