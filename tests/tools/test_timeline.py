"""KVSTORE_TIMELINE=DIR: every worker and server of a real job writes a Chrome
trace-event file (kvstore/timeline.py) on one clock; ``python -m
kvstore.tools.timeline DIR`` merges and summarises them and draws a PNG; unset,
nothing is written."""

import json
import os
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from kvstore.timeline import Timeline
from kvstore.tools import timeline as tool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = """
import numpy as np, torch, kvstore, kvstore.torch
torch.manual_seed(0)
kv = kvstore.create("dist_sync")
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
trainer = kvstore.torch.Trainer(model.named_parameters(), kv, torch.optim.SGD(model.parameters(), lr=0.1),
                                bucket_bytes=256)
for step in range(3):
    trainer.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    trainer.step()
w = np.zeros(300_000, np.float32)            # two chunks (KVSTORE_CHUNK_BYTES), one per server
kv.init("w", w)
kv.push("w", np.ones_like(w))
kv.pull("w", out=w)
assert w[0] == kv.num_workers
kv.close()
"""
PLAIN = """
import numpy as np, kvstore
kv = kvstore.create("dist_sync")
kv.init(3, np.zeros(4, np.float32))
kv.pushpull(3, np.ones(4, np.float32))
kv.close()
"""


def launch(cwd, script: str, **env) -> subprocess.CompletedProcess:
    (cwd / "job.py").write_text(script)
    environ = {k: v for k, v in os.environ.items() if k != "KVSTORE_TIMELINE"}
    environ.update(PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
                   KVSTORE_TIMEOUT="60", **env)
    p = subprocess.run([sys.executable, "-m", "tracker.local", "-n", "2", "-s", "2", sys.executable, "job.py"],
                       cwd=cwd, env=environ, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    return p


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """A real 2-worker, 2-server training job with KVSTORE_TIMELINE set: (its
    directory, the job's wall-clock window in microseconds)."""
    cwd = tmp_path_factory.mktemp("job")
    before = time.time_ns() / 1e3
    launch(cwd, TRAIN, KVSTORE_TIMELINE="trace", KVSTORE_CHUNK_BYTES=str(600_000))
    return cwd / "trace", (before, time.time_ns() / 1e3)


def names(events, cat=None) -> set:
    return {e["name"] for e in events if cat is None or e.get("cat") == cat}


def test_every_process_writes_a_valid_trace_on_one_clock(traced):
    directory, (before, after) = traced
    assert sorted(os.listdir(directory)) == ["server-0.json", "server-1.json", "worker-0.json", "worker-1.json"]
    for path in sorted(directory.iterdir()):
        data = json.loads(path.read_text())
        events = data["traceEvents"]
        role, rank = path.stem.split("-")
        assert data["otherData"]["role"] == role and data["otherData"]["rank"] == int(rank)
        assert {"process_name", "thread_name"} <= names(e for e in events if e["ph"] == "M")
        assert {e["ph"] for e in events} <= {"X", "i", "M"}
        timed = [e for e in events if e["ph"] != "M"]
        assert all(isinstance(e["pid"], int) and isinstance(e["tid"], int) for e in events)
        assert all(before <= e["ts"] <= e["ts"] + e.get("dur", 0) <= after for e in timed), path
        assert all(e["dur"] >= 0 for e in timed if e["ph"] == "X")
        if role == "worker":
            assert {"init", "push", "pull", "pushpull"} <= names(events, "call")
            assert {"send pushpull", "wait pushpull", "copy out pushpull", "push", "send pull"} <= names(events, "worker")
            assert {"pushpull", "push", "pull"} <= names(events, "request")
            assert {"first gradient", "bucket ready", "step", "wait for exchanges",
                    "optimizer step"} <= names(events, "trainer")
            called = {k for e in events if e.get("cat") == "call" for k in e["args"]["keys"]}
            assert {"0.weight", "0.bias", "2.weight", "2.bias", "w"} <= called
            chunks = [c for e in events if e.get("cat") == "request" for c in e.get("args", {}).get("chunks", [])]
            assert ["w", 0] in chunks and ["w", 1] in chunks          # both chunks of the big key
            servers = {e["args"]["server"] for e in events if e.get("cat") == "request" and "args" in e}
            assert servers == {0, 1}
            assert data["otherData"]["comm_stats"]                   # bytes by transport
        else:
            assert {"init", "push", "pull", "pushpull"} <= names(events, "server")
            assert {"round complete", "reply"} <= names(events)
            workers = {e["args"]["worker"] for e in events if e.get("cat") == "server" and e["name"] == "push"}
            assert workers == {0, 1}


def test_the_merge_tool_writes_one_trace_and_summarises_every_worker(traced, tmp_path):
    directory, _ = traced
    # --top above the job's key count: which keys spent longest in flight swings under load
    p = subprocess.run([sys.executable, "-m", "kvstore.tools.timeline", str(directory), "--top", "20"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    merged = json.loads((directory / "timeline.json").read_text())
    processes = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"] if e["name"] == "process_name"}
    assert sorted(processes.values()) == ["server 0", "server 1", "worker 0", "worker 1"]
    assert len(set(processes)) == 4
    assert min(e["ts"] for e in merged["traceEvents"] if "ts" in e) == 0
    assert "4 processes (2 workers, 2 servers)" in p.stdout
    rows = p.stdout.split("workers (seconds")[1].split("\n\n")[0].splitlines()[2:]
    assert [row.split()[0] for row in rows] == ["0", "1"], p.stdout
    assert "'w'" in p.stdout and "rounds" in p.stdout


def test_the_png_is_drawn(traced, tmp_path):
    pytest.importorskip("matplotlib")
    directory, _ = traced
    png = tmp_path / "timeline.png"
    result = CliRunner().invoke(tool.main, [str(directory), "--png", str(png)])
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_without_matplotlib_is_a_clear_error(traced, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)       # import matplotlib raises ImportError
    result = CliRunner().invoke(tool.main, [str(traced[0]), "--png", str(tmp_path / "x.png")])
    assert result.exit_code == 1 and "--png needs matplotlib" in result.output, result.output


def test_without_the_variable_nothing_is_written(tmp_path):
    launch(tmp_path, PLAIN)
    assert sorted(os.listdir(tmp_path)) == ["job.py"]


def test_without_the_variable_no_store_or_server_has_a_timeline(make_cluster):
    cluster = make_cluster(1, 1)
    assert cluster.run(lambda kv: (kv._timeline, kv._client.timeline)) == [(None, None)]
    assert all(node._timeline is None for node in cluster.nodes)


def test_a_file_is_written_in_batches_and_read_back_after_a_crash(tmp_path):
    tl = Timeline(str(tmp_path), "worker", 5, flush_events=3)
    for i in range(7):
        tl.instant("test", f"e{i}")
    # 6 events written, 1 held: a process that dies now leaves a file without its end
    data = tool._parse((tmp_path / "worker-5.json").read_text(), "worker-5.json")
    assert [e["name"] for e in data["traceEvents"] if e["ph"] == "i"] == [f"e{i}" for i in range(6)]
    tl.close({"note": 1})
    tl.instant("test", "after close")
    tl.flush()
    data = json.loads((tmp_path / "worker-5.json").read_text())
    assert [e["name"] for e in data["traceEvents"] if e["ph"] == "i"] == [f"e{i}" for i in range(7)]
    assert data["otherData"]["note"] == 1


def test_an_unwritable_directory_is_a_config_error(tmp_path):
    from kvstore.errors import ConfigError
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="KVSTORE_TIMELINE"):
        Timeline(str(tmp_path / "file"), "server", 0)


def test_help():
    p = subprocess.run([sys.executable, "-m", "kvstore.tools.timeline", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "Usage: python -m kvstore.tools.timeline" in p.stdout, p.stderr


def test_an_empty_directory_is_reported(tmp_path):
    result = CliRunner().invoke(tool.main, [str(tmp_path)])
    assert result.exit_code == 1 and "no worker-R.json or server-R.json" in result.output
