"""Real multi-process jobs through `python -m tracker.local` (and processes
started by hand, as another launcher would): formulas, failures, teardown."""

import os
import re
import signal
import socket
import sys
import uuid

import pytest

from services import FAST_FAILURE, Proc, alive, eventually_empty, run_with_output_closed, tagged

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.slow


def launch(*args, env=None):
    return Proc([sys.executable, "-m", "tracker.local", *args], env=env)


leftovers = tagged


def assert_no_leftovers(proc):
    assert leftovers(proc.tag) == [], f"processes left behind; output:\n{proc.text}"


@pytest.mark.parametrize("workers, servers, keys", [
    (1, 1, "int"), (2, 3, "str"), (3, 2, "int"), (4, 3, "str"),
])
def test_dist_sync_job_matches_formulas(workers, servers, keys):
    p = launch("-n", str(workers), "-s", str(servers), sys.executable,
               os.path.join(SCRIPTS, "formulas.py"), "--keys", keys)
    assert p.wait(120) == 0, p.text
    for rank in range(workers):
        assert f"[worker:{rank}] OK rank {rank} of {workers}" in p.text
    assert_no_leftovers(p)


def test_dist_async_job_matches_formulas():
    p = launch("-n", "3", "-s", "2", sys.executable, os.path.join(SCRIPTS, "formulas.py"),
               "--store", "dist_async")
    assert p.wait(120) == 0, p.text
    assert p.text.count("OK rank") == 3


@pytest.mark.parametrize("mode, culprit, code", [
    ("exit", "worker 1 exited with status 3", 3),
    ("sigkill", "worker 1 was killed by SIGKILL", 128 + 9),
])
def test_failing_worker_stops_the_job(mode, culprit, code):
    p = launch("-n", "3", "-s", "2", sys.executable, os.path.join(SCRIPTS, "faulty.py"), mode,
               env=FAST_FAILURE)
    assert p.wait(60) == code, p.text
    assert f"job failed: {culprit}" in p.text
    assert re.search(r"worker 1 +\d+ .*<- root cause", p.text)
    assert_no_leftovers(p)


def test_killed_server_stops_the_job():
    p = launch("-n", "2", "-s", "2", sys.executable, os.path.join(SCRIPTS, "faulty.py"), "loop",
               env=FAST_FAILURE)
    p.wait_for(r"ready rank", count=2)
    pid = int(re.search(r"server 1 \(pid (\d+)\)", p.text).group(1))
    os.kill(pid, signal.SIGKILL)
    assert p.wait(60) == 128 + 9, p.text
    assert "job failed: server 1 was killed by SIGKILL" in p.text
    assert_no_leftovers(p)


def test_stuck_server_is_detected_by_heartbeats():
    p = launch("-n", "2", "-s", "1", sys.executable, os.path.join(SCRIPTS, "faulty.py"), "loop",
               env=FAST_FAILURE)
    p.wait_for(r"ready rank", count=2)
    p.wait_for(r"server 0 \(pid \d+\)")     # (its own line: under load it may come after the workers')
    pid = int(re.search(r"server 0 \(pid (\d+)\)", p.text).group(1))
    os.kill(pid, signal.SIGSTOP)    # alive but silent
    assert p.wait(60) != 0, p.text
    assert re.search(r"server 0 \(pid \d+ on 127.0.0.1\) sent no heartbeat", p.text), p.text
    assert_no_leftovers(p)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_launcher_ends_every_process(sig):
    p = launch("-n", "2", "-s", "2", sys.executable, os.path.join(SCRIPTS, "faulty.py"), "loop")
    p.wait_for(r"ready rank", count=2)
    p.popen.send_signal(sig)
    assert p.wait(30) == 128 + sig, p.text
    assert f"interrupted by {signal.Signals(sig).name}" in p.text
    assert_no_leftovers(p)


@pytest.mark.parametrize("args, message", [
    ([], "Missing"),
    (["-n", "0", "python", "x.py"], "-n"),
    (["-n", "2"], "Missing argument"),
    (["-n", "2", "--bogus", "python", "x.py"], "--bogus"),
    (["-n", "1", "--env", "NOEQUALS", "python", "x.py"], "NAME=VALUE"),
])
def test_bad_command_lines_fail_before_starting_anything(args, message):
    p = launch(*args)
    assert p.wait(30) == 2, p.text
    assert message in p.text
    assert "scheduler listening" not in p.text


def test_missing_program_is_reported():
    p = launch("-n", "1", "-s", "1", "/nonexistent/program")
    assert p.wait(30) == 127, p.text
    assert "could not start worker 0" in p.text
    assert_no_leftovers(p)


def test_dry_run_prints_the_plan():
    p = launch("-n", "2", "-s", "1", "--dry-run", "python", "train.py")
    assert p.wait(30) == 0, p.text
    assert "server 0:" in p.text and "worker 1: python train.py" in p.text
    assert "scheduler listening" not in p.text


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dmlc_env(role, port, workers=2, servers=1):
    return {"DMLC_ROLE": role, "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port),
            "DMLC_NUM_WORKER": str(workers), "DMLC_NUM_SERVER": str(servers), **FAST_FAILURE}


def test_mxnet_style_job_where_every_process_runs_the_script():
    """DMLC_* variables only, no ranks, each role running the same script (as with
    MXNet's launchers): create() turns scheduler and server processes into their role."""
    port, tag = _free_port(), uuid.uuid4().hex
    script = [sys.executable, os.path.join(SCRIPTS, "formulas.py")]
    procs = [Proc(script, _dmlc_env(role, port), tag)
             for role in ("scheduler", "server", "worker", "worker")]
    codes = [p.wait(120) for p in procs]
    assert codes == [0, 0, 0, 0], "\n---\n".join(p.text for p in procs)
    assert sorted(p.text.strip() for p in procs[2:]) == ["OK rank 0 of 2", "OK rank 1 of 2"]
    assert leftovers(tag) == []


def test_without_launcher_a_dead_server_is_found_by_heartbeats():
    """Nobody watches the processes: the scheduler's heartbeats must stop the workers."""
    port, tag = _free_port(), uuid.uuid4().hex
    scheduler = Proc([sys.executable, "-m", "tracker.scheduler"], _dmlc_env("scheduler", port), tag)
    server = Proc([sys.executable, "-m", "kvstore.server"], _dmlc_env("server", port), tag)
    workers = [Proc([sys.executable, os.path.join(SCRIPTS, "faulty.py"), "loop"],
                    _dmlc_env("worker", port), tag) for _ in range(2)]
    for w in workers:
        w.wait_for("ready rank")
    server.popen.kill()
    for w in workers:
        assert w.wait(30) != 0, w.text
        assert re.search(r"server 0 \(pid \d+ on 127.0.0.1\) sent no heartbeat", w.text), w.text
    assert scheduler.wait(30) == 1, scheduler.text
    server.wait(5)
    assert leftovers(tag) == []


def test_a_hand_started_job_without_its_server_says_so_within_seconds_and_forms_when_it_comes():
    """Scheduler and workers started by hand, the server forgotten: within
    FORMING_NOTICE (10 s), not KVSTORE_TIMEOUT (300 s), the scheduler and every
    waiting worker say who is missing and which settings count them; a server
    started after that still forms the job, which succeeds."""
    port, tag = _free_port(), uuid.uuid4().hex
    scheduler = Proc([sys.executable, "-m", "tracker.scheduler"], _dmlc_env("scheduler", port), tag)
    script = [sys.executable, os.path.join(SCRIPTS, "formulas.py")]
    workers = [Proc(script, _dmlc_env("worker", port), tag) for _ in range(2)]
    said = ("the job has not formed {}s after the scheduler started: 2 of 2 workers registered; "
            "0 of 1 servers registered. Start the missing processes")
    for w in workers:
        w.wait_for(re.escape(said).replace(re.escape("{}"), r"\d+"), timeout=40)
        assert "DMLC_NUM_SERVER" in w.text and "(KVSTORE_TIMEOUT)" in w.text, w.text
    scheduler.wait_for(re.escape(said).replace(re.escape("{}"), r"\d+"), timeout=10)
    server = Proc([sys.executable, "-m", "kvstore.server"], _dmlc_env("server", port), tag)
    codes = [p.wait(120) for p in (*workers, server, scheduler)]
    assert codes == [0, 0, 0, 0], "\n---\n".join(p.text for p in (*workers, server, scheduler))
    assert leftovers(tag) == []


# -- teardown, output and reporting (docs/launching.md, "Failure handling") ----------

CASES = os.path.join(SCRIPTS, "launcher_cases.py")


def test_a_closed_output_pipe_does_not_hang_the_job():
    """`python -m tracker.local ... | head -1`: the launcher keeps draining the
    children's output after its reader went away, and the job ends normally
    with the job's status (0), not a BrokenPipeError."""
    tag = uuid.uuid4().hex
    first, code, errors = run_with_output_closed(
        [sys.executable, "-m", "tracker.local", "-n", "2", "-s", "1", sys.executable, CASES, "chatty"],
        {**os.environ, **FAST_FAILURE, "KVSTORE_TEST_TAG": tag, "PYTHONPATH": ROOT}, 90)
    assert first.startswith("["), first
    assert code == 0, errors
    assert "BrokenPipe" not in errors and "Traceback" not in errors, errors
    assert re.search(r"job finished: 2 workers, 1 server, [\d.]+ s, exit 0", errors), errors
    assert leftovers(tag) == []


def test_a_second_signal_during_the_teardown_kills_at_once():
    """A worker that ignores SIGTERM would hold the teardown for --kill-grace
    (here 300 s): a second signal must skip the rest of it (SIGKILL now)."""
    p = launch("-n", "1", "-s", "1", "--kill-grace", "300", sys.executable, CASES, "ignore-term")
    p.wait_for("ready")
    p.popen.send_signal(signal.SIGTERM)
    p.wait_for("launcher got SIGTERM: stopping every process")
    p.popen.send_signal(signal.SIGINT)
    assert p.wait(60) == 128 + signal.SIGTERM, p.text
    assert "killing every process now (SIGKILL)" in p.text
    assert "interrupted by SIGTERM" in p.text
    assert "Traceback" not in p.text, p.text
    assert_no_leftovers(p)


def test_sighup_to_the_launcher_ends_every_process():
    """Closing the terminal (SIGHUP) tears the job down like SIGTERM."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)   # the launcher inherits it
    try:
        p = launch("-n", "2", "-s", "2", sys.executable, os.path.join(SCRIPTS, "faulty.py"), "loop")
    finally:
        signal.signal(signal.SIGHUP, previous)
    p.wait_for(r"ready rank", count=2)
    p.popen.send_signal(signal.SIGHUP)
    assert p.wait(30) == 128 + signal.SIGHUP, p.text
    assert "interrupted by SIGHUP" in p.text
    assert_no_leftovers(p)


@pytest.mark.parametrize("mode, status", [
    ("grandchild-group", "ok"), ("grandchild-session", "ok"), ("grandchild-session", "fail"),
])
def test_grandchildren_of_processes_that_exited_are_killed_at_the_end(mode, status):
    """Each worker leaves a grandchild behind (in its process group, or in another
    group of its session) and exits: the launcher ends them all, whether the job
    succeeded or failed."""
    p = launch("-n", "2", "-s", "1", sys.executable, CASES, mode, status, env=FAST_FAILURE)
    assert p.wait(60) == (0 if status == "ok" else 3), p.text
    assert p.text.count("ready") == 2, p.text
    assert_no_leftovers(p)


@pytest.mark.parametrize("status, code", [("ok", 0), ("fail", 3), ("hang", 3)])
def test_grandchildren_that_leave_the_session_are_killed_too(status, code):
    """A grandchild that calls setsid() leaves its parent's session and process
    group. The launcher (a child subreaper) still finds it below itself: after its
    worker exited (ok, fail: the orphan was re-parented to the launcher) or below a
    worker the teardown stops (hang). A process outside the launcher's tree, started
    before and still running after the job, is left alone."""
    outsider = Proc([sys.executable, "-c", "import signal; print('outsider', flush=True); signal.pause()"])
    try:
        outsider.wait_for("outsider")
        p = launch("-n", "2", "-s", "1", sys.executable, CASES, "grandchild-setsid", status,
                   env=FAST_FAILURE)
        assert p.wait(60) == code, p.text
        grandchildren = [int(pid) for pid in re.findall(r"grandchild (\d+) ready", p.text)]
        assert len(grandchildren) == 2, p.text
        assert eventually_empty(lambda: [pid for pid in grandchildren if alive(pid)]) == [], p.text
        assert_no_leftovers(p)
        assert outsider.popen.poll() is None, "the launcher killed a process that is not its own"
    finally:
        outsider.popen.kill()
        outsider.wait(10)


@pytest.mark.parametrize("mode", ["systemexit", "exception"])
def test_the_culprit_is_marked_in_every_failure_mode(mode):
    """Worker 1 ends by SystemExit(1) or an uncaught exception while worker 0
    waits at a barrier: worker 1 is the root cause, with the status it exited
    with, never as a process the teardown killed."""
    p = launch("-n", "2", "-s", "1", sys.executable, CASES, mode, env=FAST_FAILURE)
    assert p.wait(60) == 1, p.text
    row = re.search(r"^worker 1 +\d+  (.*)$", p.text, re.M)
    assert row and row.group(1) == "exited with status 1  <- root cause", p.text
    assert p.text.count("<- root cause") == 1, p.text
    if mode == "exception":
        assert "RuntimeError: boom in worker 1" in p.text.split("job failed:")[1]
    assert_no_leftovers(p)


def test_a_worker_that_fails_before_registering_has_its_exception_in_the_summary():
    """create() with a bad store type fails before the worker registers, so the
    scheduler has no report of it: the summary quotes the exception's last line
    from the worker's output, not only its exit status."""
    p = launch("-n", "2", "-s", "1", sys.executable, "-c", "import kvstore; kvstore.create('dist_sync_cpu')",
               env=FAST_FAILURE)
    assert p.wait(60) == 1, p.text
    cause = p.text.split("job failed:")[1].splitlines()[0]
    assert re.fullmatch(r" worker [01] exited with status 1: kvstore\.errors\.ConfigError: unknown store "
                        r"type 'dist_sync_cpu'; valid types: .*", cause), p.text
    assert_no_leftovers(p)


@pytest.mark.parametrize("mode, workers, blamed, error", [
    ("init", 3, 0, "workers disagree at a collective call (init): worker 0 differs from worker 1 at item 6 "
                   "(of 10): worker 1 has key 6 (11, 32) float32, worker 0 has key 6 (11, 64) float32"),
    ("trainer", 2, 1, "workers disagree at a collective call (init): worker 1 differs from worker 0 at item 4 "
                      "(of 8): worker 0 has key '2.weight' (64, 16) float32, worker 1 has key '2.weight' "
                      "(32, 16) float32"),
    ("trainer-flat", 2, 1, "workers disagree at a collective call (init): worker 1 differs from worker 0 at item 0 "
                           "(of 2): worker 0 has key 'bucket.0' (1803,) float32, worker 1 has key 'bucket.0' (907,) "
                           "float32; on worker {rank}, flat bucket 'bucket.0' holds parameters '3.bias' (11,), "
                           "'3.weight' (11, {width}), '2.bias' ({width},), '2.weight' ({width}, 16)"),
])
def test_workers_whose_models_differ_are_told_the_first_parameter_that_differs(mode, workers, blamed, error):
    """Models that differ in one parameter (kv.init, kvstore.torch.Trainer): every
    worker's error names the first differing key, its index and both shapes (not two
    digests; with flat buckets, the bucket and the parameters it holds), and the root cause is the worker that differs from the others (the
    same every run, whichever worker's report reached the scheduler first)."""
    p = launch("-n", str(workers), "-s", "1", sys.executable, os.path.join(SCRIPTS, "mismatch.py"), mode,
               env=FAST_FAILURE)
    assert p.wait(120) == 1, p.text
    for rank in range(workers):   # (with flat buckets: each names its own bucket's parameters)
        want = error.format(rank=rank, width=64 if rank == 0 else 32)
        line = next((x for x in p.text.splitlines() if x.startswith(f"[worker:{rank}] error: ")), "")
        # the disagreement, then this worker's own bucket: when another worker's report (with
        # its own bucket) reached this one first as the abort, that report's bucket comes between
        disagreement, _, own = want.partition("; on worker")
        assert line.startswith(f"[worker:{rank}] error: {disagreement}"), p.text
        assert (not own or line.endswith(f"; on worker{own}")), p.text
    cause = p.text.split("job failed:")[1]
    assert cause.startswith(f" worker {blamed} differs from the other workers at a collective call; "), p.text
    row = re.search(rf"^worker {blamed} +\d+  (.*)$", p.text, re.M)
    assert row and row.group(1).endswith("<- root cause"), p.text
    assert p.text.count("<- root cause") == 1, p.text
    assert_no_leftovers(p)


def test_the_worker_absent_from_a_timed_out_barrier_is_the_root_cause():
    """Workers 0 and 2 wait at a barrier that worker 1 (alive, heartbeating) never
    reaches: their barrier times out naming worker 1, they fail, and the table
    marks worker 1, not the waiter whose report reached the scheduler first. (Worker 1
    hears of the abort but would leave only after KVSTORE_ABORT_GRACE: the teardown
    stops it, so nothing but the barrier's message says it is the cause.)"""
    p = launch("-n", "3", "-s", "1", sys.executable, CASES, "absent",
               env={**FAST_FAILURE, "KVSTORE_TIMEOUT": "10", "KVSTORE_ABORT_GRACE": "60"})
    assert p.wait(90) == 1, p.text
    cause = p.text.split("job failed:")[1]
    assert re.search(r"worker 1 \(pid \d+ on [^)]*\) did not arrive", cause), p.text
    row = re.search(r"^worker 1 +\d+  (.*)$", p.text, re.M)
    assert row and row.group(1).endswith("<- root cause"), p.text
    assert p.text.count("<- root cause") == 1, p.text
    assert_no_leftovers(p)


def test_a_stuck_culprit_is_marked_not_shown_as_killed_by_the_teardown():
    p = launch("-n", "2", "-s", "1", sys.executable, os.path.join(SCRIPTS, "faulty.py"), "loop",
               env=FAST_FAILURE)
    p.wait_for(r"ready rank", count=2)
    p.wait_for(r"server 0 \(pid \d+\)")     # (its own line: under load it may come after the workers')
    pid = int(re.search(r"server 0 \(pid (\d+)\)", p.text).group(1))
    os.kill(pid, signal.SIGSTOP)    # alive but silent: found by heartbeats
    assert p.wait(60) == 1, p.text
    row = re.search(r"^server 0 +\d+  (.*)$", p.text, re.M)
    assert row and row.group(1) == "failed (see above), then stopped by the launcher  <- root cause", \
        p.text
    assert_no_leftovers(p)


def test_a_successful_job_ends_with_one_summary_line():
    p = launch("-n", "2", "-s", "1", sys.executable, os.path.join(SCRIPTS, "formulas.py"))
    assert p.wait(120) == 0, p.text
    assert re.fullmatch(r"job finished: 2 workers, 1 server, \d+\.\d s, exit 0", p.lines[-1]), p.text
    assert p.text.count("job finished") == 1
    assert "job failed" not in p.text


@pytest.mark.parametrize("user", [None, "3"])
def test_thread_count_per_process(user):
    """Unless OMP_NUM_THREADS is set, every process gets OMP_NUM_THREADS and
    MKL_NUM_THREADS = this machine's cores // the processes started (at least 1),
    said once in the launcher's log; the user's value wins."""
    from tracker.launcher import cpu_count
    env = {**FAST_FAILURE, "OMP_NUM_THREADS": user or "", "MKL_NUM_THREADS": ""}
    p = launch("-n", "2", "-s", "1", sys.executable, CASES, "threads", env=env)
    assert p.wait(60) == 0, p.text
    expected = str(max(1, cpu_count() // 3))
    seen = re.findall(r"\[worker:\d\] threads (\S+) (\S+)", p.text)
    if user is None:
        assert seen == [(expected, expected)] * 2, p.text
        assert p.text.count("OMP_NUM_THREADS is not set") == 1, p.text
        assert f"this machine: {cpu_count()} cores / 3 processes = {expected}" in p.text
    else:
        assert seen == [("3", "-")] * 2, p.text
        assert "OMP_NUM_THREADS is not set" not in p.text


@pytest.mark.parametrize("argv", [
    ["-m", "tracker.local", "-n", "1", "python", "x.py"],
    ["-m", "kvstore.server"],
])
def test_an_invalid_log_level_is_a_named_error(argv):
    p = Proc([sys.executable, *argv], env={"KVSTORE_LOG_LEVEL": "chatty"})
    assert p.wait(30) == 2, p.text
    assert "error: KVSTORE_LOG_LEVEL=chatty is invalid: use one of DEBUG, INFO" in p.text
    assert "Traceback" not in p.text


def test_log_levels_are_case_insensitive():
    p = launch("-n", "1", "--dry-run", "python", "x.py", env={"KVSTORE_LOG_LEVEL": "warning"})
    assert p.wait(30) == 0, p.text
