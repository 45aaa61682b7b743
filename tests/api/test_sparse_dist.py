"""Row-sparse keys on dist_sync / dist_async (real sockets, in-process cluster) and
on the ``local`` store: expected values are formulas in rank and size, lazy
optimizer updates match scalar references row by row, bad input changes nothing."""

import numpy as np
import pytest
import torch

import kvstore
from kvstore import RowInit, RowSparse
from kvstore import optimizer as opt
from kvstore.errors import ArgumentTypeError, InvalidArgumentError

from optimizer_refs import ref_adam, ref_sgd

pytestmark = pytest.mark.timeout(120)

R, D = 50, 3


def rows_of(rank, step, workers):
    """Rows worker ``rank`` pushes at ``step``: unsorted, with a duplicate, and
    overlapping other workers' rows; rank 1 pushes nothing at step 1."""
    if rank == 1 and step == 1:
        return np.zeros(0, np.int64)
    base = (7 * rank + 3 * step) % R
    return np.array([(base + 11) % R, base, (base + 11) % R, (base + 2 * workers) % R], np.int64)


def push_of(rank, step, workers):
    rows = rows_of(rank, step, workers)
    data = np.stack([np.full(D, (rank + 1) * (step + 1) + i, np.float32) for i in range(len(rows))]) \
        if len(rows) else np.zeros((0, D), np.float32)
    return RowSparse(data, rows, (R, D))


def merged(step, workers):
    """The round's merged gradient as a dense (R, D) float64 array and its row set."""
    dense = np.zeros((R, D))
    touched = set()
    for r in range(workers):
        g = push_of(r, step, workers)
        np.add.at(dense, g.indices, g.data.astype(np.float64))
        touched |= set(g.indices.tolist())
    return dense, touched


def initial():
    w = np.zeros((R, D), np.float32)
    RowInit("uniform", 1.0, (R, D), seed=5).fill(w, np.arange(R))
    return w


def reference(workers, steps, step_fn, hp, lr):
    """Lazy updates: only the merged rows of a round and their state change; t counts rounds."""
    w = initial().astype(np.float64)
    states = [[{} for _ in range(D)] for _ in range(R)]
    for step in range(steps):
        dense, touched = merged(step, workers)
        for row in touched:
            for c in range(D):
                w[row, c], states[row][c] = step_fn(w[row, c], dense[row, c], states[row][c], step + 1, lr, hp)
    return w


def train(kv, steps, optimizer=None):
    kv.init("emb", RowInit("uniform", 1.0, (R, D), seed=5))
    if optimizer is not None:
        kv.set_optimizer(optimizer)
    for step in range(steps):
        kv.push("emb", push_of(kv.rank, step, kv.num_workers))
    out = np.empty((R, D), np.float32)
    kv.row_sparse_pull("emb", out=out, row_ids=np.arange(R)[::-1].copy())
    return out


@pytest.mark.parametrize("workers, servers", [(1, 1), (2, 2), (3, 2)])
def test_sync_without_optimizer_assigns_merged_rows_and_keeps_the_others(make_cluster, workers, servers):
    cluster = make_cluster(workers, servers)
    expected = initial()
    for step in range(3):
        dense, touched = merged(step, workers)
        for row in touched:
            expected[row] = dense[row]
    for out in cluster.run(lambda kv: train(kv, 3)):
        np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("name, make, step_fn, hp", [
    ("sgd", lambda: opt.SGD(learning_rate=0.1, wd=0.01), ref_sgd, {"wd": 0.01}),
    ("momentum", lambda: opt.SGD(learning_rate=0.1, momentum=0.9, wd=0.01), ref_sgd,
     {"momentum": 0.9, "wd": 0.01}),
    ("adam", lambda: opt.Adam(learning_rate=0.01), ref_adam, {}),
])
def test_sync_lazy_updates_match_the_row_by_row_reference(make_cluster, name, make, step_fn, hp):
    workers, steps = 2, 4
    lr = 0.01 if name == "adam" else 0.1
    expected = reference(workers, steps, step_fn, hp, lr)
    for out in make_cluster(workers, 2).run(lambda kv: train(kv, steps, make())):
        np.testing.assert_allclose(out, expected, rtol=2e-5, atol=1e-6)
    local = kvstore.create("local")
    local_out = train(local, 0, None)   # the oracle: one process pushing every worker's rows as a list
    local.set_optimizer(make())
    for step in range(steps):
        local.push("emb", [push_of(r, step, workers) for r in range(workers)])
    local.row_sparse_pull("emb", out=local_out, row_ids=np.arange(R))
    np.testing.assert_allclose(local_out, expected, rtol=2e-5, atol=1e-6)


def test_async_applies_each_push_on_arrival(make_cluster):
    workers, steps, lr = 3, 3, 0.5

    def job(kv):
        out = train(kv, steps, opt.SGD(learning_rate=lr))
        kv.barrier()
        kv.row_sparse_pull("emb", out=out, row_ids=np.arange(R))
        return out

    expected = initial().astype(np.float64)
    for step in range(steps):
        expected -= lr * merged(step, workers)[0]      # plain SGD: order does not matter
    for out in make_cluster(workers, 2).run(job, store_type="dist_async"):
        np.testing.assert_allclose(out, expected, rtol=1e-5)


def test_pull_into_rowsparse_and_dense_outs_and_torch_gradients(make_cluster):
    def job(kv):
        kv.init("e", RowSparse(np.arange(12, dtype=np.float32).reshape(4, 3), np.array([9, 0, 5, 2]), (10, 3)))
        sparse_out = RowSparse.zeros((10, 3))
        dense_out = np.full((10, 3), 7, np.float32)
        kv.row_sparse_pull("e", out=[sparse_out, dense_out], row_ids=[np.array([[5, 9], [5, 1]]), [2]])
        emb = torch.nn.Embedding(10, 3, sparse=True)
        emb(torch.tensor([5, 5, 1])).sum().backward()
        kv.push("e", emb.weight.grad)                    # uncoalesced COO: row 5 twice
        after = torch.zeros(10, 3)
        kv.row_sparse_pull("e", out=after, row_ids=torch.tensor([1, 5, 9]))
        return sparse_out, dense_out, after

    w = kvstore.create("local")
    for sparse_out, dense_out, after in make_cluster(2, 3).run(job):
        assert sparse_out.indices.tolist() == [1, 5, 9]
        assert sparse_out.data.tolist() == [[0, 0, 0], [6, 7, 8], [0, 1, 2]]
        assert dense_out[2].tolist() == [9, 10, 11] and not dense_out[[0, 1, 3, 4, 5, 6, 7, 8, 9]].any()
        assert after[5].tolist() == [4, 4, 4] and after[1].tolist() == [2, 2, 2]   # 2 workers' sums
        assert after[9].tolist() == [0, 1, 2] and not after[0].any()
    w.close()


def test_bad_input_names_the_key_and_changes_nothing(make_cluster):
    def job(kv):
        kv.init("e", RowSparse.zeros((6, 2)))
        kv.init("dense", np.zeros(4, np.float32))
        errors = []
        for call in (
            lambda: kv.push("e", RowSparse(np.ones((1, 2), np.float32), np.array([6]), (6, 2))),
            lambda: kv.push("e", RowSparse(np.ones((2, 2), np.float32), np.array([1, -1]), (6, 2))),
            lambda: kv.push("e", RowSparse(np.ones((1, 2), np.float64), np.array([1]), (6, 2))),
            lambda: kv.push("e", [RowSparse(np.ones((1, 2), np.float32), np.array([1]), (6, 2)),
                                  RowSparse(np.ones((1, 2), np.float32), np.array([9]), (6, 2))]),
            lambda: kv.row_sparse_pull("e", out=RowSparse.zeros((6, 2)), row_ids=[0, 6]),
            lambda: kv.row_sparse_pull("e", out=RowSparse.zeros((6, 2)), row_ids=np.array([0.5])),  # whole floats pass
            lambda: kv.row_sparse_pull("dense", out=np.zeros(4, np.float32), row_ids=[0]),
            lambda: kv.pull("e", out=np.zeros((6, 2), np.float32)),
            lambda: kv.push("dense", RowSparse(np.ones((1, 4), np.float32), np.array([0]), (1, 4))),
        ):
            with pytest.raises((InvalidArgumentError, ArgumentTypeError)) as info:
                call()
            errors.append(str(info.value))
        out = np.full((6, 2), 3, np.float32)
        kv.row_sparse_pull("e", out=out, row_ids=np.arange(6))
        return errors, out

    for errors, out in make_cluster(2, 2).run(job):
        assert not out.any()                      # nothing was pushed
        assert all("'e'" in e or "'dense'" in e for e in errors), errors
        assert "row id 6" in errors[0] and "row id -1" in errors[1] and "float64" in errors[2]
        assert "row id 9" in errors[3] and "row id 6" in errors[4]


def test_a_push_moves_bytes_in_proportion_to_its_rows_not_the_table(make_cluster):
    def job(kv):
        kv.init("big", RowInit("zeros", 0, (2_000_000, 16)))   # 128 MB on the servers
        before = kv.comm_stats()["bytes_sent"]
        rows = np.arange(0, 2_000_000, 20_000)            # 100 rows
        kv.push("big", RowSparse(np.ones((100, 16), np.float32), rows, (2_000_000, 16)))
        out = RowSparse.zeros((2_000_000, 16))
        kv.row_sparse_pull("big", out=out, row_ids=rows)
        stats = kv.comm_stats()
        return stats["bytes_sent"] - before, stats["bytes_received"], out

    for sent, received, out in make_cluster(2, 2).run(job):
        assert sent < 100 * 16 * 4 * 3 and received < 100 * 16 * 4 * 3 + 1_000_000
        assert out.data.shape == (100, 16) and (out.data == 2).all()


def test_optimizer_states_of_a_row_sparse_key_save_and_load_across_store_types(make_cluster, tmp_path):
    """The servers' shards (rows interleaved over servers) come back as one state per
    key, equal to the local oracle's; loading them back changes nothing."""
    workers, steps = 2, 3
    make = lambda: opt.SGD(learning_rate=0.1, momentum=0.9)
    local = kvstore.create("local")
    train(local, 0)
    local.set_optimizer(make())
    for step in range(steps):
        local.push("emb", [push_of(r, step, workers) for r in range(workers)])
    local.save_optimizer_states(str(tmp_path / "local.states"))

    def job(kv):
        out = train(kv, steps, make())
        path = str(tmp_path / f"dist{kv.rank}.states")
        kv.save_optimizer_states(path)
        kv.load_optimizer_states(path)
        kv.push("emb", push_of(kv.rank, steps, workers))
        kv.row_sparse_pull("emb", out=out, row_ids=np.arange(R))
        return path, out

    from kvstore.worker import states_file
    _, want = states_file.load(str(tmp_path / "local.states"))
    local.push("emb", [push_of(r, steps, workers) for r in range(workers)])
    expected = np.empty((R, D), np.float32)
    local.row_sparse_pull("emb", out=expected, row_ids=np.arange(R))
    for path, out in make_cluster(workers, 3).run(job):
        _, got = states_file.load(path)
        assert got["emb"]["t"] == want["emb"]["t"] == steps
        np.testing.assert_allclose(got["emb"]["state"][0], want["emb"]["state"][0], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
        local.load_optimizer_states(path)              # the servers' file loads into 'local'
