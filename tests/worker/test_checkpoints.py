"""kvstore.worker.checkpoints on its own: :class:`Checkpoints` made the way DistStore
makes it (a real :class:`~kvstore.worker.client.Client`, the job member's collective
call, its ``fail``, the client's ``flush``) against in-process servers with a
checkpoint directory (tests/cluster.py, tests/worker/client_job.py), and
:func:`checkpoint_meta` (pure).

Pinned from its docstring: a save is collective and every server writes, then
commits, the same new id (above every id on disk); the leading worker's automatic
checkpoint comes right after a pull once the interval passed, with the pulls
counted as its step; with ``--resume`` the leader has every server restore the
newest complete set and every worker reads its metadata; no complete set is a
CheckpointError naming the directory, and the job is aborted naming it too; meta
is converted to what a checkpoint holds or refused naming the culprit.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvstore.errors import CheckpointError, InvalidArgumentError
from kvstore.protocol import ops
from kvstore.transport.links import RequestOptions
from kvstore.worker.checkpoints import Checkpoints, checkpoint_meta

from client_job import Job

pytestmark = pytest.mark.timeout(60)

F32 = np.float32


@pytest.fixture
def start(make_cluster):
    """``start(workers, configure=True, **cluster settings)`` -> (job, [Checkpoints per
    rank]): a job of 2 servers over tcp, configured in sync mode unless told not to
    (a resume comes first); every job is closed at the end (``start.close(job)``:
    before)."""
    started: list = []
    closed: list = []

    def make(workers: int = 1, configure: bool = True, **settings):
        job = Job(make_cluster(workers, 2, transport="tcp", data_channel=False, **settings), {})
        started.append(job)
        if configure:
            job.clients[0].request_all(ops.CONFIGURE, "configuring the servers", mode="sync", num_workers=workers)
        made = []
        for rank, (member, client, config) in enumerate(zip(job.members, job.clients, job.configs)):
            made.append(Checkpoints(client, lambda rank=rank: rank == 0, config,
                                    lambda token, member=member: member.collective(token),
                                    lambda reason, rank=rank: job.fail(rank, reason), client.flush))
        return job, made

    def close(job) -> None:
        job.close()
        closed.append(job)
    make.close = close          # type: ignore[attr-defined]
    yield make
    for job in started:
        if job not in closed:
            job.close()


def inventories(client) -> list:
    """Each server's committed checkpoint ids and steps."""
    replies = client.request_all(ops.CHECKPOINT_LIST, "listing the servers' checkpoints", verify=False)
    return [sorted((f["id"], f["step"]) for f in r["files"] if f["committed"]) for r in replies]


def init(client, key, values) -> None:
    ids = [client.request(s, ops.INIT, f"init of {key}", [np.asarray(values, F32)], chunks=[[key, s]])[0]
           for s in (0, 1)]
    client.wait(ids, f"init of {key}")


def pull(client, key, size: int) -> list:
    outs = [np.zeros(size, F32), np.zeros(size, F32)]
    ids = [client.request(s, ops.PULL, f"pull of {key}", (), RequestOptions(into=[outs[s]]), chunks=[[key, s]])[0]
           for s in (0, 1)]
    client.wait(ids, f"pull of {key}")
    return [o.tolist() for o in outs]


def test_a_save_is_collective_and_every_server_commits_the_same_new_id(start, tmp_path):
    job, (c0, c1) = start(2, checkpoint_dir=str(tmp_path))
    done = threading.Event()

    def other():                        # not the leader: returns once the leader's save is done
        c1.save({"epoch": 1})
        done.set()
    t = threading.Thread(target=other)
    t.start()
    c0.save({"epoch": 1})
    t.join(30)
    assert done.is_set()
    assert inventories(job.clients[0]) == [[(1, 0)], [(1, 0)]]
    t = threading.Thread(target=c1.save, args=(None,))
    t.start()
    c0.save(None)
    t.join(30)
    assert inventories(job.clients[0]) == [[(2, 0)], [(2, 0)]]      # a new id, committed on both


def test_the_leaders_automatic_checkpoint_comes_after_a_pull_with_the_pulls_as_its_step(start, tmp_path):
    job, (c0,) = start(1, checkpoint_dir=str(tmp_path), checkpoint_interval=1e-9)
    c0.pulled()
    c0.pulled()
    assert inventories(job.clients[0]) == [[(2, 2)], [(2, 2)]]   # the second pull's, committed over the first's
    job, (c0,) = start(1, checkpoint_dir=str(tmp_path / "never"), checkpoint_interval=0)
    c0.pulled()
    assert inventories(job.clients[0]) == [[], []]          # interval 0: no automatic checkpoints


def test_a_resume_restores_the_newest_complete_set_on_every_server_and_reads_its_meta(start, tmp_path):
    job, (c0,) = start(1, checkpoint_dir=str(tmp_path))
    init(job.clients[0], "w", [1, 2, 3])
    c0.save({"epoch": 3, "note": "first"})
    start.close(job)                                        # (its servers let go of the directory)
    job, (c0,) = start(1, configure=False, checkpoint_dir=str(tmp_path), resume=True)
    assert not c0.resumed
    c0.resume()
    assert c0.resumed and c0.meta == {"epoch": 3, "note": "first"}
    job.clients[0].request_all(ops.CONFIGURE, "configuring the servers", mode="sync", num_workers=1)
    assert pull(job.clients[0], "w", 3) == [[1, 2, 3], [1, 2, 3]]
    c0.save(None)                                           # the next id is above the restored one
    assert inventories(job.clients[0]) == [[(2, 0)], [(2, 0)]]


def test_a_resume_without_a_complete_set_raises_naming_the_directory_and_aborts_the_job(start, tmp_path):
    job, (c0,) = start(1, configure=False, checkpoint_dir=str(tmp_path), resume=True)
    with pytest.raises(CheckpointError, match=f"cannot resume: no complete checkpoint in {tmp_path}"):
        c0.resume()
    start.close(job)
    job.cluster.close()                                     # waits for the scheduler and the servers
    assert job.cluster.server_codes == [1, 1]               # the job was aborted: the servers end with 1


def test_without_resume_a_resume_does_nothing(start, tmp_path):
    job, (c0,) = start(1, configure=False, checkpoint_dir=str(tmp_path))
    c0.resume()
    assert not c0.resumed and c0.meta == {}


# -- meta ----------------------------------------------------------------------------------
def test_meta_becomes_what_a_checkpoint_holds():
    meta = {"epoch": np.int64(3), "loss": np.float32(0.5), "shape": (2, 3), "nested": {"ok": [np.bool_(True)]},
            "raw": b"\x00", "none": None}
    assert checkpoint_meta(meta) == {"epoch": 3, "loss": 0.5, "shape": [2, 3], "nested": {"ok": [True]},
                                     "raw": b"\x00", "none": None}
    assert type(checkpoint_meta(meta)["epoch"]) is int
    assert checkpoint_meta(None) == {}


@pytest.mark.parametrize("meta, message", [
    ([1, 2], "save_checkpoint: meta must be a dict, got list"),
    ({"w": np.zeros(2)}, "save_checkpoint: meta['w'] is a ndarray (use .tolist()); meta may hold str, int"),
    ({"a": {"b": [object()]}}, "save_checkpoint: meta['a']['b'][0] is a object;"),
    ({"t": np.datetime64("2026-01-01")}, "save_checkpoint: meta['t'] is a datetime64;"),
    ({"big": 1 << 70}, "save_checkpoint: meta cannot be stored: "),
])
def test_meta_a_checkpoint_cannot_hold_is_refused_naming_where_it_is(meta, message):
    with pytest.raises(InvalidArgumentError) as e:
        checkpoint_meta(meta)
    assert str(e.value).startswith(message), str(e.value)
