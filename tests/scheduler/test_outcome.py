"""Who the launcher's table marks as the root cause (tracker/outcome.py), from
what the processes and the scheduler reported; no processes are started."""

from dataclasses import dataclass

from tracker.outcome import conclude
from tracker.process import ProcSpec


@dataclass
class Ended:
    """A child-like record: its spec, pid and status (None: still running)."""
    spec: ProcSpec
    pid: int
    code: int | None

    def poll(self):
        return self.code


@dataclass
class Failed(Ended):
    """One that also said why: its last exception (or stopping line's reason)."""
    exception: str | None = None


def job(*codes):
    return [Ended(ProcSpec("worker", rank, ("x",)), 100 + rank, code) for rank, code in enumerate(codes)]


def marked(outcome):
    return [row[0] for row in outcome.rows if row[3] == "root cause"]


def test_every_worker_absent_from_a_timed_out_barrier_is_marked_not_the_waiter():
    children = job(1, None, 1, None)    # 0 and 2 waited and failed; 1 and 3 never came
    failure = ("worker 2 (pid 102 on h) failed: DeadlineError: worker 2: a barrier ('step 7') timed "
               "out after 10s: worker 1 (pid 101 on h), worker 3 (pid 103 on h) did not arrive "
               "(workers 0, 2 waited). A worker missing at a collective call failed before it or "
               "is stuck; raise KVSTORE_TIMEOUT if it is just slow")
    outcome = conclude(children, {"worker 0": 1, "worker 2": 1}, ("scheduler", 1), None, failure)
    assert marked(outcome) == ["worker 1", "worker 3"]
    assert outcome.returncode == 1
    assert outcome.root_cause.startswith("worker 1 and worker 3 did not arrive at a barrier in time; "
                                         "the scheduler reported: worker 2 (pid 102 on h) failed")


def test_a_failure_without_a_barrier_timeout_still_marks_the_node_it_is_about():
    children = job(None, None)
    failure = "worker 1 (pid 101 on h) sent no heartbeat for 2.0s; it is dead or stuck"
    outcome = conclude(children, {}, ("scheduler", 1), None, failure)
    assert marked(outcome) == ["worker 1"]
    assert outcome.root_cause == f"the scheduler aborted the job: {failure}"


def test_the_processes_that_never_registered_are_marked_when_registration_times_out():
    children = [Ended(ProcSpec("server", 0, ("x",)), 90, None)] + job(None, None, None)
    failure = ("registration did not complete within 20s (KVSTORE_TIMEOUT): 1 of 3 workers registered "
               "(missing ranks 1, 2); 1 of 1 servers registered")
    outcome = conclude(children, {}, ("scheduler", 1), None, failure)
    assert marked(outcome) == ["worker 1", "worker 2"]
    assert outcome.returncode == 1
    assert outcome.root_cause.startswith("worker 1 and worker 2 did not register with the scheduler in "
                                         "time; the scheduler reported: registration did not complete")
    none = failure.replace("1 of 1 servers registered", "0 of 1 servers registered")
    assert marked(conclude(children, {}, ("scheduler", 1), None, none)) == ["server 0", "worker 1", "worker 2"]


def test_the_exception_of_a_traceback_is_found_among_other_threads_log_lines():
    from tracker.wrapper import Exceptions
    seen = Exceptions()
    for line in ["starting", "Traceback (most recent call last):", '  File "x.py", line 2, in <module>',
                 "2026-12-07 05:28:56,243 [worker:0] ERROR a log line of another thread",
                 "[worker 0] job aborted: something", "    kvstore.create('dist_sync_cpu')",
                 "kvstore.errors.ConfigError: unknown store type 'dist_sync_cpu'", "after"]:
        seen.feed(line)
    assert seen.last == "kvstore.errors.ConfigError: unknown store type 'dist_sync_cpu'"
    for line in ["During handling of the above exception, another exception occurred:", "",
                 "Traceback (most recent call last):", '  File "y.py", line 1', "KeyboardInterrupt"]:
        seen.feed(line)
    assert seen.last == "KeyboardInterrupt"


def test_the_reason_a_server_logged_as_it_stopped_is_its_exception():
    """A server that stops for the job's reason (it lost the scheduler) logs
    tracker.wrapper.stopping()'s line, no traceback: the launcher says that reason
    with its exit, as it says a worker's exception."""
    import logging

    from tracker.wrapper import Exceptions, stopping
    record = logging.LogRecord("x", logging.ERROR, "node.py", 1, "%s",
                               (stopping("server", 2, "lost contact with the scheduler for 3s"),), None)
    line = logging.Formatter("%(asctime)s [server:2] %(levelname)s %(message)s").format(record)
    seen = Exceptions()
    for text in ["2026-12-07 23:25:09,760 [server:2] INFO server 2 serving on tcp://127.0.0.1:1", line,
                 "2026-12-07 23:25:12,900 [server:2] INFO server 2: closed"]:
        seen.feed(text)
    assert seen.last == "lost contact with the scheduler for 3s"
    child = Failed(ProcSpec("server", 2, ("x",)), 100, 1, seen.last)
    assert conclude([child], {"server 2": 1}, ("server 2", 1), None, None).root_cause == \
        "server 2 exited with status 1: lost contact with the scheduler for 3s"
    # a traceback after it is the later word; inside one, a quoted stopping line is not
    for text in ["Traceback (most recent call last):", "  server 1 stopping: quoted in a frame",
                 "ValueError: bad"]:
        seen.feed(text)
    assert seen.last == "ValueError: bad"


def test_of_workers_that_failed_alike_before_the_scheduler_heard_the_first_in_launch_order_is_marked():
    same = "kvstore.errors.ConfigError: unknown store type 'dist_sync_cpu'"
    children = [Failed(ProcSpec("worker", 0, ("x",)), 100, -15, same),     # stopped by the teardown
                Failed(ProcSpec("worker", 1, ("x",)), 101, 1, same),
                Failed(ProcSpec("worker", 2, ("x",)), 102, 1, same),
                Failed(ProcSpec("worker", 3, ("x",)), 103, 1, "ValueError: other")]
    for first in ("worker 2", "worker 1"):       # whichever the launcher's polling saw first
        outcome = conclude(children, {first: 1}, (first, 1), None, None)
        assert marked(outcome) == ["worker 1"]
        assert outcome.root_cause == f"worker 1 exited with status 1: {same}"
    outcome = conclude(children, {"worker 3": 1}, ("worker 3", 1), None, None)
    assert marked(outcome) == ["worker 3"]


def test_an_elastic_worker_that_failed_after_close_is_the_root_cause_of_a_job_that_went_on():
    children = job(0, 3, 0)
    outcome = conclude(children, {"worker 0": 0, "worker 1": 3, "worker 2": 0}, None, None, None,
                       late=[("worker 1", 3)])
    assert marked(outcome) == ["worker 1"] and outcome.returncode == 3
    assert outcome.root_cause == ("worker 1 exited with status 3 after it finished its part (called close()); "
                                  "the elastic job went on without it")
    assert conclude(children, {"worker 1": 3}, ("worker 1", 3), None, None,
                    late=[("worker 1", 3)]).root_cause == "worker 1 exited with status 3"   # a failure first
