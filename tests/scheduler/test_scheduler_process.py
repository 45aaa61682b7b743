"""The launcher's scheduler process (tracker/scheduler_process.py) over its real
pipes: what it says of the exits the launcher tells it, which the launcher judges
a failed exit by (tracker/launcher.py): whether the job had failed before the exit
(then the exit is a consequence, not the cause), and whether a worker had called
close() first."""

from __future__ import annotations

import os
import signal

import pytest

from tracker.control.env import Settings
from tracker.control.security import new_secret
from tracker.scheduler_process import SchedulerProcess
from services import eventually_empty

pytestmark = pytest.mark.timeout(60)


def started(sched: SchedulerProcess, count: int, timeout: float = 30.0) -> bool:
    """Whether ``count`` scheduler processes were started (the first and its restarts)
    within ``timeout`` seconds."""
    return not eventually_empty(lambda: [] if len(sched.pids) >= count else ["waiting"], timeout)


@pytest.fixture
def scheduler():
    sched = SchedulerProcess(Settings(heartbeat_interval=0.2, heartbeat_timeout=5.0, timeout=30.0), 2, 1,
                             host="127.0.0.1", secret=new_secret()).start()
    yield sched
    sched.close()


def test_an_exit_after_the_jobs_failure_is_said_to_come_after_it(scheduler):
    """The job fails (here: the launcher aborts it), then a process exits: the
    scheduler says it had heard no exit when the job failed, so exit 1 came after."""
    assert scheduler.heard.exits == 0 and scheduler.heard.failed_after is None
    scheduler.abort("worker 1 failed: RuntimeError: boom")
    told = scheduler.node_exited("worker", 0, 1)
    assert told == 1
    assert scheduler.wait_heard(told, 10.0)
    assert scheduler.heard.exits >= 1 and scheduler.heard.failed_after == 0
    assert scheduler.failure is not None and "boom" in scheduler.failure


def test_an_exit_that_fails_the_job_is_said_to_be_its_cause(scheduler):
    """A process exits with status 1 before the job formed (nothing failed before):
    the scheduler fails the job at that exit, and says it had heard it."""
    told = scheduler.node_exited("server", 0, 1)
    assert scheduler.wait_heard(told, 10.0)
    assert scheduler.heard.failed_after == told and "server 0" in (scheduler.failure or "")


def test_a_scheduler_that_cannot_come_back_wakes_who_waits_on_its_word(scheduler, monkeypatch):
    """The scheduler dies with no restart left: the job ends with a failure naming it,
    and a launcher waiting on its word of an exit hears that now, not at its own
    timeout (which here is longer than the test's deadline)."""
    from tracker import scheduler_process
    monkeypatch.setattr(scheduler_process, "MAX_RESTARTS", 0)
    told = scheduler.node_exited("worker", 0, 0)
    os.kill(scheduler.pids[-1], signal.SIGKILL)
    assert scheduler.wait_heard(told + 1, 600.0)     # an exit it will never hear: the end wakes it
    assert scheduler.done and "after 0 restarts within 600s: the job ends" in (scheduler.failure or "")
    assert "killed by SIGKILL" in scheduler.failure


def test_a_stopped_scheduler_is_killed_and_started_again():
    """The scheduler stops answering (SIGSTOP: alive, so no death to see): it answered
    no ping for the heartbeat timeout, so it is killed and started again on its
    port, and the new one hears the launcher (an exit told after the restart)."""
    sched = SchedulerProcess(Settings(heartbeat_interval=0.1, heartbeat_timeout=1.0, timeout=30.0,
                                      scheduler_restart_timeout=5.0), 2, 1,
                             host="127.0.0.1", secret=new_secret()).start()
    try:
        first, port = sched.pids[0], sched.port
        os.kill(first, signal.SIGSTOP)
        assert started(sched, 2)        # a restart is the heartbeat timeout plus a start
        assert sched.restarts == 1 and len(sched.pids) == 2 and sched.port == port
        assert not os.path.exists(f"/proc/{first}") or open(f"/proc/{first}/stat").read().split()[2] == "Z"
        told = sched.node_exited("server", 0, 1)
        assert sched.wait_heard(told, 10.0) and sched.heard.exits == 1
    finally:
        sched.close()


def test_with_no_restart_to_wait_for_a_stopped_scheduler_is_left_to_the_nodes(scheduler):
    """KVSTORE_SCHEDULER_RESTART_TIMEOUT=0: no node waits for a restart, so nothing
    pings the scheduler (the nodes stop at their heartbeat timeout, naming it)."""
    import threading
    sched = SchedulerProcess(Settings(heartbeat_interval=0.1, heartbeat_timeout=1.0, timeout=30.0,
                                      scheduler_restart_timeout=0.0), 2, 1,
                             host="127.0.0.1", secret=new_secret()).start()
    try:
        watching = {t.name for t in threading.enumerate() if t.name.startswith("kvstore-scheduler-watch-")}
        assert f"kvstore-scheduler-watch-{scheduler.job}" in watching       # the fixture's (the default: 10 s)
        assert f"kvstore-scheduler-watch-{sched.job}" not in watching
    finally:
        sched.close()


@pytest.mark.parametrize("window, ends", [(600.0, True), (0.0, False)])
def test_restarts_count_against_the_limit_only_within_the_window(scheduler, monkeypatch, window, ends):
    """One restart allowed per window: a second death within it ends the job (a crash
    loop); with the first restart already outside the window (here: a window of 0 s)
    the scheduler is started again, as a week-long job's occasional deaths are."""
    from tracker import scheduler_process
    monkeypatch.setattr(scheduler_process, "MAX_RESTARTS", 1)
    monkeypatch.setattr(scheduler_process, "RESTART_WINDOW", window)
    os.kill(scheduler.pids[-1], signal.SIGKILL)
    assert started(scheduler, 2)
    told = scheduler.node_exited("worker", 0, 0)
    assert scheduler.wait_heard(told, 10.0)       # the first restart serves
    os.kill(scheduler.pids[-1], signal.SIGKILL)
    if ends:
        assert scheduler.wait_heard(told + 1, 600.0) and scheduler.done
        assert "after 1 restart within 600s: the job ends" in (scheduler.failure or "")
    else:
        assert started(scheduler, 3)
        assert scheduler.restarts == 2 and not scheduler.done
        told = scheduler.node_exited("worker", 1, 0)
        assert scheduler.wait_heard(told, 10.0)
