"""Uneven shards: a worker that finishes (closes its store) while the others' sync
rounds still wait for its pushes makes them fail within seconds, naming it and
saying why, instead of waiting for KVSTORE_TIMEOUT and blaming themselves; and
``kvstore.torch.shard`` gives every worker the same number of items."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvstore.errors import KVStoreError
from kvstore.protocol import ops
from state_driver import A, Server, expect_error, expect_ok, only, peer, vec

STEPS = {0: 4, 1: 2}     # worker 1 has fewer batches than worker 0


@pytest.mark.parametrize("style", ["pushpull", "push-pull"])
def test_a_worker_that_finishes_early_is_named_within_seconds(make_cluster, style):
    cluster = make_cluster(2, 2, timeout=60.0)

    def train(kv):
        kv.init("w", np.zeros(5, np.float32))
        out = np.empty(5, np.float32)
        for step in range(STEPS[kv.rank]):
            started = time.monotonic()
            try:
                if style == "pushpull":
                    kv.pushpull("w", np.ones(5, np.float32), out=out)
                else:
                    kv.push("w", np.ones(5, np.float32))
                    kv.pull("w", out=out)
            except KVStoreError as e:
                return step, time.monotonic() - started, str(e)
            assert out[0] == 2.0            # both workers' pushes, while both push
        return "done"

    outcome = cluster.run_each(train)
    assert outcome[1] == "done"
    step, waited, message = outcome[0]
    assert step == 2                        # the first step worker 1 does not take
    assert waited < 15, f"waited {waited:.1f}s (KVSTORE_TIMEOUT is 60s)"
    assert "worker 1 closed its store while round 3 of key 'w'" in message, message
    assert "every worker must take the same number of steps" in message
    assert "kvstore.torch.shard" in message


def test_state_fails_the_rounds_a_finished_worker_will_not_join():
    srv = Server(num_workers=3, init={A: vec(0, 0)})
    for src in range(3):                                   # round 1: everybody
        srv.push(src, {A: vec(1, 1)})
    pid0, r = srv.push(0, {A: vec(2, 2)})                  # round 2: 0 and 2 push...
    assert r == []
    pid2, r = srv.push(2, {A: vec(2, 2)}, op=ops.PUSHPULL)
    assert r == []
    pull0, r = srv.pull(0, [A])                            # ...and 0 reads its own round
    assert r == []
    replies = srv.state.workers_finished({1})              # ...but worker 1 finished
    assert {rep.header["id"] for rep in replies} == {pid0, pid2, pull0}
    for rep in replies:
        src = 2 if rep.header["id"] == pid2 else 0
        expect_error(rep, peer(src), rep.header["id"], "RemoteError",    # a round they depended on
                     "worker 1 closed its store while round 2 of key 'w' (chunk 0)")
    assert srv.state.workers_finished({1}) == []            # told again: nothing new
    pid, r = srv.push(2, {A: vec(3, 3)})                    # a later push fails at once
    expect_error(only(r), peer(2), pid, "InvalidArgumentError", "worker 1 closed its store while round 2")
    np.testing.assert_array_equal(srv.value(A), vec(3, 3))  # round 1 stays; nothing else applied


def test_async_mode_is_not_affected_by_a_finished_worker():
    from state_driver import sgd
    srv = Server(mode="async", num_workers=2, opt=sgd(learning_rate=1.0), init={A: vec(0, 0)})
    assert srv.state.workers_finished({1}) == []
    pid, r = srv.push(0, {A: vec(1, 1)})
    expect_ok(only(r), peer(0), pid)


class FakeStore:
    """What shard() reads of a store: rank, and the members (0 .. n-1, or an
    elastic job's ranks with gaps)."""
    def __init__(self, rank, num_workers, members=None):
        self.rank, self.num_workers = rank, num_workers
        self.members = tuple(range(num_workers)) if members is None else tuple(members)


def test_shard_in_an_elastic_job_goes_by_the_place_among_the_members():
    torch_helpers = pytest.importorskip("kvstore.torch")
    members = (0, 2, 5)                                   # ranks 1, 3 and 4 left
    shards = [list(torch_helpers.shard(10, FakeStore(r, 3, members))) for r in members]
    assert shards == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]


@pytest.mark.parametrize("n, workers", [(10, 3), (9, 3), (2, 3), (0, 2), (100, 1)])
def test_shard_gives_every_worker_as_many_items_and_drops_the_rest(n, workers):
    torch_helpers = pytest.importorskip("kvstore.torch")
    shards = [list(torch_helpers.shard(n, FakeStore(r, workers))) for r in range(workers)]
    assert {len(s) for s in shards} == {n // workers}
    every = sorted(i for s in shards for i in s)
    assert len(set(every)) == len(every) and all(0 <= i < n for i in every)
    assert len(every) == n - n % workers
    assert list(torch_helpers.shard(list(range(n)), FakeStore(0, workers))) == shards[0]   # a sized object


@pytest.mark.parametrize("n, workers", [(10, 3), (9, 3), (100, 4)])
def test_contiguous_and_reshuffled_shards_partition_the_items_alike(n, workers):
    """contiguous: one block per worker (streams with carried state); shuffle: one
    permutation per (seed, epoch), the same on every worker, a new one each epoch."""
    torch_helpers = pytest.importorskip("kvstore.torch")
    blocks = [list(torch_helpers.shard(n, FakeStore(r, workers), contiguous=True)) for r in range(workers)]
    assert [b for block in blocks for b in block] == list(range(n // workers * workers))
    for contiguous in (False, True):
        epochs = []
        for epoch in (0, 1):
            shards = [torch_helpers.shard(n, FakeStore(r, workers), shuffle=True, epoch=epoch,
                                          contiguous=contiguous) for r in range(workers)]
            every = [i for s in shards for i in s]
            assert len(set(every)) == len(every) == n // workers * workers and all(0 <= i < n for i in every)
            assert shards == [torch_helpers.shard(n, FakeStore(r, workers), shuffle=True, epoch=epoch,
                                                  contiguous=contiguous) for r in range(workers)]
            epochs.append(shards)
        assert epochs[0] != epochs[1]                    # reshuffled each epoch


def test_kvstore_torch_lists_only_its_public_names():
    torch_helpers = pytest.importorskip("kvstore.torch")
    assert dir(torch_helpers) == ["BUCKETS_PER_MODEL", "DEFAULT_BUCKET_BYTES", "MIN_BUCKET_BYTES",
                                  "ShardedEmbedding", "Trainer", "bucket_bytes_for", "optimizer_from_torch",
                                  "shard"]
