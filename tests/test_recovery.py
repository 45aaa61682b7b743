"""Servers checkpoint atomically and a job resumes from the checkpoint with the
same weights as an uninterrupted run; stalled rounds are reported by key and worker."""

import logging
import os
import re
import subprocess
import sys
import threading

import numpy as np
import pytest

import kvstore
from kvstore import optimizer as opt
from kvstore.errors import NodeFailedError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SGD = opt.SGD(learning_rate=0.1, momentum=0.9)


def grad(rank, step):
    return np.cos(np.arange(3000, dtype=np.float32) * (rank + 2) + step).astype(np.float32)


def steps(kv, first, last):
    w = np.empty(3000, np.float32)
    for step in range(first, last):
        kv.push("w", grad(kv.rank, step))
        kv.pull("w", out=w)
    return w


def test_resume_from_a_checkpoint_equals_an_uninterrupted_run(make_cluster, tmp_path):
    ckpt = str(tmp_path / "ckpt")

    def original(kv):
        kv.init("w", np.ones(3000, np.float32))
        kv.set_optimizer(SGD)
        at_checkpoint = steps(kv, 0, 3)
        kv.save_checkpoint({"step": 3})
        return at_checkpoint, steps(kv, 3, 6)

    (at_checkpoint, final), _ = make_cluster(2, 2, chunk_bytes=4096, checkpoint_dir=ckpt).run(original)
    assert sorted(os.listdir(ckpt)) == ["server-0.ckpt", "server-1.ckpt"]   # no temporary files left

    def resumed(kv):
        assert kv.resumed and kv.resume_meta == {"step": 3}
        kv.init("w", np.zeros(3000, np.float32))        # the checkpoint's value wins
        kv.set_optimizer(SGD)                            # same optimizer: its state is kept
        w = np.empty(3000, np.float32)
        kv.pull("w", out=w)
        return w, steps(kv, kv.resume_meta["step"], 6)

    for w, w_final in make_cluster(2, 2, chunk_bytes=4096, checkpoint_dir=ckpt, resume=True).run(resumed):
        np.testing.assert_array_equal(w, at_checkpoint)
        np.testing.assert_array_equal(w_final, final)


def test_resume_without_a_checkpoint_fails_fast_naming_the_server(make_cluster, tmp_path):
    cluster = make_cluster(1, 1, checkpoint_dir=str(tmp_path / "empty"), resume=True)
    with pytest.raises(NodeFailedError, match="server 0 cannot resume: no server checkpoint"):
        cluster.run(lambda kv: None)


def test_checkpoint_needs_a_directory(make_cluster):
    def job(kv):
        kv.init("w", np.ones(3, np.float32))
        with pytest.raises(kvstore.RemoteError, match="KVSTORE_CHECKPOINT_DIR"):
            kv.save_checkpoint()
    make_cluster(1, 1).run(job)


def run_resumable(ckpt, *extra, crash=False, timeout=120):
    """tests/scripts/resumable.py as a 2+2 job checkpointing into ``ckpt``; with
    ``crash`` rank 0 kills server 1 after step 5. ``extra``: launcher options."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "KVSTORE_CHECKPOINT_DIR": str(ckpt),
           "KVSTORE_HEARTBEAT_TIMEOUT": "3", "KVSTORE_HEARTBEAT_INTERVAL": "0.2",
           "KVSTORE_ABORT_GRACE": "2", **({"CRASH": "1"} if crash else {})}
    cmd = [sys.executable, "-m", "tracker.local", "-n", "2", "-s", "2", *extra,
           sys.executable, os.path.join(ROOT, "tests", "scripts", "resumable.py")]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def check_kill_and_resume(tmp_path, *extra, timeout=120) -> str:
    """An uninterrupted run, a run whose server 1 is killed after step 5 (the job
    fails naming it), and the same command with --resume: the resumed job ends with
    the uninterrupted run's weights. ``extra``: launcher options. Returns the
    uninterrupted run's output."""
    reference = run_resumable(tmp_path / "ref", *extra, timeout=timeout)
    assert reference.returncode == 0, reference.stdout + reference.stderr
    want = re.findall(r"\[worker:0\] digest (\w+)", reference.stdout)
    crashed = run_resumable(tmp_path / "ckpt", *extra, crash=True, timeout=timeout)
    assert crashed.returncode != 0
    assert "server 1 was killed by SIGKILL" in crashed.stderr + crashed.stdout
    resumed = run_resumable(tmp_path / "ckpt", *extra, "--resume", crash=True, timeout=timeout)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "[worker:0] resumed=True start=4" in resumed.stdout
    assert re.findall(r"\[worker:\d\] digest (\w+)", resumed.stdout) == want * 2
    return reference.stdout + reference.stderr


@pytest.mark.slow
def test_kill_a_server_mid_run_then_resume_with_the_same_command(tmp_path):
    check_kill_and_resume(tmp_path)


def test_a_stalled_round_names_the_key_and_the_missing_worker(make_cluster, caplog):
    reported = threading.Event()

    class Watch(logging.Handler):
        def emit(self, record):
            if "has waited" in record.getMessage():
                reported.set()
    handler = Watch()
    logging.getLogger("kvstore.server.node").addHandler(handler)
    try:
        def job(kv):
            kv.init("layer1.weight", np.zeros(10, np.float32))
            if kv.rank == 1:
                assert reported.wait(20), "the stall was not reported"
            kv.push("layer1.weight", np.ones(10, np.float32))
            out = np.empty(10, np.float32)
            kv.pull("layer1.weight", out=out)
            return out
        with caplog.at_level(logging.WARNING):
            results = make_cluster(2, 1, stall_warning=0.5).run(job)
    finally:
        logging.getLogger("kvstore.server.node").removeHandler(handler)
    assert all(np.all(r == 2) for r in results)
    assert re.search(r"key 'layer1.weight' \(chunk 0\) has waited \d+s for worker\(s\) 1 to push "
                     r"\(worker\(s\) 0 did\)", caplog.text)


def test_resume_with_another_number_of_servers_is_refused(make_cluster, tmp_path):
    ckpt = str(tmp_path / "ckpt")

    def save(kv):
        kv.init("w", np.ones(3000, np.float32))
        kv.save_checkpoint()
    make_cluster(1, 2, chunk_bytes=4096, checkpoint_dir=ckpt).run(save)
    cluster = make_cluster(1, 3, chunk_bytes=4096, checkpoint_dir=ckpt, resume=True)
    # the three servers race to report; each reason names the mismatch or the missing file
    with pytest.raises(NodeFailedError, match="cannot resume: .*(written by a job of 2 servers; "
                                              "this job has 3|no server checkpoint)"):
        cluster.run(lambda kv: None)
