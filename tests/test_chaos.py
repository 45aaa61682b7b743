"""A small fixed subset of benchmarks/chaos.py: one run per fault type, each must
end fast, non-zero, with the culprit marked, nothing left behind and no wrong value;
and a short elastic run (``--elastic``), where a worker's fault must not end the job."""

import json

import pytest

from benchmarks import chaos

pytestmark = pytest.mark.slow


@pytest.fixture
def quick_heartbeats(monkeypatch):
    """Silence is taken for death after 5 s instead of the benchmark's 10 s: the same
    detection (a SIGSTOPped or cut-off process), found sooner."""
    monkeypatch.setitem(chaos.ENV, "KVSTORE_HEARTBEAT_TIMEOUT", "5")


@pytest.mark.parametrize("fault, role, workers, servers, mode", [
    ("SIGKILL", "server", 3, 2, "sync"),
    ("SIGTERM", "worker", 2, 2, "async"),
    ("SIGSTOP", "server", 2, 1, "sync"),
    ("exit", "worker", 3, 1, "sync"),
    ("raise", "worker", 2, 3, "async"),
])
def test_one_fault_ends_the_job_cleanly(fault, role, workers, servers, mode, quick_heartbeats):
    run = chaos.run_case(0, workers, servers, mode, fault, role, rank=1 if role == "worker" else 0, after=3)
    assert not run["problems"], run


def test_a_partitioned_machine_ends_the_job_cleanly(netns_ok, quick_heartbeats):
    run = chaos.partition_case(0, 2, 2, "sync", after=3)
    assert not run["problems"], run


@pytest.mark.parametrize("fault, role", [("SIGKILL", "server"), ("raise", "worker")])
def test_one_fault_over_ssh_ends_the_job_cleanly(sshd, fault, role):
    run = chaos.run_case(0, 2, 2, "sync", fault, role, rank=1, after=3, sshd=sshd)
    assert not run["problems"], run


@pytest.mark.timeout(90)
def test_elastic_jobs_go_on_without_the_faulty_worker(tmp_path):
    """``--elastic --runs 3 --seed 738``: a server's SIGTERM still ends its job
    naming it; a worker killed with SIGKILL (``--max-restarts 1``, sync) leaves and
    its replacement joins the running job; a worker's exit(1) (no restarts) leaves.
    Each run must pass chaos.py's elastic criteria, and the table lands in
    chaos-elastic.md and .json."""
    code = chaos.main(["--elastic", "--runs", "3", "--seed", "738", "--out-dir", str(tmp_path)])
    runs = json.loads((tmp_path / "chaos-elastic.json").read_text())["runs"]
    assert code == 0 and not [r for r in runs if r["problems"]], runs
    assert [(r["fault"], r["target"], r["mode"], r["max_restarts"]) for r in runs] == [
        ("SIGTERM", "server 0", "async", 0), ("SIGKILL", "worker 1", "sync", 1),
        ("exit", "worker 0", "sync", 0)], runs
    assert runs[1]["replaced"], runs[1]
    assert "| SIGKILL -> worker | 1 | 1 | 0 | 1 of 1 |" in (tmp_path / "chaos-elastic.md").read_text()
