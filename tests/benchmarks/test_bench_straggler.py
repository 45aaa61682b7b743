"""benchmarks/straggler/run.py at a small size, and the throttle that slows its worker.

The benchmark runs the real example (examples/train_mnist.py, an MLP on 512
Fashion-MNIST images, 2 workers) unslowed and under dist_ssp with worker 1
throttled; every accuracy in its report must be one the workers logged, read back
here from the job's log with this file's own pattern. Never asserts on speed or on
which store learns better."""

import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid

import pytest

from benchmarks.harness.throttle import DutyCycle, ThrottleError, open_process

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
EPOCHS = 2
LOGGED = re.compile(r"^\[worker:(\d)\] \S+ \S+ Epoch\[(\d)\] Validation-accuracy=(\S+)$", re.M)


def _waiting_child(token: str) -> subprocess.Popen:
    """A python that says ``ready`` and then waits for a line on its stdin."""
    code = "import sys; print('ready', flush=True); sys.stdin.readline()"
    child = subprocess.Popen([sys.executable, "-c", code],
                             env={**os.environ, "KVBENCH_TEST": token}, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "ready\n"
    return child


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


def test_the_throttle_stops_the_process_and_always_resumes_it():
    token = uuid.uuid4().hex
    child = _waiting_child(token)
    try:
        stopped = threading.Event()

        def watch():    # the kernel reports the child's stop: an event, not a poll
            os.waitid(os.P_PID, child.pid, os.WSTOPPED)
            stopped.set()
        threading.Thread(target=watch, daemon=True).start()
        throttle = DutyCycle({"KVBENCH_TEST": token}, stop=0.05, run=0.05, find_timeout=30).start()
        assert stopped.wait(30), "the throttle never stopped the process"
        done = throttle.finish()
        assert throttle.error is None
        assert _state(child.pid) != "T"          # resumed, though it was stopped a moment ago
        assert done["stops"] >= 1 and done["stopped_s"] > 0
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(30) == 0
    finally:
        child.kill()
        child.wait()


def test_the_throttle_refuses_an_ambiguous_or_absent_process():
    token = uuid.uuid4().hex
    children = [_waiting_child(token) for _ in range(2)]
    try:
        with pytest.raises(ThrottleError, match="2 processes"):
            open_process({"KVBENCH_TEST": token}, time.monotonic() + 30, done=threading.Event())
    finally:
        for c in children:
            c.kill()
            c.wait()
    with pytest.raises(ThrottleError, match="no process with"):
        open_process({"KVBENCH_TEST": uuid.uuid4().hex}, time.monotonic(), done=threading.Event())


def test_tiny_run_reports_the_accuracies_the_workers_logged(tmp_path):
    p = subprocess.run([sys.executable, "-m", "benchmarks.straggler", "--out-dir", str(tmp_path),
                        "-w", "2", "--network", "mlp", "--num-examples", "512", "--num-epochs", str(EPOCHS),
                        "--stop", "0.02", "--run", "0.06", "--configs", "unslowed,ssp1"],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                       timeout=220)
    assert p.returncode == 0, p.stdout + p.stderr
    table = (tmp_path / "straggler.md").read_text()
    assert p.stdout.startswith(table)
    with open(tmp_path / "straggler.json") as f:
        data = json.load(f)
    rows, summary = data["rows"], data["summary"]
    assert [(r["config"], r["kvstore"], r["staleness"], r["slowed"]) for r in rows] == \
        [("unslowed", "dist_sync", None, False), ("ssp1", "dist_ssp", 1, True)]
    assert rows[0]["throttle"] is None and rows[1]["throttle"]["stops"] >= 1
    assert all(r["job_cores"] > 0 and r["other_cores"] == r["other_cores"] for r in rows)   # not NaN
    for r in rows:
        with open(r["log"]) as f:    # read here with LOGGED, not with the benchmark's parser
            logged = {(int(w), int(e)): float(a) for w, e, a in LOGGED.findall(f.read())}
        assert sorted(logged) == [(w, e) for w in range(2) for e in range(EPOCHS)], r["config"]
        for w, epochs in r["workers"].items():
            assert [e["epoch"] for e in epochs] == list(range(EPOCHS))
            assert [e["val"] for e in epochs] == [logged[int(w), e] for e in range(EPOCHS)]
            assert all(0 < e["t"] < r["wall_s"] and e["time_cost"] > 0 for e in epochs)
            assert epochs[0]["t"] < epochs[1]["t"]
        cells = re.search(rf"^\| {r['config']} \| (.*) \|$", table.split("### Worker 0")[1], re.M).group(1)
        assert cells.split(" | ") == [f"{e['t']:.1f} s: {logged[0, e['epoch']]:.4f}"
                                      for e in r["workers"]["0"]]
    # T: when the only slowed configuration's worker 0 finished, so its last epoch is its accuracy at T
    # (``logged`` is still ssp1's, the last row's)
    assert summary["T_from"] == "ssp1" and summary["T"] == rows[1]["workers"]["0"][-1]["t"]
    assert summary["rows"][1]["at_T"] == {"epoch": EPOCHS - 1, "val": logged[0, EPOCHS - 1]}
    assert f"**T = {summary['T']:.1f} s**" in table
    assert re.search(rf"^\| ssp1 \|.*\| \*\*{logged[0, EPOCHS - 1]:.4f}\*\* \({EPOCHS - 1}\) \|", table, re.M)
