"""kvstore.server.checkpoint: a server's checkpoint files (two phases, checksums)
and the choice of the set a resume restores, in every state a crash can leave."""

import os

import msgpack
import pytest

from kvstore.errors import CheckpointError
from kvstore.server.checkpoint import CheckpointDir, Entry, choose, load, part_path, path_for

SNAP = {"server": "server 0", "mode": "sync", "num_workers": 2, "optimizer": None, "meta": {},
        "chunks": [["w", 0, "<f4", b"\0" * 64, None, []]]}


def servers(tmp_path, n=2):
    return [CheckpointDir(str(tmp_path), rank, n) for rank in range(n)]


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
    snap = dirs[1].load(2)
    assert (snap["checkpoint"], snap["step"], snap["meta"], snap["num_servers"]) == (2, 20, {"step": 20}, 2)
    assert load(path_for(str(tmp_path), 0))["meta"] == {"step": 20}


def test_a_crash_between_the_commits_resumes_the_new_set_everywhere(tmp_path):
    dirs = servers(tmp_path)
    save_set(dirs, 1, 10)
    save_set(dirs, 2, 20, commit=False)
    dirs[0].commit(2)                   # server 1 died before its commit: it still has its part
    choice = choose([d.inventory(verify=True) for d in dirs])
    assert (choice.id, choice.step) == (2, 20)
    assert dirs[1].load(2)["step"] == 20


def test_a_crash_in_phase_one_resumes_the_previous_set_everywhere(tmp_path):
    dirs = servers(tmp_path)
    save_set(dirs, 1, 10)
    dirs[0].write_part(2, 20, SNAP)     # server 1 never wrote its part; nobody committed
    assert choose([d.inventory(verify=True) for d in dirs]).id == 1
    assert dirs[0].load(1)["step"] == 10


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
    a = [[Entry("a", True, 3, 30)], [Entry("b", True, 3, 31)]]
    with pytest.raises(CheckpointError, match=r"disagree on its step \(\[30, 31\]\)"):
        choose(a)


def test_the_inventory_entries_survive_the_wire_and_malformed_ones_are_refused():
    e = Entry("/x/server-0.ckpt", True, 3, 30)
    assert Entry.from_wire(msgpack.unpackb(msgpack.packb(e.to_wire()))) == e
    for bad in (None, {"file": 1, "committed": True}, {"file": "f", "committed": True, "id": -1, "step": 0}):
        with pytest.raises(CheckpointError, match="malformed"):
            Entry.from_wire(bad)
