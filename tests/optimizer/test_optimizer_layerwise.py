"""LARS, LAMB and LBSGD's "lars" scale each key's step by norms over the whole key
(kvstore.optimizer.layerwise; their numbers against MXNet's are in
test_optimizer_mxnet.py). Here: a dist job whose keys lie whole on different servers
gives the one-process result; what would show an optimizer part of a key (a key cut
into chunks over the servers, a row-sparse key) is refused, naming the key, before
anything changes."""

import numpy as np
import pytest

import kvstore
from kvstore import RowInit
from kvstore import optimizer as opt
from kvstore.errors import InvalidArgumentError
from kvstore.optimizer.layerwise import check_whole

pytestmark = pytest.mark.timeout(120)

SHAPES = {"conv.weight": (40, 30), "conv.bias": (40,), "fc.weight": (10, 40), "fc.bias": (10,)}
W, STEPS = 2, 4
LAYERWISE = {
    "lars": opt.LARS(learning_rate=0.5, momentum=0.9, eta=0.01, wd=1e-3, rescale_grad=0.5),
    "lamb": opt.LAMB(learning_rate=0.05, wd=0.01, upper_bound=10.0),
    "lbsgd-lars": opt.LBSGD(learning_rate=0.1, momentum=0.9, batch_scale=2, warmup_strategy="lars", wd=1e-3),
}


def grad(key, rank, step):
    n = int(np.prod(SHAPES[key]))
    rng = np.random.default_rng(hash((key, rank, step)) % 2**32)
    return rng.standard_normal(n).astype(np.float32).reshape(SHAPES[key])


def train(kv, optimizer, workers=W):
    """``STEPS`` steps; in one process (``workers`` 1 doing everyone's pushes) the sum
    of every worker's gradient is pushed, as the servers sum them."""
    keys = list(SHAPES)
    kv.init(keys, [np.linspace(-1, 1, int(np.prod(s)), dtype=np.float32).reshape(s) for s in SHAPES.values()])
    kv.set_optimizer(optimizer)
    ranks = [kv.rank] if workers > 1 else range(W)
    for step in range(STEPS):
        kv.push(keys, [sum(grad(k, r, step) for r in ranks) for k in keys])
    outs = [np.empty(s, np.float32) for s in SHAPES.values()]
    kv.pull(keys, out=outs)
    return dict(zip(keys, outs))


@pytest.mark.parametrize("name", list(LAYERWISE))
def test_keys_whole_on_different_servers_give_the_one_process_result(make_cluster, name):
    want = train(kvstore.create("local"), LAYERWISE[name], workers=1)
    cluster = make_cluster(W, 3, chunk_bytes=1 << 20)          # every key whole, keys spread over 3
    results = cluster.run(lambda kv: (train(kv, LAYERWISE[name]),
                                      {c.server for k in SHAPES for c in kv._keys[k].chunks}))
    for got, servers in results:
        assert servers == {0, 1, 2}
        for key in SHAPES:
            np.testing.assert_allclose(got[key], want[key], rtol=2e-6, atol=1e-7, err_msg=key)


SPLITS = {"lars": LAYERWISE["lars"], "lamb": LAYERWISE["lamb"],
          "lamb-fp16": opt.LAMB(learning_rate=0.05, wd=0.01, multi_precision=True)}


def train_pushpull(kv, optimizer, dtype=np.float32):
    """As :func:`train`, with pushpull (every worker gets the values of every step)."""
    keys = list(SHAPES)
    kv.init(keys, [np.linspace(-1, 1, int(np.prod(s)), dtype=dtype).reshape(s) for s in SHAPES.values()])
    kv.set_optimizer(optimizer)
    outs = [np.empty(s, dtype) for s in SHAPES.values()]
    for step in range(STEPS):
        kv.pushpull(keys, [grad(k, kv.rank, step).astype(dtype) for k in keys], out=outs)
    return dict(zip(keys, outs))


@pytest.mark.parametrize("name, call", [("lars", "push-pull"), ("lamb", "push-pull"), ("lars", "pushpull"),
                                        ("lamb", "pushpull"), ("lamb-fp16", "pushpull")])
def test_keys_cut_into_chunks_over_servers_give_the_one_process_result(make_cluster, name, call):
    """Norms across servers: every key larger than a chunk lies in pieces on 3 servers;
    the leader adds up their sums of squares, so the step is the whole key's."""
    dtype = np.float16 if name.endswith("fp16") else np.float32
    local = kvstore.create("local")
    if call == "push-pull" and dtype == np.float32:
        want = train(local, SPLITS[name], workers=1)
    else:                   # one process pushes every worker's sum, as the servers sum them
        keys = list(SHAPES)
        local.init(keys, [np.linspace(-1, 1, int(np.prod(s)), dtype=dtype).reshape(s) for s in SHAPES.values()])
        local.set_optimizer(SPLITS[name])
        outs = [np.empty(s, dtype) for s in SHAPES.values()]
        for step in range(STEPS):
            local.pushpull(keys, [sum(grad(k, r, step).astype(dtype) for r in range(W)) for k in keys], out=outs)
        want = dict(zip(keys, outs))
    run = train if call == "push-pull" else (lambda kv, o: train_pushpull(kv, o, dtype))
    cluster = make_cluster(W, 3, chunk_bytes=1024)
    results = cluster.run(lambda kv: (run(kv, SPLITS[name]), {c.server for c in kv._keys["conv.weight"].chunks}))
    tol = dict(rtol=2e-6, atol=1e-7) if dtype == np.float32 else dict(rtol=1e-3, atol=1e-3)
    for got, servers in results:
        assert servers == {0, 1, 2}                           # conv.weight: 5 chunks on 3 servers
        for key in SHAPES:
            np.testing.assert_allclose(got[key].astype(np.float64), want[key].astype(np.float64), err_msg=key, **tol)


def test_the_two_phases_equal_one_update():
    """Phase 1 + phase 2 with the chunk's own sums is the one-process update, bit for bit,
    and phase 1 changes nothing."""
    for name, o in SPLITS.items():
        dtype = np.float16 if name.endswith("fp16") else np.float32
        one, two = opt.Updater(o), opt.Updater(o)
        w1 = np.linspace(-1, 1, 50, dtype=dtype)
        w2 = w1.copy()
        for step in range(3):
            g = np.cos(np.arange(50) + step).astype(dtype)
            one(("conv.weight", 0), g, w1)
            before = w2.copy()
            terms, carry = two.norm_terms(("conv.weight", 0), g, w2)
            assert (w2 == before).all() and len(terms) == 2
            two.apply_norms(("conv.weight", 0), g, w2, terms, carry)
            assert np.array_equal(w1, w2), name
        assert one.get_states().keys() == two.get_states().keys()


@pytest.mark.parametrize("kind", ["dist_async", "lbsgd"])
def test_a_key_cut_into_chunks_over_servers_is_refused_naming_it(make_cluster, kind):
    """Where norms across servers are not added up (dist_async; LBSGD's lars warm-up,
    whose step is not split in two), a key cut into chunks is refused."""
    optimizer, name = (opt.LAMB(), "LAMB") if kind == "dist_async" else (LAYERWISE["lbsgd-lars"], "LBSGD")

    def job(kv):
        kv.init("small", np.zeros(10, np.float32))
        kv.init("big", np.zeros(1000, np.float32))              # 4000 bytes: 4 chunks of 1 KB
        with pytest.raises(InvalidArgumentError, match=rf"set_optimizer: {name} needs each key whole on one server, "
                                                        r"but key 'big' \(4000 bytes\) is cut into 4 chunks"):
            kv.set_optimizer(optimizer)
        if kind == "dist_async":
            return np.full(1000, 2, np.float32)                 # (async pushes need an optimizer)
        kv.push("big", np.ones(1000, np.float32))               # no optimizer was set: assigned
        out = np.empty(1000, np.float32)
        kv.pull("big", out=out)
        return out
    for out in make_cluster(2, 2, chunk_bytes=1024).run(job, store_type="dist_async" if kind == "dist_async"
                                                        else "dist_sync"):
        assert (out == 2).all()


def test_init_of_a_cut_key_after_a_layerwise_optimizer_is_refused_and_others_are_not(make_cluster):
    def job(kv):
        kv.set_optimizer(opt.LBSGD(learning_rate=0.1, momentum=0.9, warmup_strategy="lars"))
        with pytest.raises(InvalidArgumentError, match=r"init: LBSGD needs each key whole .* key 'big'"):
            kv.init("big", np.zeros(1000, np.float32))
        kv.init("small", np.ones(10, np.float32))
        kv.push("small", np.ones(10, np.float32))
        out = np.empty(10, np.float32)
        kv.pull("small", out=out)
        return out
    for out in make_cluster(2, 2, chunk_bytes=1024).run(job):
        assert (out < 1).all()                                 # the optimizer stepped
    # LBSGD warming up linearly needs no norms: chunks are fine
    lbsgd = opt.LBSGD(learning_rate=0.1, batch_scale=1)
    assert not lbsgd.needs_whole_keys() and opt.LBSGD(warmup_strategy="lars").needs_whole_keys()


@pytest.mark.parametrize("store", ["local", "device"])
def test_row_sparse_keys_are_refused_both_ways(store):
    kv = kvstore.create(store)
    kv.init("table", RowInit("zeros", 0.0, (8, 2), "float32"))
    with pytest.raises(InvalidArgumentError, match="set_optimizer: LAMB scales each key's step by norms over the "
                                                   "whole key, but row-sparse key 'table' is updated row by row"):
        kv.set_optimizer(opt.LAMB())
    kv2 = kvstore.create(store)
    kv2.set_optimizer(opt.LARS())
    with pytest.raises(InvalidArgumentError, match="init: LARS .* row-sparse key 'e'"):
        kv2.init("e", RowInit("zeros", 0.0, (8, 2), "float32"))


def test_the_optimizer_itself_refuses_part_of_a_key():
    """Where no store checked (a server handed a key's second chunk, a lazy row
    update), the update raises naming the key instead of using partial norms."""
    with pytest.raises(ValueError, match="LARS needs key 'w' whole, but it is cut into chunks"):
        check_whole("LARS", ("w", 1), None)
    with pytest.raises(ValueError, match="a lazy update of some rows .row-sparse key 'e'"):
        check_whole("LAMB", "e", np.array([1]))
    check_whole("LARS", ("w", 0), None)
    u = opt.Updater(opt.LAMB())
    w = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="cut into chunks"):
        u(("w", 2), np.ones(4, np.float32), w)
    assert (w == 1).all() and u.get_states() == {}
