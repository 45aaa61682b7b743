"""Elastic workers, end to end (docs/elastic.md): real launchers, servers and
worker processes (tests/scripts/elastic_worker.py) over loopback.

A worker killed mid-run leaves the job: in dist_sync the round it had not pushed
to completes with the others' pushes (exact sums, per key), in dist_async its
applied pushes stay; a worker that joins (started by hand, or by the launcher in
place of a lost one) meets the others at a barrier and pulls exactly their
weights; below the minimum the job fails fast naming who left; the default stays
fail-fast and the launchers check their flags."""

from __future__ import annotations

import os
import re
import sys
import time

import pytest

from services import FAST_FAILURE, ROOT, SCRIPTS, Proc, python_launcher

WORKER = os.path.join(SCRIPTS, "elastic_worker.py")
ENV = {**FAST_FAILURE, "KVSTORE_CHUNK_BYTES": "4096", "KVSTORE_TIMEOUT": "60"}

pytestmark = pytest.mark.timeout(180)


def launch(*args, env=None) -> Proc:
    """tracker.local with the launcher options before ``--`` and the worker's after it."""
    cut = args.index("--")
    return python_launcher("tracker.local", *args[:cut], "python", WORKER, *args[cut + 1:],
                           env={**ENV, **(env or {})})


def values(text: str, worker: int, key: str) -> list[float]:
    return [float(v) for v in re.findall(rf"\[worker:{worker}\] worker {worker} step \d+ {key} (\S+)", text)]


def test_a_killed_worker_leaves_and_the_rounds_complete_with_the_others():
    job = launch("-n", "3", "-s", "2", "--elastic", "2:3", "--", "sums", "--steps", "6",
                 "--die", "2", "--die-at", "2")
    assert job.wait(120) == 0, job.text
    # workers push rank + 1: 1 + 2 + 3 = 6 while worker 2 is in, 1 + 2 = 3 after;
    # at step 2 worker 2 pushed 'a' and died before 'b': that round of 'a' holds
    # its push (none lost), that of 'b' completes without it (none counted twice)
    for worker in (0, 1):
        assert values(job.text, worker, "a") == [6, 6, 6, 3, 3, 3], job.text
        assert values(job.text, worker, "b") == [6, 6, 3, 3, 3, 3], job.text
    assert values(job.text, 2, "a") == [6, 6, 6]
    assert re.search(r"worker 2 \(pid \d+ on [^)]*\) left the job: was killed by SIGKILL; 2 workers remain",
                     job.text), job.text
    assert "job finished" in job.text


def test_async_keeps_the_pushes_of_a_worker_that_left():
    job = launch("-n", "3", "-s", "2", "--elastic", "2:3", "--", "async", "--steps", "8",
                 "--die", "2", "--die-at", "3")
    assert job.wait(120) == 0, job.text
    # sgd with learning rate 1 subtracts each push of ones: 8 + 8 from workers 0
    # and 1, and the 3 that worker 2 made before it died
    for worker in (0, 1):
        assert f"worker {worker} final -19 members [0, 1]" in job.text, job.text


def test_a_worker_started_by_hand_joins_with_the_others_weights():
    secret = os.urandom(16).hex()
    job = launch("-n", "2", "-s", "2", "--elastic", "2:3", "--", "train", "--steps", "16", "--every", "4",
                 "--members", "3", env={"KVSTORE_SECRET": secret})
    try:
        port = job.scheduler_port()
        job.wait_for(r"worker 0 started, joined=False", timeout=60)   # the job formed: now one joins
        joiner = Proc([sys.executable, WORKER, "train", "--steps", "16", "--every", "4"], env={
            **ENV, "KVSTORE_ROLE": "worker", "KVSTORE_SCHEDULER_HOST": "127.0.0.1",
            "KVSTORE_SCHEDULER_PORT": str(port), "KVSTORE_NUM_WORKERS": "2", "KVSTORE_NUM_SERVERS": "2",
            "KVSTORE_SECRET": secret}, cwd=ROOT)
        assert joiner.wait(120) == 0, joiner.text + "\n--- job ---\n" + job.text
        assert job.wait(60) == 0, job.text
    finally:
        job.stop()
    joined = re.search(r"worker 2 joined step (\d+) members \[0, 1, 2\] weights (\w+)", joiner.text)
    assert joined, joiner.text
    step, weights = joined.groups()
    for worker in (0, 1):
        assert f"worker {worker} barrier step {step} members [0, 1, 2] weights {weights}" in job.text, job.text
    assert "worker 2 done members [0, 1, 2]" in joiner.text


def test_the_launcher_replaces_a_lost_worker():
    job = launch("-n", "2", "-s", "1", "--elastic", "1:2", "--max-restarts", "1", "--", "train",
                 "--steps", "16", "--every", "4", "--members", "2", "--die", "1", "--die-at", "5")
    assert job.wait(120) == 0, job.text
    assert "started worker 1 #1 in place of worker 1" in job.text
    joined = re.search(r"worker 1 joined step (\d+) members \[0, 1\] weights (\w+)", job.text)
    assert joined, job.text
    step, weights = joined.groups()
    assert int(step) >= 8
    assert f"worker 0 barrier step {step} members [0, 1] weights {weights}" in job.text, job.text
    assert "worker 1 done members [0, 1]" in job.text


def test_a_worker_that_fails_after_close_is_not_replaced_and_its_status_ends_the_job():
    """Worker 1 closes its store at step 2 and exits with status 3: it finished its
    part, so nothing replaces it (--max-restarts 1 is not used) and worker 0 trains
    on alone to the end; the job's status is worker 1's, naming it."""
    job = launch("-n", "2", "-s", "1", "--elastic", "1:2", "--max-restarts", "1", "--", "sums",
                 "--steps", "8", "--die", "1", "--die-at", "2", "--close-then-fail")
    assert job.wait(120) == 3, job.text
    assert values(job.text, 0, "a") == [3, 3, 3] + [1] * 5, job.text     # on alone after step 2
    assert "worker 1 exited with status 3 after it finished (called close()): not replaced" in job.text
    assert "in place of worker 1" not in job.text, job.text
    assert re.search(r"job failed: worker 1 exited with status 3 after it finished its part", job.text), job.text
    assert re.search(r"worker 1 +\d+ +exited with status 3 +<- root cause", job.text), job.text


def test_below_the_minimum_the_job_fails_fast_naming_who_left():
    started = time.monotonic()
    job = launch("-n", "2", "-s", "1", "--elastic", "2:2", "--", "sums", "--steps", "50",
                 "--die", "1", "--die-at", "1")
    code = job.wait(60)
    assert code != 0, job.text
    assert time.monotonic() - started < 45
    assert re.search(r"worker 1 \(pid \d+ on [^)]*\) was killed by SIGKILL.*1 worker remains?, fewer than "
                     r"the elastic minimum 2", job.text), job.text


def test_without_elastic_a_lost_worker_still_ends_the_job():
    job = launch("-n", "2", "-s", "1", "--", "sums", "--steps", "50", "--die", "1", "--die-at", "1")
    assert job.wait(60) != 0, job.text
    assert re.search(r"worker 1 +\d+ +was killed by SIGKILL +<- root cause", job.text), job.text


@pytest.mark.parametrize("args, message", [
    (["-n", "5", "--elastic", "1:4"], "-n 5 is outside --elastic 1:4"),
    (["-n", "2", "--elastic", "3:2"], "KVSTORE_ELASTIC"),
    (["-n", "2", "--elastic", "two"], "KVSTORE_ELASTIC"),
])
def test_the_launchers_check_the_elastic_flags(args, message):
    job = python_launcher("tracker.local", *args, "--dry-run", "python", WORKER, "sums")
    assert job.wait(30) == 2, job.text
    assert message in job.text, job.text


def test_mpirun_refuses_elastic_jobs():
    job = python_launcher("tracker.mpi", "-n", "1", "-s", "1", "--dry-run", "python", WORKER, "sums",
                          env={"KVSTORE_ELASTIC": "1:2"})
    assert job.wait(30) == 2, job.text
    assert "ends every process when one fails" in job.text, job.text


@pytest.mark.slow
def test_over_ssh_a_killed_worker_is_replaced_on_its_host(sshd):
    hosts = sshd.hostfile("# two loopback hosts", "127.0.0.2:{port}", "127.0.0.3:{port}")
    job = python_launcher("tracker.ssh", "-F", sshd.client_config, "--env", "KVSTORE_TEST_TAG",
                          "--env", "PYTHONUNBUFFERED", "--env", "KVSTORE_CHUNK_BYTES",
                          "-n", "2", "-s", "2", "-H", hosts, "--elastic", "1:2", "--max-restarts", "1",
                          "python", WORKER, "train", "--steps", "16", "--every", "4", "--members", "2",
                          "--die", "1", "--die-at", "5", env=ENV)
    assert job.wait(150) == 0, job.text
    port = sshd.port
    joined = re.search(rf"\[worker:1@127\.0\.0\.3:{port}\] worker 1 joined step (\d+) members \[0, 1\] "
                       r"weights (\w+)", job.text)
    assert joined, job.text
    step, weights = joined.groups()
    assert f"worker 0 barrier step {step} members [0, 1] weights {weights}" in job.text, job.text
    assert "started worker 1 #1 in place of worker 1" in job.text
