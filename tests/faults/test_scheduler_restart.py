"""The scheduler's death (docs/reliability.md, docs/architecture.md §8.2): real jobs
through ``python -m tracker.local -n 2`` running tests/scripts/replicated.py
(dist_sync, keys cut over every server, SGD with momentum on the servers,
deterministic sums, a kv.barrier() at the end of every step).

Worker 0 sends the job's scheduler SIGKILL mid-training, right before a barrier
(the other worker usually waits there already) and right after a push (rounds
open): the launcher restarts it on the same port, every process registers again,
the job goes on and ends with exit 0 and the uninterrupted run's weights bit for
bit. With KVSTORE_REPLICAS=1 the servers' book survives the restart: a server
killed before it stays failed over, and one killed after it is failed over
too, and a replacement server (--restart-servers) that joined before the restart
registers again, keeps its rebuilt replicas and takes over at the next death.
A stopped scheduler (SIGSTOP: it answers no ping) is killed and restarted the
same way; one that does not come back (KVSTORE_SCHEDULER_RESTART_TIMEOUT=0: nobody
waits for it) ends the job after KVSTORE_HEARTBEAT_TIMEOUT, naming it."""

from __future__ import annotations

import os
import re
import sys

import pytest

from test_replicated_servers import SCRIPT, digests, run

BASE = {"BARRIER": "1"}


@pytest.fixture(scope="module")
def uninterrupted() -> str:
    """The final weights of the job without a fault (barriers change nothing)."""
    out = run(**BASE)
    assert out.returncode == 0, out.stdout + out.stderr
    first, second = digests(out)
    assert first == second
    return first


def restarts(log: str) -> list[str]:
    return re.findall(r"the scheduler \(pid \d+\) was killed by SIGKILL: restarting it on 127\.0\.0\.1:(\d+)", log)


def test_a_scheduler_killed_mid_training_leaves_the_uninterrupted_weights(uninterrupted, tmp_path):
    """Killed twice (before a barrier; after a push), with a checkpoint saved between
    the two (a save is two barriers): both times restarted on its port, the job
    rebuilt from the five registrations, exit 0, the uninterrupted weights."""
    out = run(**BASE, KILL_SCHEDULER="3:barrier,6:push", SAVE="4", KVSTORE_CHECKPOINT_DIR=str(tmp_path))
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert "killed the scheduler" in out.stdout and "at step 3 (barrier)" in out.stdout, log
    assert "at step 6 (push)" in out.stdout, log
    ports = restarts(log)
    assert len(ports) == 2 and len(set(ports)) == 1, log          # the same port both times
    assert log.count("the restarted scheduler rebuilt the job from 5 registrations") == 2, log
    assert digests(out) == [uninterrupted, uninterrupted], log
    assert sorted(os.listdir(tmp_path)) == [f"server-{r}.ckpt" for r in range(3)]


def test_with_replicas_the_servers_book_survives_the_restart(uninterrupted):
    """KVSTORE_REPLICAS=1, 4 servers: server 0 killed at step 2 (book epoch 1), the
    scheduler killed at steps 4 and 6, server 2 killed at step 8: the restarted
    scheduler does not wait for server 0, and fails server 2 over to epoch 2."""
    out = run(**BASE, servers=4, KVSTORE_REPLICAS="1", KILL="0:2,2:8", KILL_SCHEDULER="4:push,6:barrier")
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert len(restarts(log)) == 2, log
    assert log.count("rebuilt the job from 5 registrations (servers' book epoch 1,") == 2, log
    assert "was killed by SIGKILL: its chunks are served by their backups (servers' book epoch 2: " \
           "owners [1, 1, 3, 3])" in log, log
    assert digests(out) == [uninterrupted, uninterrupted], log


def test_a_replacement_server_and_its_rebuilt_replicas_survive_the_restart(uninterrupted):
    """KVSTORE_REPLICAS=1, --restart-servers 1, 3 servers: server 1 killed at step 2,
    replacement server 3 joins and both its replicas are rebuilt (worker 0 waits for
    that book at step 4), then the scheduler is killed (step 4): the restarted one
    waits for server 3 too (5 registrations) and restores the book at its epoch 4;
    server 2 killed at step 8 is failed over onto the rebuilt replica (server 3 serves
    server 1's share now). Exit 0, the uninterrupted weights."""
    out = run("--restart-servers", "1", sys.executable, SCRIPT, **BASE, KVSTORE_REPLICAS="1", KILL="1:2,2:8",
              KILL_SCHEDULER="4:push", REBUILT="4", timeout=150)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert "started server 3 in place of server 1" in log and "joined as a replacement" in log, log
    assert len(restarts(log)) == 1, log
    assert "[worker:0] replicas rebuilt: servers' book epoch 4" in out.stdout, log
    # server 3 registered again too, and the book came back whole (epoch 4: no share rebuilding)
    assert "the restarted scheduler rebuilt the job from 5 registrations (servers' book epoch 4," in log, log
    assert "servers' book epoch 5: owners [0, 3, 0]" in log, log
    assert digests(out) == [uninterrupted, uninterrupted], log


def test_a_stopped_scheduler_is_killed_and_restarted_and_the_job_goes_on(uninterrupted):
    """The scheduler stopped (SIGSTOP: alive, so no death for the launcher to see)
    answers no ping for KVSTORE_HEARTBEAT_TIMEOUT (2 s): the launcher kills it and
    starts it again on its port, within the KVSTORE_SCHEDULER_RESTART_TIMEOUT (10 s)
    the processes wait for it; the job ends with exit 0 and the uninterrupted
    weights (it used to end: nothing restarted a scheduler that hangs)."""
    out = run(**BASE, KILL_SCHEDULER="3:barrier", KILL_SCHEDULER_SIGNAL="SIGSTOP", KVSTORE_HEARTBEAT_TIMEOUT="2")
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    pid = int(re.search(r"killed the scheduler \(pid (\d+)\)", out.stdout)[1])
    assert re.search(rf"the scheduler \(pid {pid}\) answered no ping for [\d.]+s \(KVSTORE_HEARTBEAT_TIMEOUT\): "
                     r"stopped or stuck; killing it to start it again", log), log
    assert len(restarts(log)) == 1, log
    assert "the restarted scheduler rebuilt the job from 5 registrations" in log, log
    assert digests(out) == [uninterrupted, uninterrupted], log
    assert not os.path.exists(f"/proc/{pid}"), f"the stopped scheduler {pid} still runs"


def test_a_scheduler_that_does_not_come_back_ends_the_job_naming_it():
    """With KVSTORE_SCHEDULER_RESTART_TIMEOUT=0 no process waits for a restart (nor
    does the launcher restart a stopped scheduler): every process stops
    KVSTORE_HEARTBEAT_TIMEOUT (2 s) after it lost the scheduler, and the job ends
    naming it; nothing is left running. Whichever process gave up first is the
    root cause, and the reason it gave is said with it: a worker's exception, or
    the line a server logged as it stopped (it used to say only "server 0 exited
    with status 1", once, in CI)."""
    out = run(**BASE, KILL_SCHEDULER="3:barrier", KILL_SCHEDULER_SIGNAL="SIGSTOP",
              KVSTORE_HEARTBEAT_TIMEOUT="2", KVSTORE_SCHEDULER_RESTART_TIMEOUT="0")
    log = out.stdout + out.stderr
    assert out.returncode == 1, log
    assert re.search(r"job failed: (worker|server) \d exited with status 1: .*lost contact with the scheduler at "
                     r"127\.0\.0\.1:\d+ for 2s \(KVSTORE_HEARTBEAT_TIMEOUT\)", log), log
    assert "digest" not in out.stdout and not restarts(log), log
    pid = int(re.search(r"killed the scheduler \(pid (\d+)\)", out.stdout)[1])
    assert not os.path.exists(f"/proc/{pid}"), f"the stopped scheduler {pid} still runs"
