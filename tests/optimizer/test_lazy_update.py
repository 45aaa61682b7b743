"""MXNet's ``lazy_update`` (issue 44 item 2): a row-sparse gradient updates only the rows
it names (their weights, weight decay and optimizer state), by default, for SGD, Adam
and LARS; on a dense key too, where MXNet's KVStore hands the optimizer the row-sparse
sum. ``lazy_update=False`` updates every row (the gradient zero elsewhere), on dense and
on row-sparse keys. The numbers are MXNet 1.9.1's own (tests/data/mxnet_optimizers.json,
``kvstore_lazy``: its local KVStore fed the same pushes), checked through the ``local`` and
``device`` stores and dist_sync (keys cut mid-row over two servers, push and pushpull,
LARS's norms added up across servers), dist_async, and written-in pushpulls."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch

import kvstore
from kvstore import RowSparse, optimizer as opt
from kvstore.errors import ConfigError, InvalidArgumentError

DATA = json.loads((pathlib.Path(__file__).parents[1] / "data" / "mxnet_optimizers.json").read_text())["kvstore_lazy"]
SHAPE = tuple(DATA["shape"])
TOL = {"rtol": 1e-6, "atol": 2e-7}
ADAM_TOL = {"rtol": 2e-5, "atol": 1e-6}     # MXNet's Adam rounds 1 - beta to float32 (api.md)
LOCAL_STORES = ["local", "device"]


def _tol(case) -> dict:
    return ADAM_TOL if case["optimizer"] == "adam" else TOL


def _label(case) -> str:
    p = case["params"]
    extra = "-".join(k for k in ("rescale_grad", "momentum") if k in p)
    return f"{case['optimizer']}-lazy{p.get('lazy_update', True)}" + (f"-{extra}" if extra else "")


def _values(case, step: int, as_torch: bool = False) -> list:
    """The step's two row-sparse values (MXNet pushed them as one list: their sum)."""
    out = []
    for rows, data in case["pushes"][step]:
        data = np.array(data, np.float32).reshape(len(rows), SHAPE[1])
        if as_torch:             # nn.Embedding(sparse=True)'s kind: COO, rows as given
            out.append(torch.sparse_coo_tensor(torch.tensor([rows], dtype=torch.int64).reshape(1, -1),
                                               torch.from_numpy(data), SHAPE, check_invariants=True))
        else:
            out.append(RowSparse(data, np.array(rows, np.int64), SHAPE))
    return out


def _optimizer(case):
    return opt.create(case["optimizer"], **case["params"])


def _check(got: list, case) -> None:
    for k, (ours, theirs) in enumerate(zip(got, case["weights"])):
        np.testing.assert_allclose(ours, np.array(theirs, np.float32), err_msg=f"{_label(case)} step {k + 1}",
                                   **_tol(case))


# -- the optimizers' option ------------------------------------------------------------------

def test_lazy_update_is_mxnets_option_of_sgd_adam_and_lars():
    for name in ("sgd", "adam", "lars"):
        o = opt.create(name)
        assert o.lazy_update is True and o.to_config()["params"]["lazy_update"] is True
        off = opt.from_config({**o.to_config(), "params": {**o.to_config()["params"], "lazy_update": False}})
        assert (o.lazy_for(False), o.lazy_for(True)) == (True, True)
        assert (off.lazy_for(False), off.lazy_for(True)) == (False, False)
        with pytest.raises(ConfigError, match="lazy_update must be True or False"):
            opt.create(name, lazy_update=1)
    # MXNet's NAG (and every other optimizer) has no lazy_update: a dense key's update is
    # dense; a row-sparse key's stays lazy (this store's rule for every optimizer)
    for name in ("nag", "adagrad", "rmsprop", "signum", "ftrl"):
        with pytest.raises(ConfigError, match="lazy_update"):
            opt.create(name, lazy_update=True)
        o = opt.create(name)
        assert (o.lazy_for(False), o.lazy_for(True)) == (False, True)
    with pytest.raises(ConfigError, match="NAG: it has no lazy_update"):
        opt.NAG(lazy_update=True)


def test_the_fixture_shows_what_lazy_means():
    """MXNet's numbers themselves: after step 2 (rows 0, 1, 4, 5 pushed) rows 2 and 3
    are untouched by a lazy update, moved (weight decay, momentum) by a dense one."""
    for case in DATA["dense"]:
        w0, after = np.array(case["w0"]), np.array(case["weights"][1])
        moved = [r for r in range(SHAPE[0]) if np.any(after[r] != w0[r])]
        lazy = case["params"].get("lazy_update", True) and case["optimizer"] != "nag"
        assert moved == ([0, 1, 4, 5] if lazy else list(range(SHAPE[0]))), _label(case)


# -- one process -------------------------------------------------------------------------------

def _local_run(store: str, case, as_torch: bool = False, row_sparse_key: bool = False) -> list:
    with kvstore.create(store) as kv:
        w0 = np.array(case["w0"], np.float32)
        kv.init("emb", RowSparse.from_dense(w0) if row_sparse_key else w0)
        kv.set_optimizer(_optimizer(case))
        got = []
        for k in range(len(case["pushes"])):
            out = np.empty(SHAPE, np.float32)
            if row_sparse_key:
                kv.push("emb", _values(case, k))
                kv.row_sparse_pull("emb", out=out, row_ids=np.arange(SHAPE[0]))
            elif k % 2:
                kv.pushpull("emb", _values(case, k, as_torch), out=out)
            else:
                kv.push("emb", _values(case, k, as_torch))
                kv.pull("emb", out=out)
            got.append(out)
    return got


@pytest.mark.parametrize("store", LOCAL_STORES)
@pytest.mark.parametrize("case", DATA["dense"], ids=_label)
def test_row_sparse_pushes_on_a_dense_key_compute_mxnets_numbers(store, case):
    _check(_local_run(store, case), case)


@pytest.mark.parametrize("case", [c for c in DATA["dense"] if c["optimizer"] in ("sgd", "adam")][:3], ids=_label)
def test_torch_sparse_gradients_on_a_dense_key_are_lazy_too(case):
    _check(_local_run("local", case, as_torch=True), case)


@pytest.mark.parametrize("store", LOCAL_STORES)
@pytest.mark.parametrize("case", DATA["row_sparse"], ids=_label)
def test_row_sparse_keys_compute_mxnets_numbers_lazy_or_not(store, case):
    _check(_local_run(store, case, row_sparse_key=True), case)


def test_a_dense_value_in_the_push_makes_the_update_dense():
    """One of the values is dense (it names every row): MXNet sums a list whose first
    value is dense densely; here any dense value makes the push dense."""
    dense = next(c for c in DATA["dense"] if c["params"].get("lazy_update") is False and c["optimizer"] == "sgd")
    lazy = {k: v for k, v in dense["params"].items() if k != "lazy_update"}
    with kvstore.create("local") as kv:
        kv.init(0, np.array(dense["w0"], np.float32))
        kv.set_optimizer(opt.SGD(**lazy))
        for k in range(2):
            a, b = _values(dense, k)
            kv.push(0, [a, b.todense()])
        out = np.empty(SHAPE, np.float32)
        kv.pull(0, out=out)
    np.testing.assert_allclose(out, np.array(dense["weights"][1], np.float32), **TOL)


def test_dynamic_rows_refuse_lazy_update_false():
    spec = kvstore.DynamicRows(4)
    with kvstore.create("local") as kv:
        kv.init("d", spec)
        with pytest.raises(InvalidArgumentError, match=r"lazy_update=False.*key 'd' holds dynamic rows"):
            kv.set_optimizer(opt.SGD(lazy_update=False))
        kv.set_optimizer(opt.SGD())
    with kvstore.create("local") as kv:
        kv.set_optimizer(opt.Adam(lazy_update=False))
        with pytest.raises(InvalidArgumentError, match="key 'd' holds dynamic rows"):
            kv.init("d", spec)


# -- dist ---------------------------------------------------------------------------------------

def _dist_job(kv):
    """Every case on its own key: each worker pushes one of a step's two values (the
    servers' round sums them), alternately by push and pushpull; then the row-sparse
    keys' cases."""
    results = []
    for i, case in enumerate(DATA["dense"]):
        kv.init(i, np.array(case["w0"], np.float32))
        kv.set_optimizer(_optimizer(case))
        got = []
        for k in range(len(case["pushes"])):
            out = np.empty(SHAPE, np.float32)
            if k % 2:
                kv.pushpull(i, _values(case, k)[kv.rank], out=out)
            else:
                kv.push(i, _values(case, k)[kv.rank])
                kv.pull(i, out=out)
            got.append(out)
        results.append(got)
    for i, case in enumerate(DATA["row_sparse"]):
        key = 100 + i
        kv.init(key, RowSparse.from_dense(np.array(case["w0"], np.float32)))
        kv.set_optimizer(_optimizer(case))
        got = []
        for k in range(len(case["pushes"])):
            kv.push(key, _values(case, k)[kv.rank])
            out = np.empty(SHAPE, np.float32)
            kv.row_sparse_pull(key, out=out, row_ids=np.arange(SHAPE[0]))
            got.append(out)
        results.append(got)
    return results


def test_a_dist_sync_job_computes_mxnets_numbers(make_cluster):
    # 40-byte chunks: 10 values, so chunks begin and end inside rows of 4 and a key lies on
    # both servers (LARS adds up its norms across them; its step is lazy on each)
    cases = DATA["dense"] + DATA["row_sparse"]
    for got in make_cluster(2, 2, chunk_bytes=40).run(_dist_job, timeout=120):
        for ours, case in zip(got, cases):
            _check(ours, case)


def test_deterministic_sums_keep_each_rounds_rows(make_cluster):
    """Sums in rank order: a push that comes before a lower rank's is held, its rows
    counted in its round all the same."""
    cases = [c for c in DATA["dense"] if c["optimizer"] in ("sgd", "adam")][:3]

    def job(kv):
        results = []
        for i, case in enumerate(cases):
            kv.init(i, np.array(case["w0"], np.float32))
            kv.set_optimizer(_optimizer(case))
            got = []
            for k in range(len(case["pushes"])):
                out = np.empty(SHAPE, np.float32)
                kv.pushpull(i, _values(case, k)[kv.rank], out=out)
                got.append(out)
            results.append(got)
        return results

    for results in make_cluster(2, 2, chunk_bytes=40, deterministic=True).run(job):
        for got, case in zip(results, cases):
            _check(got, case)


def test_dist_async_updates_lazily(make_cluster):
    """Each push applied on arrival: one worker pushing a step's values one at a time
    is the local store fed the same pushes."""
    cases = [c for c in DATA["dense"] if c["optimizer"] in ("sgd", "adam")]

    def job(kv):
        results = []
        for i, case in enumerate(cases):
            kv.init(i, np.array(case["w0"], np.float32))
            kv.set_optimizer(_optimizer(case))
            for k in range(len(case["pushes"])):
                for value in _values(case, k):
                    kv.push(i, value)
            out = np.empty(SHAPE, np.float32)
            kv.pull(i, out=out)
            results.append(out)
        return results

    (got,) = make_cluster(1, 2, chunk_bytes=40).run(job, store_type="dist_async")
    with kvstore.create("local") as kv:
        want = job(kv)
    for ours, theirs, case in zip(got, want, cases):
        np.testing.assert_allclose(ours, theirs, err_msg=_label(case), **TOL)
        if case["params"].get("lazy_update", True):
            # row 3 is first pushed at step 4: until then a lazy update never moved it
            assert not np.array_equal(ours, np.array(case["w0"], np.float32))


def test_a_lazy_pushpull_is_not_written_in_but_a_dense_one_is(make_cluster):
    """Writing into a co-located server's sum names every value: a lazy push goes as a
    pushpull with its rows, the dense key of the same call is still written in."""
    cluster = make_cluster(2, 1, chunk_bytes=8192, zero_copy_bytes=4096, write_in=True, write_in_bytes=8192)
    shape = (1000, 4)
    w0 = np.linspace(-1, 1, 4000, dtype=np.float32).reshape(shape)

    def grads(rank: int, step: int):
        rows = np.array([rank, 500 + step, 999 - rank])
        sparse = RowSparse(np.full((3, 4), 0.5 * (rank + 1) + step, np.float32), rows, shape)
        return sparse, np.full(shape, 0.1 * (step + 1), np.float32)

    def job(kv):
        sent = []
        request = kv._client.request
        kv._client.request = lambda server, op, *a, **kw: (sent.append((op, "rows" in kw)),
                                                           request(server, op, *a, **kw))[1]
        kv.init(["lazy", "dense"], [w0, w0])
        kv.set_optimizer(opt.SGD(learning_rate=0.1, momentum=0.9, wd=0.1))
        outs = [np.empty(shape, np.float32), np.empty(shape, np.float32)]
        for step in range(3):
            kv.pushpull(["lazy", "dense"], list(grads(kv.rank, step)), out=outs)
        return outs, sent

    with kvstore.create("local") as kv:
        kv.init(["lazy", "dense"], [w0, w0])
        kv.set_optimizer(opt.SGD(learning_rate=0.1, momentum=0.9, wd=0.1))
        for step in range(3):
            both = [grads(0, step), grads(1, step)]
            kv.push(["lazy", "dense"], [[both[0][0], both[1][0]], [both[0][1], both[1][1]]])
        want = [np.empty(shape, np.float32), np.empty(shape, np.float32)]
        kv.pull(["lazy", "dense"], out=want)
    untouched = np.setdiff1d(np.arange(1000), [0, 1, 500, 501, 502, 998, 999])
    np.testing.assert_array_equal(want[0][untouched], w0[untouched])
    for (lazy, dense), sent in cluster.run(job):
        np.testing.assert_allclose(lazy, want[0], **TOL)
        np.testing.assert_allclose(dense, want[1], **TOL)
        assert ("write", False) in sent, "the dense key's chunks are written in"
        assert ("pushpull", True) in sent, "the lazy key's chunks go with their rows"


def test_a_lazy_pushpull_through_a_host_group_is_refused_by_name(make_cluster):
    def job(kv):
        kv.init("emb", np.zeros(SHAPE, np.float32))
        kv.set_optimizer(opt.SGD(learning_rate=0.1))
        with pytest.raises(InvalidArgumentError, match=r"dense key 'emb'.*KVSTORE_HOST_REDUCE"):
            kv.pushpull("emb", _values(DATA["dense"][0], 0)[kv.rank], out=np.empty(SHAPE, np.float32))
        kv.set_optimizer(opt.SGD(learning_rate=0.1, lazy_update=False))
        out = np.empty(SHAPE, np.float32)
        kv.pushpull("emb", _values(DATA["dense"][0], 0)[kv.rank], out=out)
        return out

    want = -0.1 * sum(v.todense() for v in _values(DATA["dense"][0], 0))
    for out in make_cluster(2, 1, host_reduce=True).run(job):
        np.testing.assert_allclose(out, want, **TOL)


# -- the fused kernels (their CUDA source built for the host) --------------------------------------

@pytest.fixture
def host_kernels():
    import host_kernels as hk
    if hk.compiler() is None:
        pytest.skip("needs a C++ compiler (g++) to build the fused kernels for the host")
    return hk


def _on_host_kernels(o, hk) -> None:
    """``o``'s updates done by its fused kernels built for the host, as on a GPU (the
    generic _step refused); the parameter's multipliers picked as update() does."""
    from kvstore.optimizer import fused

    def update(w, g, st, t, index=None, rows=None):
        view = o.for_index(index)
        hk.fused_update(view, w, g, st, t, view.learning_rate_at(t) * view.lr_scale)

    def norm_terms(w, g, st, t, index=None):
        view = o.for_index(index)
        return fused.norm_terms(view, w, g, st, t, view.learning_rate_at(t), index, np, hk.kernel)

    def apply_norms(w, g, st, t, sums, carry, index=None):
        view = o.for_index(index)
        fused.apply_norms(view, w, g, st, t, view.learning_rate_at(t), sums, carry, hk.kernel)

    def refused(*args, **kwargs):
        raise AssertionError("the generic path ran")
    o.update, o.norm_terms, o.apply_norms, o._step = update, norm_terms, apply_norms, refused


@pytest.mark.parametrize("case", [c for c in DATA["dense"] if c["optimizer"] in ("sgd", "adam", "lars")],
                         ids=_label)
def test_the_fused_kernels_update_the_gathered_rows(host_kernels, case):
    """Updater.update_lazy gathers the rows (and their state), the kernel steps them,
    they are written back: MXNet's numbers, as the device store computes them on a GPU."""
    o = _optimizer(case)
    _on_host_kernels(o, host_kernels)
    u = opt.Updater(o)
    w = np.array(case["w0"], np.float32)
    got = []
    for k in range(len(case["pushes"])):
        values = _values(case, k)
        total = sum(v.todense() for v in values)
        rows = np.unique(np.concatenate([v.indices for v in values]))
        u.update_lazy(7, total, w, rows)
        got.append(w.copy())
    _check(got, case)
