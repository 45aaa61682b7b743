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

from kvstore import optimizer as opt
from kvstore.errors import CheckpointError, NodeFailedError
from kvstore.server.checkpoint import part_path, path_for, read_header
from services import killed_while_writing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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

    first = make_cluster(2, 2, chunk_bytes=4096, checkpoint_dir=ckpt)
    (at_checkpoint, final), _ = first.run(original)
    first.close()                   # its servers end, and let go of the directory
    assert sorted(os.listdir(ckpt)) == ["server-0.ckpt", "server-1.ckpt"]   # no temporary or lock file left

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
    with pytest.raises(CheckpointError, match=r"cannot resume: no complete checkpoint .*server 0: no "
                                              r"checkpoint file \(.*server-0.ckpt does not exist"):
        cluster.run(lambda kv: None)


def test_checkpoint_needs_a_directory(make_cluster):
    def job(kv):
        kv.init("w", np.ones(3, np.float32))
        with pytest.raises(CheckpointError, match="save_checkpoint failed: .*server 0 .*KVSTORE_CHECKPOINT_DIR"):
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
    with pytest.raises(CheckpointError, match="cannot resume: .*written by a job of 2 servers; "
                                              "this job has 3.*server 2: no checkpoint file"):
        cluster.run(lambda kv: None)


# -- job-wide consistent checkpoints (issue 27) -----------------------------------------------

def run_steps(kv, first, last, n=2048):
    """SGD steps on one 2-chunk key (one chunk per server at chunk_bytes=4096): push, pull."""
    w = np.empty(n, np.float32)
    for step in range(first, last):
        kv.push("w", np.cos(np.arange(n, dtype=np.float32) * (kv.rank + 2) + step).astype(np.float32))
        kv.pull("w", out=w)
    return w


def start(kv, n=2048):
    kv.init("w", np.ones(n, np.float32))
    kv.set_optimizer(SGD)
    return kv.resume_meta.get("step", 0)


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (a disk that fills up), or skip where this process cannot mount one."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)


def fill(directory, leave: int) -> None:
    """Fill ``directory``'s file system up to ``leave`` free bytes."""
    st = os.statvfs(directory)
    with open(os.path.join(directory, "filler"), "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))


def test_a_save_that_fails_on_one_server_leaves_the_previous_set_and_resume_takes_it(make_cluster, small_disk,
                                                                                     tmp_path):
    """The issue's defect 1: one server's save failed (disk full), the job went on,
    and the resume combined server 0's new file with server 1's old one. Now a set
    counts only once every server's part is written: the resume takes the previous
    set, on every server, and ends with the uninterrupted run's weights. Each server
    keeps its checkpoints on its own disk, as on hosts of their own: server 1's is a
    small tmpfs that fills up (one shared disk with room for one part would let two
    parts written at once both fail)."""
    ckpt, own = str(small_disk), str(tmp_path / "server-0-disk")
    disks = {"checkpoint_dir": own, "per_server": {1: {"checkpoint_dir": ckpt}}}
    reference, = {tuple(w) for w in make_cluster(2, 2, chunk_bytes=4096).run(
        lambda kv: (start(kv), run_steps(kv, 0, 8))[1])}

    def original(kv):
        start(kv)
        run_steps(kv, 0, 3)
        kv.save_checkpoint({"step": 3})
        run_steps(kv, 3, 5)
        if kv.rank == 0:   # server 1's disk: no room for its part of the next checkpoint
            fill(ckpt, os.path.getsize(os.path.join(ckpt, "server-1.ckpt")) // 2)
        # every worker, the leader too, a CheckpointError quoting the server's error
        with pytest.raises(CheckpointError,
                           match=r"save_checkpoint .*server 1: \[Errno 28\] No space left"):
            kv.save_checkpoint({"step": 5})
        kv.barrier()
        if kv.rank == 0:
            os.unlink(os.path.join(ckpt, "filler"))
        return run_steps(kv, 5, 6)       # the job goes on after a failed save

    os.mkdir(own)
    make_cluster(2, 2, chunk_bytes=4096, **disks).run(original)
    parts = [n for d in (own, ckpt) for n in os.listdir(d) if n.endswith(".part")]
    assert [p.split(".")[0] for p in parts] == ["server-0"], parts   # server 0 wrote its part, 1 could not

    def resumed(kv):
        first = start(kv)
        assert first == 3 and kv.resume_meta == {"step": 3}
        w = run_steps(kv, first, 8)
        kv.save_checkpoint({"step": 8})   # a new id: above the failed save's part (found by chaos)
        return w
    again = make_cluster(2, 2, chunk_bytes=4096, resume=True, **disks)
    for w in again.run(resumed):
        assert tuple(w) == reference
    again.close()
    assert (os.listdir(own), os.listdir(ckpt)) == (["server-0.ckpt"], ["server-1.ckpt"])


def test_a_resume_never_combines_files_of_different_saves(make_cluster, tmp_path):
    """Server 1's committed file replaced by its file of an older save (a restored
    backup, a crash that lost the newer file): refused, naming server 1 and the file."""
    ckpt = tmp_path / "ckpt"
    old = tmp_path / "old"

    def original(kv):
        start(kv)
        run_steps(kv, 0, 2)
        kv.save_checkpoint({"step": 2})
        if kv.rank == 0:
            old.mkdir()
            (old / "server-1.ckpt").write_bytes((ckpt / "server-1.ckpt").read_bytes())
        kv.barrier()
        run_steps(kv, 2, 4)
        kv.save_checkpoint({"step": 4})
    make_cluster(2, 2, chunk_bytes=4096, checkpoint_dir=str(ckpt)).run(original)
    (ckpt / "server-1.ckpt").write_bytes((old / "server-1.ckpt").read_bytes())
    with pytest.raises(CheckpointError, match=r"checkpoint 2 is committed but incomplete: server 1 has no "
                                              r"usable file of checkpoint 2 .*server-1.ckpt holds checkpoint 1"):
        make_cluster(2, 2, chunk_bytes=4096, checkpoint_dir=str(ckpt), resume=True).run(start)


def test_a_corrupted_checkpoint_file_is_refused_naming_it(make_cluster, tmp_path):
    ckpt = tmp_path / "ckpt"

    def original(kv):
        start(kv)
        run_steps(kv, 0, 2)
        kv.save_checkpoint({"step": 2})
    make_cluster(1, 2, chunk_bytes=4096, checkpoint_dir=str(ckpt)).run(original)
    data = bytearray((ckpt / "server-0.ckpt").read_bytes())
    data[-10] ^= 0xFF                                   # one flipped bit in the payload
    (ckpt / "server-0.ckpt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"server 0 has no usable file of checkpoint 1 .*server-0.ckpt "
                                              r"is corrupt: its checksum does not match"):
        make_cluster(1, 2, chunk_bytes=4096, checkpoint_dir=str(ckpt), resume=True).run(start)


def test_three_crashes_and_resumes_in_a_row_give_the_uninterrupted_weights(make_cluster, tmp_path):
    """The issue's defect 2: automatic checkpoints after a resume recorded the pulls
    since the resume, not since the start, so a second resume started at the wrong
    step. The documented loop, crashed three times (the workers stop after a push
    whose pull and checkpoint never came) and resumed each time, ends bit for bit
    where an uninterrupted run does."""
    ckpt = str(tmp_path / "ckpt")
    total = 12
    reference, = {tuple(w) for w in make_cluster(2, 2, chunk_bytes=4096).run(
        lambda kv: (start(kv), run_steps(kv, 0, total))[1])}

    def crashing_at(crash):
        def job(kv):
            first = start(kv)
            run_steps(kv, first, crash)
            kv.push("w", np.ones(2048, np.float32))    # a round the checkpoints never see
            return first
        return job

    settings = dict(chunk_bytes=4096, checkpoint_dir=ckpt, checkpoint_interval=1e-6)
    assert make_cluster(2, 2, **settings).run(crashing_at(3)) == [0, 0]
    starts = []
    for crash in (6, 9):
        starts += make_cluster(2, 2, resume=True, **settings).run(crashing_at(crash))

    def finish(kv):
        first = start(kv)
        return first, run_steps(kv, first, total)
    results = make_cluster(2, 2, resume=True, **settings).run(finish)
    assert starts == [3, 3, 6, 6] and [f for f, _ in results] == [9, 9]
    for _, w in results:
        assert tuple(w) == reference


# -- checkpoints of one job only (issue 40) ---------------------------------------------------

def job_of(directory, rank: int) -> str:
    """The job id in server ``rank``'s committed checkpoint file."""
    return read_header(path_for(str(directory), rank))[0]["job"]


def test_a_file_copied_from_another_job_is_refused_by_name(make_cluster, tmp_path):
    """The issue's finding 3: another job's server-1.ckpt, of the same id and step,
    copied into the directory; --resume exited 0 with weights of neither job. Now
    the resume names both files and both jobs, and restores nothing."""
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"

    def original(kv):
        start(kv)
        run_steps(kv, 0, 2)
        kv.save_checkpoint({"step": 2})
    for directory in (mine, theirs):       # two jobs of the same program: same ids, same steps
        make_cluster(2, 2, chunk_bytes=4096, checkpoint_dir=str(directory)).run(original)
    assert job_of(mine, 1) != job_of(theirs, 1)
    (mine / "server-1.ckpt").write_bytes((theirs / "server-1.ckpt").read_bytes())
    with pytest.raises(CheckpointError, match=rf"cannot resume: the files of checkpoint 1 were written by "
                                              rf"different jobs: {mine}/server-0.ckpt \(job {job_of(mine, 0)}\), "
                                              rf"{mine}/server-1.ckpt \(job {job_of(theirs, 1)}\)"):
        make_cluster(2, 2, chunk_bytes=4096, checkpoint_dir=str(mine), resume=True).run(start)


def test_a_second_live_job_on_the_same_directory_is_refused_at_start_naming_the_first(make_cluster, tmp_path):
    """The issue's finding 3: two live jobs sharing KVSTORE_CHECKPOINT_DIR both saved
    id 1, and a resume could combine their files. Now the second one's server fails
    at start naming the first job (its id, pid and host), and the first goes on."""
    ckpt = tmp_path / "ckpt"
    saved, refused = threading.Event(), threading.Event()

    def first_job(kv):
        start(kv)
        run_steps(kv, 0, 2)
        kv.save_checkpoint({"step": 2})
        saved.set()
        assert refused.wait(60), "the second job was not refused"
        run_steps(kv, 2, 4)
        kv.save_checkpoint({"step": 4})      # its directory is still its own
        return kv.rank
    first = make_cluster(2, 2, chunk_bytes=4096, checkpoint_dir=str(ckpt))
    outcome = {}
    runner = threading.Thread(target=lambda: outcome.update(results=first.run(first_job)))
    runner.start()
    try:
        assert saved.wait(60), "the first job did not save"
        owner = job_of(ckpt, 0)
        # heartbeat_timeout: how long a server waits for a holder that may be ending
        second = make_cluster(2, 2, chunk_bytes=4096, checkpoint_dir=str(ckpt), heartbeat_timeout=1.0)
        # each of its servers finds its rank's lock held: the first to give up names its own
        with pytest.raises(NodeFailedError, match=rf"server (\d) cannot start: the checkpoint directory {ckpt} "
                                                  rf"is in use by job {owner} \(server \1, pid {os.getpid()} on "
                                                  rf".*\): it holds {ckpt}/server-\1.lock. Two live jobs "
                                                  r"cannot share a checkpoint directory"):
            second.run(start)
    finally:
        refused.set()
        runner.join(60)
    assert outcome["results"] == [0, 1]
    first.close()
    assert sorted(os.listdir(ckpt)) == ["server-0.ckpt", "server-1.ckpt"]
    assert {job_of(ckpt, 0), job_of(ckpt, 1)} == {owner}
    assert read_header(path_for(str(ckpt), 0))[0]["checkpoint"] == 2


def temporaries(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(".server-"))


def test_temporaries_of_a_killed_save_are_removed_by_a_resume_and_by_the_next_save(make_cluster, tmp_path):
    """The issue's finding 3: a save killed mid-write left .server-R.ckpt-N.part-XXXX
    temporaries forever. The resume that chooses a set removes them, and so does
    every server's next committed save."""
    ckpt = tmp_path / "ckpt"

    def original(kv):
        start(kv)
        run_steps(kv, 0, 2)
        kv.save_checkpoint({"step": 2})
    make_cluster(2, 2, chunk_bytes=4096, checkpoint_dir=str(ckpt)).run(original)
    for rank in (0, 1):               # both servers killed while they wrote their part of set 2
        killed_while_writing(part_path(str(ckpt), rank, 2))
    assert [n.split(".part-")[0] for n in temporaries(ckpt)] == [".server-0.ckpt-2", ".server-1.ckpt-2"]

    def resumed(kv):
        first = start(kv)
        found = temporaries(ckpt)      # every server restored before create returned
        kv.barrier()
        if kv.rank == 0:               # and a save killed again, while the job runs
            killed_while_writing(part_path(str(ckpt), 1, 9))
        kv.barrier()
        between = temporaries(ckpt)
        run_steps(kv, first, 4)
        kv.save_checkpoint({"step": 4})
        return first, found, between, temporaries(ckpt)
    for first, found, between, after in make_cluster(2, 2, chunk_bytes=4096, checkpoint_dir=str(ckpt),
                                                     resume=True).run(resumed):
        assert (first, found, after) == (2, [], [])
        assert [n.split(".part-")[0] for n in between] == [".server-1.ckpt-9"]


@pytest.mark.parametrize("optimizer, said", [
    (opt.Adam(learning_rate=0.01), "set 'adam'"),
    (opt.SGD(learning_rate=0.05, momentum=0.9), "set 'sgd' with other settings (learning_rate: 0.1 -> 0.05)"),
    (SGD, None),
])
def test_a_resume_with_another_optimizer_logs_what_it_drops(make_cluster, tmp_path, caplog, optimizer, said):
    """The issue's finding 9: a resumed job that sets another optimizer dropped the
    restored optimizer state without a word. Now every server logs a warning naming
    both optimizers and the state of how many keys it drops; the same optimizer
    keeps the state, and says nothing."""
    ckpt = str(tmp_path / "ckpt")

    def original(kv):
        start(kv)
        kv.init("b", np.zeros(2, np.float32))           # on one server: one chunk
        run_steps(kv, 0, 2)
        kv.push("b", np.ones(2, np.float32))
        kv.save_checkpoint({"step": 2})
    make_cluster(2, 2, chunk_bytes=4096, checkpoint_dir=ckpt).run(original)

    def resumed(kv):
        kv.init("w", np.ones(2048, np.float32))
        kv.init("b", np.zeros(2, np.float32))
        kv.set_optimizer(optimizer)
        return run_steps(kv, 2, 3)
    with caplog.at_level(logging.WARNING, logger="kvstore.server.checkpoint_ops"):
        make_cluster(2, 2, chunk_bytes=4096, checkpoint_dir=ckpt, resume=True).run(resumed)
    dropped = sorted(r.getMessage() for r in caplog.records if "optimizer state" in r.getMessage())
    if said is None:
        assert dropped == []
        return
    assert len(dropped) == 2, dropped            # one per server
    b_server = 0 if "(2 chunk(s) on this server)" in dropped[0] else 1
    for server, message in enumerate(dropped):
        keys, chunks = (2, 2) if server == b_server else (1, 1)
        assert message == (f"server {server}: the job resumed with optimizer 'sgd' but {said}: the "
                           f"checkpoint's optimizer state (update counts and state arrays) of {keys} key(s) "
                           f"({chunks} chunk(s) on this server) is dropped, and the new optimizer starts "
                           "from fresh state. Set the checkpoint's optimizer to keep it (set_learning_rate "
                           "changes the learning rate and keeps it)")
