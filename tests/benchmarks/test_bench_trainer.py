"""benchmarks/trainer/run.py at tiny size: a real run of every contender (ours through
the launcher, DDP over gloo, the single process) whose JSON must be complete and
whose correctness check must pass, and a deliberately wrong worker that the check
must catch. Never asserts on speed: timings are only checked to exist."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from benchmarks.trainer import run as trainer  # noqa: E402

pytest.importorskip("torch")
import kvstore.torch as kvtorch  # noqa: E402

# ResNet-20 (BatchNorm: the per-worker-slice reference) on 3x8x8 inputs, b=4, W=2, S=1
TINY = ["--network", "resnet", "--num-layers", "20", "--batch-size", "4", "--image-size", "8",
        "--iters", "3", "--warmup", "1", "--launches", "1", "-w", "2", "-s", "1", "--timeout", "90"]


def run_bench(args, out_dir, deadline=150):
    """The benchmark as a user runs it; returns (exit status, output, JSON)."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.trainer", *args, "--out-dir",
                           str(out_dir), "--work-dir", str(out_dir / "work")], cwd=REPO, capture_output=True, text=True,
                          timeout=deadline, stdin=subprocess.DEVNULL)
    path = os.path.join(out_dir, "trainer.json")
    data = json.load(open(path)) if os.path.exists(path) else None
    return proc.returncode, proc.stdout + proc.stderr, data


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_every_default_contender_runs_and_trains_to_the_same_weights(tmp_path):
    code, output, data = run_bench(TINY, tmp_path)
    assert code == 0, output[-4000:]
    assert set(data["summary"]) == set(trainer.DEFAULT_CONTENDERS)
    for name, s in data["summary"].items():
        assert s["n"] == 3 and s["median"] > 0 and s["p10"] > 0, (name, s)
        assert len(s["launch_medians"]) == 1 and len(s["loadavg_before"]) == 1
    assert data["summary"]["ddp"]["vs_ddp"] == 1.0
    chk = data["correctness"]
    assert chk["ok"] and not data["failures"]
    by = chk["by_contender"]
    # every worker of ours and DDP was compared (BatchNorm: the floor is not comparable)
    assert set(by) == set(trainer.DEFAULT_CONTENDERS) - {"floor"}
    for name in ("ours-overlap-worker", "ours-nooverlap-worker"):
        assert by[name]["checked"] == {"reference": True, "ddp": True} and by[name]["checks"] == 4
    for name in ("ours-overlap-server", "ours-nooverlap-server"):
        assert by[name]["checked"]["reference-kvsgd"] and by[name]["checks"] == 2
    assert all(c["ok"] for c in chk["checks"] if c["checked"])
    assert {r["transports"] and r["transports"][0] for r in data["rows"]
            if r["contender"].startswith("ours")} <= {"shm", "ipc", "tcp"}
    ours = [r for r in data["rows"] if r["contender"].startswith("ours")]
    # the servers' CPU per timed step was read (from /proc) and the model-sized buckets recorded
    assert all(r["servers_cpu_s"] is not None and r["servers_cpu_s"] >= 0 for r in ours)
    model_bytes = data["config"]["num_params"] * 4
    assert all(r["bucket_bytes"] == kvtorch.bucket_bytes_for(model_bytes) for r in ours)
    md = (tmp_path / "trainer.md").read_text()
    assert "Caveat" in md and "torch DDP over gloo" in md and "Overall: passed" in md
    assert "servers' CPU ms/step" in md and "job CPU ms/step (vs DDP)" in md
    # the job's CPU a step: W workers' and the servers' (ours), DDP's ranks'
    summary = data["summary"]
    assert summary["ddp"]["job_cpu_vs_ddp"] == 1.0
    for name in ("ours-overlap-server", "ours-overlap-worker"):
        s = summary[name]
        assert s["job_cpu_s_per_step"] == 2 * s["cpu_s_per_step"] + s["servers_cpu_s_per_step"] > 0
    assert not os.path.exists(data["work_dir"])    # cleaned up after a passing run


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_wrong_worker_fails_the_run(tmp_path):
    # mlp: no BatchNorm, so the floor (one pass on W*b) is checked as well
    args = ["--network", "mlp", "--batch-size", "4", "--image-size", "8", "--iters", "2",
            "--warmup", "1", "--launches", "1", "-w", "2", "-s", "1", "--timeout", "90",
            "--contenders", "ours-flat-worker,floor", "--corrupt-for-test"]     # (the flat Trainer's path)
    code, output, data = run_bench(args, tmp_path)
    assert code == 1, output[-4000:]
    assert "WRONG RESULT: ours-flat-worker launch 1 rank 1 differs from reference" in output
    assert not data["correctness"]["ok"]
    bad = [c for c in data["correctness"]["checks"] if not c["ok"]]
    assert bad and {(c["contender"], c["rank"]) for c in bad} == {("ours-flat-worker", 1)}
    assert all(c["ok"] for c in data["correctness"]["checks"] if c["contender"] == "ours-flat-worker"
               and c["rank"] == 0)                          # rank 0 trained right with flat buckets
    floor = [c for c in data["correctness"]["checks"] if c["contender"] == "floor"]
    assert floor and all(c["ok"] and c["checked"] for c in floor)
    assert "**FAILED**" in (tmp_path / "trainer.md").read_text()


def test_compare_accepts_rounding_and_rejects_a_wrong_answer():
    rng = np.random.default_rng(0)
    want = rng.standard_normal(1000).astype(np.float32)
    assert trainer.compare(want.copy(), want, 1e-4, 1e-5)["ok"]
    assert trainer.compare(want * np.float32(1 + 1e-6), want, 1e-4, 1e-5)["ok"]
    wrong = want.copy()
    wrong[517] += 1e-3
    got = trainer.compare(wrong, want, 1e-4, 1e-5)
    assert not got["ok"] and got["worst_index"] == 517
    assert not trainer.compare(want[:-1], want, 1e-4, 1e-5)["ok"]          # shape
    nan = want.copy()
    nan[3] = np.nan
    assert not trainer.compare(nan, want, 1e-4, 1e-5)["ok"]                # not finite


def test_cli_rejects_unknown_contenders_and_networks(capsys):
    with pytest.raises(SystemExit) as e:
        trainer.main(["--contenders", "ours-overlap-server,horovod"])
    assert e.value.code == 2 and "horovod" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        trainer.main(["--network", "resnet", "--num-layers", "21"])
    assert e.value.code == 2 and "num_layers" in capsys.readouterr().err
