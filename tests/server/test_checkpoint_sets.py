"""kvstore.server.checkpoint: a server's checkpoint files (two phases, checksums)
and the choice of the set a resume restores, in every state a crash can leave."""

import hashlib
import os

import msgpack
import pytest

from kvstore.errors import CheckpointError
from kvstore.server.checkpoint import FORMAT, CheckpointDir, Entry, choose, load, part_path, path_for
from services import killed_while_writing


SNAP = {"server": "server 0", "mode": "sync", "num_workers": 2, "optimizer": None, "meta": {},
        "chunks": [["w", 0, "<f4", b"\0" * 64, None, []]]}


JOB = "0123456789abcdef"


def servers(tmp_path, n=2, job=JOB):
    return [CheckpointDir(str(tmp_path), rank, n, job) for rank in range(n)]


def save_set(dirs, ckpt_id, step, commit=True):
    for d in dirs:
        d.write_part(ckpt_id, step, {**SNAP, "meta": {"step": step}})
    if commit:
        for d in dirs:
            d.commit(ckpt_id)


def test_a_committed_set_leaves_one_file_per_server_and_loads_verified(tmp_path):
    dirs = servers(tmp_path)
    save_set(dirs, 1, 10)
    save_set(dirs, 2, 20)
    assert sorted(os.listdir(tmp_path)) == ["server-0.ckpt", "server-1.ckpt"]
    assert choose([d.inventory(verify=True) for d in dirs]).id == 2
    snap = dirs[1].load(2, JOB)
    assert (snap["checkpoint"], snap["step"], snap["meta"], snap["num_servers"], snap["job"]) == \
        (2, 20, {"step": 20}, 2, JOB)
    assert load(path_for(str(tmp_path), 0))["meta"] == {"step": 20}


def test_a_crash_between_the_commits_resumes_the_new_set_everywhere(tmp_path):
    dirs = servers(tmp_path)
    save_set(dirs, 1, 10)
    save_set(dirs, 2, 20, commit=False)
    dirs[0].commit(2)                   # server 1 died before its commit: it still has its part
    choice = choose([d.inventory(verify=True) for d in dirs])
    assert (choice.id, choice.step, choice.job) == (2, 20, JOB)
    assert dirs[1].load(2, JOB)["step"] == 20


def test_a_crash_in_phase_one_resumes_the_previous_set_everywhere(tmp_path):
    dirs = servers(tmp_path)
    save_set(dirs, 1, 10)
    dirs[0].write_part(2, 20, SNAP)     # server 1 never wrote its part; nobody committed
    assert choose([d.inventory(verify=True) for d in dirs]).id == 1
    assert dirs[0].load(1, JOB)["step"] == 10


def test_ids_never_go_back_and_stale_parts_go_at_the_next_commit(tmp_path):
    dirs = servers(tmp_path)
    save_set(dirs, 1, 10)
    dirs[0].write_part(2, 20, SNAP)     # a failed save left a part behind
    fresh = servers(tmp_path)           # a new job in the same directory
    with pytest.raises(CheckpointError, match="checkpoint id 2 is not newer than 2"):
        fresh[0].write_part(2, 5, SNAP)
    save_set(fresh, 3, 5)
    assert sorted(os.listdir(tmp_path)) == ["server-0.ckpt", "server-1.ckpt"]
    fresh[0].commit(3)                  # a repeated commit changes nothing
    with pytest.raises(CheckpointError, match="server 1 has no part of checkpoint 4"):
        fresh[1].commit(4)


def test_a_missing_part_of_a_committed_set_is_refused_naming_the_server(tmp_path):
    dirs = servers(tmp_path)
    save_set(dirs, 1, 10)
    save_set(dirs, 2, 20, commit=False)
    dirs[0].commit(2)
    os.unlink(part_path(str(tmp_path), 1, 2))
    with pytest.raises(CheckpointError, match=r"checkpoint 2 is committed but incomplete: server 1 has no "
                                              r"usable file of checkpoint 2 .*server-1.ckpt holds "
                                              r"checkpoint 1 \(step 10\).*deleted or never written"):
        choose([d.inventory(verify=True) for d in dirs])


@pytest.mark.parametrize("damage, match", [
    (lambda b: b[:-5], "is truncated or has trailing bytes"),
    (lambda b: b + b"x", "is truncated or has trailing bytes"),
    (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "is corrupt: its checksum does not match"),
    (lambda b: b[:3], "cannot be read as a checkpoint"),
    (lambda b: b"", "cannot be read as a checkpoint"),
    (lambda b: msgpack.packb({"format": "kvstore.server_checkpoint", "version": 1}), "has server checkpoint version 1"),
    (lambda b: msgpack.packb([1, 2]), "is not a kvstore server checkpoint"),
])
def test_a_damaged_file_is_refused_naming_it(tmp_path, damage, match):
    dirs = servers(tmp_path)
    save_set(dirs, 1, 10)
    path = path_for(str(tmp_path), 1)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(damage(data))
    entry, = dirs[1].inventory(verify=True)
    assert entry.error is not None and match in entry.error and path in entry.error
    with pytest.raises(CheckpointError, match="server 1 has no usable file of checkpoint 1"):
        choose([d.inventory(verify=True) for d in dirs])


def test_files_of_another_job_shape_are_refused(tmp_path):
    save_set(servers(tmp_path, 2), 1, 10)
    three = servers(tmp_path, 3)
    with pytest.raises(CheckpointError, match=r"written by a job of 2 servers; this job has 3.*server 2: "
                                              r"no checkpoint file"):
        choose([d.inventory(verify=True) for d in three], str(tmp_path))


def test_files_that_disagree_on_the_step_are_refused(tmp_path):
    a = [[Entry("a", True, 3, 30, job=JOB)], [Entry("b", True, 3, 31, job=JOB)]]
    with pytest.raises(CheckpointError, match=r"disagree on its step \(\[30, 31\]\)"):
        choose(a)


def test_the_inventory_entries_survive_the_wire_and_malformed_ones_are_refused():
    e = Entry("/x/server-0.ckpt", True, 3, 30, job=JOB)
    assert Entry.from_wire(msgpack.unpackb(msgpack.packb(e.to_wire()))) == e
    for bad in (None, {"file": 1, "committed": True}, {"file": "f", "committed": True, "id": -1, "step": 0},
                {"file": "f", "committed": True, "id": 1, "step": 0},                     # no job
                {"file": "f", "committed": True, "id": 1, "step": 0, "job": "a b\n"}):
        with pytest.raises(CheckpointError, match="malformed"):
            Entry.from_wire(bad)


# -- the job a file belongs to (issue 40) -----------------------------------------------------

OTHER = "fedcba9876543210"


def test_a_set_with_a_file_of_another_job_is_refused_naming_each_file_and_its_job(tmp_path):
    """A file copied from another job's directory, with the same id and step, is
    not taken for this job's: the resume is refused naming both files and jobs."""
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    dirs = servers(mine)
    save_set(dirs, 1, 10)
    save_set(servers(theirs, job=OTHER), 1, 10)
    (mine / "server-1.ckpt").write_bytes((theirs / "server-1.ckpt").read_bytes())
    with pytest.raises(CheckpointError, match=rf"cannot resume: the files of checkpoint 1 were written by "
                                              rf"different jobs: {mine}/server-0.ckpt \(job {JOB}\), "
                                              rf"{mine}/server-1.ckpt \(job {OTHER}\)"):
        choose([d.inventory(verify=True) for d in dirs], str(mine))
    with pytest.raises(CheckpointError, match=rf"server-1.ckpt holds checkpoint 1 of job {OTHER}, not of "
                                              rf"job {JOB}"):
        dirs[1].load(1, JOB)
    # a set that is wholly another job's (a directory moved) is that job's to resume
    assert choose([d.inventory(verify=True) for d in servers(theirs)]).job == OTHER


def test_a_save_after_a_resume_keeps_the_restored_sets_job(tmp_path):
    save_set(servers(tmp_path), 1, 10)
    resumed = servers(tmp_path, job=OTHER)          # the scheduler's new id for the resumed run
    choice = choose([d.inventory(verify=True) for d in resumed])
    for d in resumed:                               # what a restore does (CheckpointOps)
        d.load(choice.id, choice.job)
        d.job = choice.job
    save_set(resumed, 2, 20)
    assert {e.job for d in resumed for e in d.inventory(verify=True)} == {JOB}


def test_a_version_2_file_is_refused_saying_that_it_names_no_job(tmp_path):
    """The previous format had no job id: refused, not misread (nor guessed to be this job's)."""
    payload = msgpack.packb({**SNAP, "num_servers": 1}, use_bin_type=True)
    header = {"format": FORMAT, "version": 2, "checkpoint": 1, "step": 10, "server": 0, "num_servers": 1,
              "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    path = path_for(str(tmp_path), 0)
    with open(path, "wb") as f:
        f.write(msgpack.packb(header, use_bin_type=True) + payload)
    d, = servers(tmp_path, 1)
    entry, = d.inventory(verify=True)
    assert f"{path} has server checkpoint version 2, which does not name the job that wrote it; this " \
           "kvstore reads version 3 and refuses it" in entry.error
    with pytest.raises(CheckpointError, match="no complete checkpoint .*version 2, which does not name"):
        choose([d.inventory(verify=True)])
    save_set([d], 1, 5)                              # a fresh start in that directory replaces it
    assert load(path)["job"] == JOB


def test_temporaries_of_a_killed_save_go_at_the_servers_next_commit(tmp_path):
    dirs = servers(tmp_path)
    save_set(dirs, 1, 10)
    killed_while_writing(part_path(str(tmp_path), 0, 2), nbytes=100000)
    killed_while_writing(part_path(str(tmp_path), 1, 2), nbytes=100000)
    left = sorted(n for n in os.listdir(tmp_path) if n.startswith("."))
    assert [n.split(".part-")[0] for n in left] == [".server-0.ckpt-2", ".server-1.ckpt-2"]
    for d in dirs:
        d.write_part(3, 30, SNAP)
    dirs[0].commit(3)           # server 0's temporaries go; server 1's are its own business
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith(".")) == left[1:]
    dirs[1].commit(3)
    assert sorted(os.listdir(tmp_path)) == ["server-0.ckpt", "server-1.ckpt"]
