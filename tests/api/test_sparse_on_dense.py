"""Row-sparse values pushed to dense keys (how a dense weight with sparse gradients
trains in MXNet): without an optimizer the sum is assigned densely (zeros outside its
rows), as MXNet's KVStore copies it; with one the update is MXNet's lazy_update
(SGD's default: only the rows named move, tests/optimizer/test_lazy_update.py has
MXNet's numbers), under every store type and with compression; the 'local' store,
fed every worker's values as one list, is the oracle."""

import numpy as np
import pytest
import torch

import kvstore
from kvstore import RowSparse
from kvstore import optimizer as opt
from kvstore.errors import InvalidArgumentError

SHAPE = (6, 3)


def sparse_grad(rank: int, step: int) -> RowSparse:
    rows = np.array([rank, 4, rank + 1, 4])                  # a duplicate row: summed
    data = np.arange(12, dtype=np.float32).reshape(4, 3) * (rank + 1) + step
    return RowSparse(data, rows, SHAPE)


def torch_grad(rank: int) -> torch.Tensor:
    emb = torch.nn.Embedding(*SHAPE, sparse=True)
    torch.nn.init.ones_(emb.weight)
    emb(torch.tensor([rank, 5, 5])).sum().backward()         # uncoalesced indices
    return emb.weight.grad


def dense(value) -> np.ndarray:
    return value.to_dense().numpy() if isinstance(value, torch.Tensor) else value.todense()


@pytest.mark.parametrize("store_type", ["local", "device"])
def test_one_process_stores_sum_sparse_values_densely(store_type):
    kv = kvstore.create(store_type)
    kv.init(3, np.zeros(SHAPE, np.float32))
    values = [sparse_grad(0, 1), torch_grad(1), np.ones(SHAPE, np.float32)]
    kv.push(3, values)                                       # no optimizer: the sum is assigned
    out = np.empty(SHAPE, np.float32)
    kv.pull(3, out=out)
    np.testing.assert_array_equal(out, dense(values[0]) + dense(values[1]) + 1)
    kv.pushpull(3, sparse_grad(1, 0), out=out)
    np.testing.assert_array_equal(out, dense(sparse_grad(1, 0)))
    with pytest.raises(InvalidArgumentError, match="row-sparse value and no out="):
        kv.pushpull(3, sparse_grad(1, 0))
    with pytest.raises(InvalidArgumentError, match=r"row id 6 is out of range"):
        kv.push(3, RowSparse(np.ones((1, 3), np.float32), np.array([6]), SHAPE))
    with pytest.raises(InvalidArgumentError, match="cannot be an output"):
        kv.pull(3, out=RowSparse.zeros(SHAPE))
    kv.pull(3, out=out)
    np.testing.assert_array_equal(out, dense(sparse_grad(1, 0)))   # the refused calls changed nothing


def reference(compression, optimizer, workers: int, steps: int) -> np.ndarray:
    """What every worker of a dist_sync job must see: the local store, fed every
    worker's values of a step as one list (summed in the order the servers sum them;
    with compression, each value quantised on its own as a worker's push is)."""
    kv = kvstore.create("local")
    if compression:
        kv.set_gradient_compression(compression)
    kv.init(3, np.full(SHAPE, 0.5, np.float32))
    if optimizer:
        kv.set_optimizer(optimizer)
    for step in range(steps):
        kv.push(3, [sparse_grad(r, step) for r in range(workers)])
    out = np.empty(SHAPE, np.float32)
    kv.pull(3, out=out)
    return out


LAZY = opt.SGD(learning_rate=0.1, momentum=0.9, wd=0.1)      # rows 3 and 5 are never pushed: they keep 0.5


@pytest.mark.parametrize("compression, optimizer", [
    (None, None), (None, opt.SGD(learning_rate=0.1, momentum=0.9)), ({"type": "fp16"}, None), (None, LAZY),
    ({"type": "fp16"}, LAZY), (None, opt.SGD(learning_rate=0.1, momentum=0.9, wd=0.1, lazy_update=False))])
def test_dist_sync_sums_sparse_values_of_every_worker_densely(make_cluster, compression, optimizer):
    def job(kv):
        if compression:
            kv.set_gradient_compression(compression)
        kv.init(3, np.full(SHAPE, 0.5, np.float32))
        if optimizer:
            kv.set_optimizer(optimizer)
        out = np.empty(SHAPE, np.float32)
        for step in range(3):
            kv.push(3, sparse_grad(kv.rank, step))
            kv.pull(3, out=out)
        return out

    want = reference(compression, optimizer, 2, 3)
    # rows nobody pushed: assigned zeros without an optimizer, kept by a lazy update or
    # without weight decay, decayed by a dense one
    kept = optimizer is not None and (optimizer.wd == 0 or optimizer.lazy_update)
    assert np.all(want[[3, 5]] == 0.5) == kept and np.all(want[[3, 5]] == 0) == (optimizer is None)
    for out in make_cluster(2, 2, chunk_bytes=32).run(job):
        np.testing.assert_allclose(out, want, rtol=1e-6)


def test_dist_2bit_compression_of_a_sparse_value_matches_the_dense_push(make_cluster):
    """2-bit compression quantises the dense-made gradient exactly as a dense push of it."""
    comp = {"type": "2bit", "threshold": 2.0}

    def job(kv):
        kv.set_gradient_compression(comp)
        kv.init(["s", "d"], [np.zeros(SHAPE, np.float32)] * 2)
        out_s, out_d = np.empty(SHAPE, np.float32), np.empty(SHAPE, np.float32)
        for step in range(3):
            g = sparse_grad(kv.rank, step)
            kv.push(["s", "d"], [g, g.todense()])
            kv.pull(["s", "d"], out=[out_s, out_d])
        return out_s, out_d

    for s, d in make_cluster(2, 1).run(job):
        np.testing.assert_array_equal(s, d)
        assert s.any()


def test_dist_async_with_torch_sparse_gradients(make_cluster):
    def job(kv):
        kv.init(3, np.zeros(SHAPE, np.float32))
        kv.set_optimizer(opt.SGD(learning_rate=1.0))
        kv.push(3, torch_grad(kv.rank))
        kv.barrier()
        out = np.empty(SHAPE, np.float32)
        kv.pull(3, out=out)
        return out

    want = -(dense(torch_grad(0)) + dense(torch_grad(1)))
    for out in make_cluster(2, 2, chunk_bytes=32).run(job, store_type="dist_async"):
        np.testing.assert_allclose(out, want, rtol=1e-6)


def test_dist_device_sync_and_pushpull_sum_sparse_values_densely(make_cluster):
    def job(kv):
        kv.init(3, np.full(SHAPE, 0.5, np.float32))
        out = np.empty(SHAPE, np.float32)
        for step in range(2):
            kv.pushpull(3, sparse_grad(kv.rank, step), out=out)
        return out

    want = reference(None, None, 2, 2)
    for out in make_cluster(2, 2, chunk_bytes=32).run(job, store_type="dist_device_sync"):
        np.testing.assert_array_equal(out, want)


def test_pull_with_ignore_sparse_false_reads_every_row_of_a_row_sparse_key(make_cluster):
    """MXNet's ``pull(..., ignore_sparse=False)`` reads a row-sparse key whole; with
    the default (True) MXNet skips it silently, which is an error here."""
    def job(kv):
        kv.init(["t", "d"], [RowSparse.zeros(SHAPE), np.zeros(4, np.float32)])
        kv.push(["t", "d"], [sparse_grad(0, 1), np.ones(4, np.float32)])
        full, sparse_out, d = np.empty(SHAPE, np.float32), RowSparse.zeros(SHAPE), np.empty(4, np.float32)
        kv.pull(["t", "d"], out=[[full, sparse_out], d], ignore_sparse=False)
        with pytest.raises(InvalidArgumentError, match="row_sparse_pull"):
            kv.pull("t", out=full)
        with pytest.raises(kvstore.ArgumentTypeError, match="ignore_sparse must be True or False"):
            kv.pull("d", out=d, ignore_sparse=0)
        return full, sparse_out.todense(), d

    want = dense(sparse_grad(0, 1)) * 2
    for full, from_sparse, d in make_cluster(2, 2, chunk_bytes=32).run(job):
        np.testing.assert_array_equal(full, want)
        np.testing.assert_array_equal(from_sparse, want)
        np.testing.assert_array_equal(d, 2)
