"""A small fixed subset of benchmarks/chaos/run.py: one run per fault type, each must
end fast, non-zero, with the culprit marked, nothing left behind and no wrong value;
a short elastic run (``--elastic``), where a worker's fault must not end the job;
and one run per phase of benchmarks/chaos/phases.py (start-up, a checkpoint save,
a resume, teardown), where a save or resume fault must be followed by a
``--resume`` that ends with the uninterrupted run's weights or refuses clearly;
and the replicated mode (``--replicated``), where a server's death must not end the
job nor change its result."""

import json

import pytest

from benchmarks.chaos import run as chaos, phases as chaos_phases, replicated as chaos_replicated
from benchmarks.chaos.phases import Case

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
def test_elastic_jobs_go_on_without_the_faulty_worker(tmp_path, monkeypatch):
    """``--elastic --runs 3 --seed 738``: a server's SIGTERM still ends its job
    naming it; a worker killed with SIGKILL (``--max-restarts 1``, sync) leaves and
    its replacement joins the running job; a worker's exit(1) (no restarts) leaves.
    Each run must pass chaos's elastic criteria, and the table lands in
    chaos-elastic.md and .json. The workers' rounds past the fault are cut to 30
    (a quarter of a second, far less than a replacement's start): the replacement
    joins only because the others wait for it (``--await-members``)."""
    monkeypatch.setattr(chaos, "JOIN_TAIL", 30)
    code = chaos.main(["--elastic", "--runs", "3", "--seed", "738", "--out-dir", str(tmp_path)])
    runs = json.loads((tmp_path / "chaos-elastic.json").read_text())["runs"]
    assert code == 0 and not [r for r in runs if r["problems"]], runs
    assert [(r["fault"], r["target"], r["mode"], r["max_restarts"]) for r in runs] == [
        ("SIGTERM", "server 0", "async", 0), ("SIGKILL", "worker 1", "sync", 1),
        ("exit", "worker 0", "sync", 0)], runs
    assert runs[1]["replaced"], runs[1]
    assert "| SIGKILL -> worker | 1 | 1 | 0 | 1 of 1 |" in (tmp_path / "chaos-elastic.md").read_text()


@pytest.fixture(scope="module")
def references():
    """The uninterrupted runs' digests, shared by the phase tests (one job per W)."""
    return chaos_phases.References()


def run_phase(case: Case, references) -> dict:
    run = chaos_phases.run_phase_case(case, 0, references)
    assert not run["problems"], run
    return run


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", [
    Case("startup", "SIGKILL", "server", 1, "spawned", workers=2, servers=2, save_every=5, big_rank=1),
    Case("startup", "raise", "worker", 1, "init", workers=2, servers=1, save_every=5, big_rank=0),
    Case("teardown", "SIGKILL", "server", 0, "last round", workers=2, servers=2, save_every=5, big_rank=1),
    Case("teardown", "exit", "worker", 1, "teardown", workers=2, servers=1, save_every=5, big_rank=0),
], ids=["server-killed-before-registering", "worker-raises-before-init", "server-killed-after-the-last-round",
        "worker-exits-before-close"])
def test_a_fault_at_startup_or_teardown_ends_the_job_cleanly(case, references):
    run_phase(case, references)


@pytest.mark.timeout(90)
def test_a_server_killed_while_writing_its_checkpoint_then_resume_refuses_clearly(references):
    """Killed while writing its part of the first save: no complete checkpoint
    exists, so ``--resume`` must refuse, naming the server and the file."""
    run = run_phase(Case("save", "SIGKILL", "server", 1, "mid-write", workers=2, servers=2, save_every=5,
                         big_rank=1, at=1), references)
    assert run["struck_on"] and run["resume"] == "refused", run


@pytest.mark.timeout(90)
def test_a_server_killed_while_writing_a_later_checkpoint_then_resume_gives_the_uninterrupted_weights(
        references):
    run = run_phase(Case("save", "SIGKILL", "server", 1, "mid-write", workers=2, servers=2, save_every=5,
                         big_rank=1, at=3), references)
    assert run["resume"] == "resumed", run


@pytest.mark.timeout(90)
@pytest.mark.skipif(not chaos_phases.can_fill_disks(), reason="a full disk is a tmpfs: mounting one needs root")
def test_disk_full_on_one_server_fails_the_save_naming_it_and_resume_refuses_clearly(references):
    """Server 1's disk is full from the start: its part of the first save fails,
    the job ends naming it, and with no complete checkpoint ``--resume`` refuses."""
    run = run_phase(Case("save", "disk-full", "server", 1, "disk full", workers=2, servers=2, save_every=5,
                         big_rank=1, at=0), references)
    assert run["full"] == "server 1" and run["resume"] == "refused", run


@pytest.mark.timeout(120)
def test_a_server_killed_while_the_job_resumes_then_resume_gives_the_uninterrupted_weights(references):
    """Crashed after its first save, resumed, and server 0 killed as the resumed
    job's servers start: the next ``--resume`` ends with the uninterrupted weights."""
    run = run_phase(Case("resume", "SIGKILL", "server", 0, "restoring", workers=2, servers=2, save_every=5,
                         big_rank=1, at=1, crash_rank=1), references)
    assert run["resume"] == "resumed", run


@pytest.mark.timeout(120)
def test_phase_runs_take_turns_and_land_in_one_table(tmp_path):
    """``--phases startup,teardown --runs 2``: one run of each, in that order, in
    chaos.md's per-phase table and chaos.json."""
    code = chaos.main(["--phases", "startup,teardown", "--runs", "2", "--seed", "5", "--out-dir", str(tmp_path)])
    report = json.loads((tmp_path / "chaos.json").read_text())
    assert code == 0 and [r["phase"] for r in report["runs"]] == ["startup", "teardown"], report
    table = (tmp_path / "chaos.md").read_text()
    assert "| startup | all | 1 | 1 | 0 | 0 | 0 | 0 | - | - |" in table, table
    assert "| **all** | | 2 | 2 | 0 | 0 | 0 | 0 |" in table, table


@pytest.mark.timeout(90)
def test_a_replicated_run_replayed_by_its_seed_survives_a_killed_server(tmp_path):
    """``--replicated --replay 83 --modes sync``: dist_sync with deterministic sums,
    W=3, S=3, server 1 killed 38 ms after round 6: exit 0, every worker's weights
    the uninterrupted run's bit for bit, the failover reported, nothing left, the
    pause measured; the table and the run in chaos-replicated.md and .json."""
    code = chaos.main(["--replicated", "--replay", "83", "--modes", "sync", "--out-dir", str(tmp_path)])
    [run] = json.loads((tmp_path / "chaos-replicated.json").read_text())["runs"]
    assert code == 0 and not run["problems"], run
    assert (run["seed"], run["mode"], run["workers"], run["servers"], run["fault"], run["rank"], run["moment"],
            run["at"]) == (83, "sync", 3, 3, "SIGKILL", 1, "rounds", 6), run
    assert run["exit"] == 0 and 0 < run["pause_s"] < 60, run
    assert "| dist_sync | SIGKILL | rounds | 1 | 1 | 0 |" in (tmp_path / "chaos-replicated.md").read_text()


@pytest.mark.timeout(90)
def test_a_replicated_dist_async_job_applies_every_push_once_across_a_server_killed_in_a_save():
    """dist_async, server 0 of 2 killed 2 ms into the second checkpoint save: the
    save may fail (the job goes on), every acknowledged push is applied exactly
    once (each worker prints ``exact``), exit 0, nothing left."""
    case = chaos_replicated.Case(seed=0, mode="async", workers=2, servers=2, fault="SIGKILL", target="server",
                                 rank=0, moment="save", at=2, delay_s=0.002)
    run = chaos_replicated.run_case(case, chaos_replicated.References())
    assert not run["problems"], run
    assert run["exit"] == 0 and "pause_s" in run, run


@pytest.mark.timeout(90)
def test_a_replicated_job_goes_on_after_its_scheduler_is_killed_in_rounds():
    """The scheduler target: SIGKILL of the job's scheduler 5 ms after round 4 of a
    dist_sync job; the launcher restarts it, every process registers again, and the
    job ends with exit 0, the uninterrupted weights, the restart reported."""
    case = chaos_replicated.Case(seed=0, mode="sync", workers=2, servers=2, fault="SIGKILL", target="scheduler",
                                 rank=0, moment="rounds", at=4, delay_s=0.005)
    run = chaos_replicated.run_case(case, chaos_replicated.References())
    assert not run["problems"], run
    assert run["exit"] == 0, run


@pytest.mark.timeout(90)
def test_an_elastic_replicated_job_goes_on_after_its_scheduler_is_stopped_in_a_save():
    """SIGSTOP of the scheduler 1 ms into save 1 of an elastic dist_async job: alive,
    it answers no ping, so after the heartbeat timeout (2 s) the launcher kills it and
    starts it again; the restarted scheduler rebuilds the membership from the
    members' reports (it was tested on the state machine only), the save's barriers
    are sent again, and the job ends with exit 0, every push applied once."""
    case = chaos_replicated.Case(seed=0, mode="async", workers=3, servers=3, fault="SIGSTOP", target="scheduler",
                                 rank=0, moment="save", at=1, delay_s=0.001, elastic=True)
    run = chaos_replicated.run_case(case, chaos_replicated.References())
    assert not run["problems"], run
    assert run["exit"] == 0 and run["pause_s"] < 10, run


@pytest.mark.timeout(120)
def test_a_replicated_job_survives_a_second_server_lost_in_a_save_after_a_replacement():
    """The second-server target: server 2 of 3 killed after round 3, a replacement
    (server 3) backs up the shares that lost their backup; then server 1 is killed
    4.7 ms into a save, so that its share moves to the replacement while the save's
    requests to every server wait (chaos seed 647892279 found that the replacement
    was never asked: KeyError in request_all). Exit 0, every push applied once, both
    losses reported survived, nothing left."""
    case = chaos_replicated.Case(seed=0, mode="async", workers=3, servers=3, fault="SIGKILL", target="second-server",
                                 rank=1, moment="save", at=2, delay_s=0.0047, first=2, rounds=300)
    run = chaos_replicated.run_case(case, chaos_replicated.References())
    assert not run["problems"], run
    assert run["exit"] == 0, run


@pytest.mark.timeout(90)
def test_a_replicated_job_forms_with_a_server_killed_as_soon_as_it_existed():
    """The ``spawned`` moment: server 1 of 2 SIGKILLed as soon as its process exists,
    before it registered (nothing to fail over yet). The scheduler has its launcher
    start it again in place (tracker.control.start_again), the job forms with it and
    ends with exit 0, the uninterrupted weights and the start again reported. (A
    stopped one is started again at the registration deadline: the state machine's
    and the launcher's tests, and the chaos runs of record.)"""
    case = chaos_replicated.Case(seed=0, mode="sync", workers=2, servers=2, fault="SIGKILL", target="server",
                                 rank=1, moment="startup", startup="spawned")
    run = chaos_replicated.run_case(case, chaos_replicated.References())
    assert not run["problems"], run
    assert run["exit"] == 0, run


@pytest.mark.timeout(90)
def test_an_elastic_replicated_job_survives_a_server_killed_in_rounds():
    """``--replicated --elastic``: the job runs with ``--elastic 1:W``; server 0 of 3
    killed 10 ms after round 7 of dist_sync: exit 0, the uninterrupted weights bit
    for bit, the failover reported."""
    case = chaos_replicated.Case(seed=0, mode="sync", workers=3, servers=3, fault="SIGKILL", target="server",
                                 rank=0, moment="rounds", at=7, delay_s=0.01, elastic=True)
    run = chaos_replicated.run_case(case, chaos_replicated.References())
    assert not run["problems"], run
    assert run["exit"] == 0 and "pause_s" in run, run
