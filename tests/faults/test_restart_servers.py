"""Replacement servers (``--restart-servers N`` with KVSTORE_REPLICAS=1,
docs/reliability.md): real jobs through ``python -m tracker.local``.

Server 1 is killed (SIGKILL) mid-training; the launcher starts a new server
process (rank S, then S+1, ...) that registers as a replacement, becomes the
backup of the shares that lost theirs, and gets their replicas rebuilt by their
owners (values, round counts, optimizer state). Worker 0 waits for that event
(the scheduler's servers' book: every share has a complete replica again), then
kills the server that now serves server 1's share: the job ends with exit 0 and
the weights of the uninterrupted run, bit for bit (dist_sync, deterministic
sums; the weights do not depend on the number of servers, so one reference run
serves both), or (dist_async) with every acknowledged push applied exactly once;
a replacement that serves shares saves their checkpoint parts, and the set
resumes to the uninterrupted weights. Without replicas the option is refused; with its budget spent, a chain's second
failure ends the job naming both servers, as without it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from test_replicated_servers import ROOT, digests, reference_digest, run as run_job

SCRIPTS = os.path.join(ROOT, "tests", "scripts")


def run(*options, script="replicated.py", servers=2, timeout=120, **env) -> subprocess.CompletedProcess:
    """tests/faults/test_replicated_servers.run with launcher ``options`` and ``script``."""
    return run_job(*options, sys.executable, os.path.join(SCRIPTS, script), servers=servers, timeout=timeout,
                   **env)


@pytest.fixture(scope="module")
def uninterrupted() -> str:
    """The final weights of the job without replicas and without a fault."""
    return reference_digest(run())


def test_a_replacement_rebuilds_the_replicas_so_a_second_kill_keeps_the_uninterrupted_weights(uninterrupted):
    """3 servers (backups 1, 2, 0): server 1 dies, server 2 serves its share and
    server 3 (the replacement) backs up shares 0 and 1, rebuilt by two primaries;
    server 2 then has two backups (server 0 for its own share, server 3 for server
    1's). Server 2 dies: server 3 serves server 1's share, server 0 server 2's.
    (Two shares taken over by a replacement, the workers connecting to it: the
    dist_async test below.)"""
    servers, second, owners = 3, 2, "[0, 3, 0]"
    out = run("--restart-servers", "2", servers=servers, KVSTORE_REPLICAS="1", KILL=f"1:2,{second}:6",
              REBUILT="6")
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert f"started server {servers} in place of server 1" in log, log
    assert f"server {servers} (pid" in log and "joined as a replacement" in log, log
    assert re.search(rf"server \d: the replica of server 1's share on server {servers} is rebuilt", log), log
    assert "[worker:0] replicas rebuilt" in out.stdout, log
    assert f"killed server {second} at step 6" in out.stdout, log
    assert f"servers' book epoch 5: owners {owners}" in log, log
    assert f"server {servers} serves server 1's chunks now" in log, log
    assert digests(out) == [uninterrupted, uninterrupted], log


def test_dist_async_applies_every_acknowledged_push_exactly_once_across_two_failovers():
    """2 servers: server 1 dies, server 2 (the replacement) backs up both shares (server
    0 serves them); server 0 dies and server 2 serves both."""
    out = run("--restart-servers", "1", script="replicated_async.py", KVSTORE_REPLICAS="1",
              KVSTORE_DETERMINISTIC="0", KILL="1:10,0:25", REBUILT="25")
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert "killed server 0 at step 25" in out.stdout and "server 2 serves server 0's chunks now" in log, log
    assert "server 2 serves server 1's chunks now" in log and "owners [2, 2]" in log, log
    assert sorted(re.findall(r"\[worker:(\d)\] exact", out.stdout)) == ["0", "1"], log


def test_a_promoted_replacement_saves_the_shares_it_serves_and_the_set_resumes_to_the_uninterrupted_weights(
        uninterrupted, tmp_path):
    """2 servers: server 1 dies, server 2 replaces it, server 0 dies: server 2 serves
    both shares and writes both parts of the checkpoint saved after step 7 (under
    ranks 0 and 1: a set keeps one part per share); the job resumed from it with 2
    fresh servers ends with the uninterrupted weights."""
    folder = str(tmp_path / "ckpt")
    out = run("--restart-servers", "1", KVSTORE_REPLICAS="1", KVSTORE_CHECKPOINT_DIR=folder, KILL="1:2,0:6",
              REBUILT="6", SAVE="7", STOP="8")
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    for share in (0, 1):
        assert f"server 2: server {share}'s part of checkpoint 1 (its share, served here) written" in log, log
    assert sorted(n for n in os.listdir(folder) if n.endswith(".ckpt")) == ["server-0.ckpt", "server-1.ckpt"]
    resumed = run(KVSTORE_REPLICAS="1", KVSTORE_CHECKPOINT_DIR=folder, KVSTORE_RESUME="1")
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, log
    assert "resumed=True start=8" in resumed.stdout, log
    assert digests(resumed) == [uninterrupted, uninterrupted], log


def test_with_the_budget_spent_a_chains_second_failure_ends_the_job_naming_both_servers():
    out = run("--restart-servers", "1", KVSTORE_REPLICAS="1", KILL="1:2,0:6,2:8", REBUILT="6")
    log = out.stdout + out.stderr
    assert out.returncode != 0, log
    assert "no server started in place of server 0: --restart-servers reached" in log, log
    assert "Two failures of one replication chain (servers 0 and 2)" in log, log
    assert "job failed" in log, log


def test_restart_servers_without_replicas_is_refused_before_anything_starts():
    out = run("--restart-servers", "1", timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "--restart-servers 1 starts servers in place of dead ones" in out.stderr, out.stderr
    assert "KVSTORE_REPLICAS=1" in out.stderr and "worker:" not in out.stdout, out.stdout + out.stderr


def test_a_server_started_by_hand_replaces_a_dead_one_so_a_second_kill_keeps_the_uninterrupted_weights(
        uninterrupted):
    """No --restart-servers: the job's user starts the replacement, as a worker that
    joins an elastic job is started (docs/reliability.md): ``python -m kvstore.server``
    with the job's scheduler, secret and settings and the next server rank
    (KVSTORE_RANK=S, the job's S servers in KVSTORE_NUM_SERVERS). 3 servers: server 1
    dies after step 2, the hand-started server 3 backs up the shares that lost their
    backup and has them rebuilt; worker 0 waits for that, and server 2 dies after step
    6: the weights of the uninterrupted job."""
    from services import Proc
    from test_replicated_servers import BASE
    secret = os.urandom(16).hex()
    settings = {**BASE, "KVSTORE_REPLICAS": "1", "KVSTORE_SECRET": secret}
    job = Proc([sys.executable, "-m", "tracker.local", "-n", "2", "-s", "3", "--kill-grace", "1", sys.executable,
                os.path.join(SCRIPTS, "replicated.py")],
               env={**settings, "KILL": "1:2,2:6", "REBUILT": "6",
                    "PYTHONPATH": os.pathsep.join((SCRIPTS, ROOT))})
    try:
        port = str(job.scheduler_port())
        job.wait_for(r"killed server 1 at step 2", timeout=60)
        server = Proc([sys.executable, "-m", "kvstore.server"], env={
            **settings, "KVSTORE_ROLE": "server", "KVSTORE_RANK": "3", "KVSTORE_NUM_SERVERS": "3",
            "KVSTORE_NUM_WORKERS": "2", "KVSTORE_SCHEDULER_HOST": "127.0.0.1", "KVSTORE_SCHEDULER_PORT": port})
        assert job.wait(120) == 0, job.text + "\n--- server 3 ---\n" + server.text
        assert server.wait(60) == 0, server.text
    finally:
        job.stop()
    assert "joined as a replacement" in job.text and "[worker:0] replicas rebuilt" in job.text, job.text
    assert "killed server 2 at step 6" in job.text, job.text
    assert "server 3 serves server 1's chunks now" in server.text, server.text
    found = sorted(re.findall(r"\[worker:(\d)\] digest (\w+)", job.text))
    assert found == [("0", uninterrupted), ("1", uninterrupted)], job.text
