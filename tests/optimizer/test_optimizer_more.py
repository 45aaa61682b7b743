"""MXNet 1.9's Signum, FTML, DCASGD, SGLD, AdaDelta, Ftrl, Adamax and Nadam beyond
MXNet's own numbers (test_optimizer_mxnet.py) and torch.optim's (AdaDelta, Adamax,
Nadam: TORCH_CASES in test_optimizer.py): what MXNet cannot run (DCASGD with
momentum), validation, where we deliberately differ (no NaN from 0 / 0, Nadam's schedule per
weight, SGLD's noise keyed by position), lazy row updates, and the stores: the
servers against the local store, optimizer-state save/load. Config round trips
and the Updater's state round trip run over these optimizers in
test_optimizer_config.py, float16 master copies in test_multi_precision.py."""

from __future__ import annotations

import numpy as np
import pytest

import kvstore
from kvstore import optimizer as opt
from kvstore.errors import ConfigError
from kvstore.optimizer import sgld
from optimizer_refs import LIVELY, _data

NEW = ["signum", "ftml", "dcasgd", "sgld", "adadelta", "ftrl", "adamax", "nadam"]

def test_every_new_optimizer_is_registered_and_lively():
    assert set(NEW) <= set(opt.registered())
    assert set(LIVELY) == set(NEW)


# --------------------------------------------------------------------------------------
# DCASGD with momentum: MXNet 1.9 cannot run it, so a scalar transcription is the oracle
# --------------------------------------------------------------------------------------

def ref_dcasgd(w, g, s, lr, hp):
    """MXNet 1.9's DCASGD.update, one element, float64, with the momentum branch as
    written there (`mom[:] *= momentum; mom[:] += -lr * (...)`)."""
    g = min(max(g * hp.get("rescale_grad", 1.0), -hp["clip_gradient"]), hp["clip_gradient"]) \
        if hp.get("clip_gradient") else g * hp.get("rescale_grad", 1.0)
    prev = s.get("prev", w)
    step = -lr * (g + hp.get("wd", 0.0) * w + hp["lamda"] * g * g * (w - prev))
    mom = hp["momentum"] * s.get("mom", 0.0) + step
    return w + mom, {"mom": mom, "prev": w}


@pytest.mark.parametrize("hp", [
    {"learning_rate": 0.05, "momentum": 0.9, "lamda": 0.5, "wd": 0.01},
    {"learning_rate": 0.1, "momentum": 0.5, "lamda": 0.04, "rescale_grad": 0.5, "clip_gradient": 0.7},
])
def test_dcasgd_with_momentum_matches_the_transcribed_update(hp):
    w0, grads = _data(seed=21)
    o = opt.create("dcasgd", **hp)
    w = w0.copy()
    state = o.create_state(w)
    assert len(state) == 2 and np.array_equal(state[1], w0) and not state[0].any()
    ref_w, ref_s = [float(x) for x in w0], [{} for _ in w0]
    for t, g in enumerate(grads, start=1):
        o.update(w, g, state, t)
        for i in range(len(ref_w)):
            ref_w[i], ref_s[i] = ref_dcasgd(ref_w[i], float(g[i]), ref_s[i], hp["learning_rate"], hp)
        np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-6, err_msg=f"step {t}")
    np.testing.assert_allclose(state[0], [s["mom"] for s in ref_s], rtol=1e-5, atol=1e-6)


def test_dcasgd_previous_weight_starts_as_the_weight_and_follows_it():
    o = opt.DCASGD(learning_rate=0.1, lamda=1.0)
    w = np.array([1.0, -2.0], np.float32)
    (prev,) = o.create_state(w)
    assert prev is not w and np.array_equal(prev, w)
    # first step: w - prev == 0, so it is plain SGD
    o.update(w, np.array([1.0, 1.0], np.float32), (prev,), 1)
    np.testing.assert_allclose(w, [0.9, -2.1], rtol=1e-6)
    np.testing.assert_array_equal(prev, [1.0, -2.0])
    # second: g + lamda * g * g * (w - prev) = 1 + 1 * (-0.1)
    o.update(w, np.array([1.0, 1.0], np.float32), (prev,), 2)
    np.testing.assert_allclose(w, [0.9 - 0.09, -2.1 - 0.09], rtol=1e-6)
    np.testing.assert_allclose(prev, [0.9, -2.1], rtol=1e-6)


# --------------------------------------------------------------------------------------
# Validation, in-place semantics, dtypes
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,params,match", [
    ("signum", {"momentum": 1.01}, "momentum"),
    ("signum", {"wd_lh": -0.1}, "wd_lh"),
    ("signum", {"momentum": 0.0, "wd_lh": 0.1}, "wd_lh needs momentum"),
    ("ftml", {"beta1": 1.0}, "beta1"),
    ("ftml", {"beta2": -0.1}, "beta2"),
    ("ftml", {"epsilon": 0.0}, "epsilon"),
    ("dcasgd", {"momentum": 1.5}, "momentum"),
    ("dcasgd", {"lamda": -1.0}, "lamda"),
    ("sgld", {"seed": -1}, "seed"),
    ("sgld", {"seed": 1.5}, "seed"),
    ("sgld", {"seed": True}, "seed"),
    ("adadelta", {"rho": 1.0}, "rho"),
    ("adadelta", {"epsilon": 0.0}, "epsilon"),
    ("ftrl", {"lamda1": -0.01}, "lamda1"),
    ("ftrl", {"beta": -1.0}, "beta"),
    ("adamax", {"beta1": 1.0}, "beta1"),
    ("adamax", {"beta2": "0.9"}, "beta2"),
    ("nadam", {"epsilon": -1e-8}, "epsilon"),
    ("nadam", {"schedule_decay": -0.1}, "schedule_decay"),
    ("nadam", {"beta2": float("nan")}, "beta2"),
    ("nadam", {"lamda": 0.1}, "'lamda'"),
])
def test_bad_hyper_parameters_are_config_errors(name, params, match):
    with pytest.raises(ConfigError, match=match):
        opt.create(name, **params)
    with pytest.raises(ConfigError, match=match):
        opt.from_config({"name": name, "params": params})


def test_mxnet_defaults():
    want = {
        "signum": {"learning_rate": 0.01, "momentum": 0.9, "wd_lh": 0.0},
        "ftml": {"learning_rate": 0.01, "beta1": 0.6, "beta2": 0.999, "epsilon": 1e-8},
        "dcasgd": {"learning_rate": 0.01, "momentum": 0.0, "lamda": 0.04},
        "sgld": {"learning_rate": 0.01, "seed": 0},
        "adadelta": {"learning_rate": 0.01, "rho": 0.9, "epsilon": 1e-5},
        "ftrl": {"learning_rate": 0.1, "lamda1": 0.01, "beta": 1.0},
        "adamax": {"learning_rate": 0.002, "beta1": 0.9, "beta2": 0.999},
        "nadam": {"learning_rate": 0.001, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8,
                  "schedule_decay": 0.004},
    }
    for name, params in want.items():
        got = opt.create(name).to_config()["params"]
        assert {k: got[k] for k in params} == params, name
        assert (got["wd"], got["rescale_grad"], got["clip_gradient"]) == (0.0, 1.0, None)
    assert opt.Signum().num_states == 1 and opt.Signum(momentum=0.0).num_states == 0
    assert opt.DCASGD().num_states == 1 and opt.DCASGD(momentum=0.9).num_states == 2
    assert opt.SGLD().num_states == 0 and opt.FTML().num_states == 3


def test_signsgd_ignores_rescale_and_clip_and_decays_the_weight():
    o = opt.Signum(learning_rate=0.1, momentum=0.0, wd=0.5, rescale_grad=1e-3, clip_gradient=1e-6)
    w = np.array([1.0, 1.0, -2.0], np.float32)
    o.update(w, np.array([3.0, 0.0, -1e-9], np.float32), (), 1)
    np.testing.assert_allclose(w, [0.95 - 0.1, 0.95, -1.9 + 0.1], rtol=1e-6)


# --------------------------------------------------------------------------------------
# Where we differ from MXNet on purpose: no 0 / 0
# --------------------------------------------------------------------------------------

def test_adamax_leaves_coordinates_with_only_zero_gradients_alone():
    # MXNet 1.9: u = 0 there, and m / u = 0 / 0 makes the weight NaN for good
    o = opt.Adamax(learning_rate=0.1)
    w = np.array([1.0, 2.0], np.float32)
    state = o.create_state(w)
    o.update(w, np.array([0.0, 1.0], np.float32), state, 1)
    assert w[0] == 1.0 and np.isfinite(w).all()
    np.testing.assert_allclose(w[1], 2.0 - 0.1, rtol=1e-6)     # lr / (1 - beta1) * m / u
    o.update(w, np.array([0.5, 1.0], np.float32), state, 2)     # a gradient arrives: it moves
    assert w[0] < 1.0 and np.isfinite(w).all()


def test_ftrl_without_beta_or_wd_gives_zero_not_nan_for_untouched_coordinates():
    o = opt.Ftrl(beta=0.0, lamda1=0.01)
    w = np.array([0.5, 0.5], np.float32)
    state = o.create_state(w)
    o.update(w, np.array([0.0, 1.0], np.float32), state, 1)
    assert w[0] == 0.0 and np.isfinite(w[1]) and w[1] != 0.0


@pytest.mark.parametrize("name", ["ftml", "ftrl"])
def test_a_learning_rate_of_zero_is_accepted_as_mxnet_and_its_update_refused(name):
    # MXNet builds them with a rate of 0 and then divides by it (NaN weights): here the
    # update raises, naming the rate, and changes nothing
    u = opt.Updater(opt.create(name, learning_rate=0.0))
    w = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="divides by the learning rate, which is 0.0 at update 1"):
        u(0, np.ones(4, np.float32), w)
    np.testing.assert_array_equal(w, 1.0)
    assert u.get_states() == {}


@pytest.mark.parametrize("name", ["ftml", "ftrl"])
def test_a_scheduled_learning_rate_of_zero_is_refused_and_changes_nothing(name):
    sched = opt.CosineScheduler(max_update=3, final_lr=0.0)
    u = opt.Updater(opt.create(name, learning_rate=0.1, lr_scheduler=sched))
    w = np.ones(4, np.float32)
    u(0, np.ones(4, np.float32), w)
    u(0, np.ones(4, np.float32), w)
    before = w.copy(), [s.copy() for s in u.get_states()[0]["state"]]
    with pytest.raises(ValueError, match="divides by the learning rate"):
        u(0, np.ones(4, np.float32), w)                         # t = 3: lr = final_lr = 0
    np.testing.assert_array_equal(w, before[0])
    for s, b in zip(u.get_states()[0]["state"], before[1]):
        np.testing.assert_array_equal(s, b)
    assert u.get_states()[0]["t"] == 2


# --------------------------------------------------------------------------------------
# Nadam: the momentum schedule per weight
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("beta1,decay", [(0.9, 0.004), (0.99, 0.004), (0.5, 1.0), (0.999, 0.0)])
def test_nadam_schedule_is_mxnets_running_product(beta1, decay):
    o = opt.Nadam(beta1=beta1, schedule_decay=decay)
    product = 1.0
    for t in range(1, 3001):
        product *= beta1 * (1. - 0.5 * (pow(0.96, t * decay)))   # MXNet's m_schedule loop
        got = o._m_schedule(t)
        assert got == product or (got == 0.0 and product < 2.0 ** -60 and 1.0 - product == 1.0)
    assert len(o._products) <= 6001         # grown by doubling, and not past negligible


def test_nadam_weights_do_not_share_a_schedule():
    # MXNet 1.9 advances one m_schedule for all parameters; here a weight's update is
    # the same whether or not other weights are updated in between
    w0, grads = _data(seed=5)
    alone, shared = opt.Updater(opt.Nadam()), opt.Updater(opt.Nadam())
    a, b, other = w0.copy(), w0.copy(), w0.copy()
    for g in grads:
        alone(0, g, a)
        shared("other", g, other)
        shared(0, g, b)
    np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------------------
# SGLD's noise
# --------------------------------------------------------------------------------------

def test_sgld_noise_is_standard_normal_and_a_function_of_seed_index_t_position():
    pos = np.arange(200_000)
    z = sgld.standard_normal(0, ("w", 0), 1, pos, np)
    assert z.dtype == np.float64 and z.shape == pos.shape
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1.0) < 0.01
    assert abs(np.mean(z ** 4) - 3.0) < 0.1                      # normal, not uniform
    assert abs(np.corrcoef(z[:-1], z[1:])[0, 1]) < 0.01
    np.testing.assert_array_equal(z, sgld.standard_normal(0, ("w", 0), 1, pos, np))
    np.testing.assert_array_equal(z[1000:1010], sgld.standard_normal(0, ("w", 0), 1, pos[1000:1010], np))
    for other in [(1, ("w", 0), 1), (0, ("w", 1), 1), (0, ("w", 0), 2), (0, "w", 1)]:
        assert abs(np.corrcoef(z[:10000], sgld.standard_normal(*other, pos[:10000], np))[0, 1]) < 0.05


def test_sgld_update_is_the_gradient_step_plus_sqrt_lr_noise():
    o = opt.SGLD(learning_rate=0.04, wd=0.5, seed=9)
    w = np.full(50_000, 2.0)
    g = np.full(50_000, 1.0)
    u = opt.Updater(o)
    u("k", g, w)
    z = sgld.standard_normal(9, "k", 1, np.arange(50_000), np)
    np.testing.assert_allclose(w, 2.0 - 0.02 * (1.0 + 0.5 * 2.0) + 0.2 * z, rtol=1e-12)


def test_sgld_lazy_rows_draw_what_the_dense_update_draws_there():
    rng = np.random.default_rng(0)
    table = rng.standard_normal((8, 3)).astype(np.float32)
    rows = np.array([1, 6])
    dense_grad = np.zeros_like(table)
    dense_grad[rows] = rng.standard_normal((2, 3)).astype(np.float32)
    lazy, dense = table.copy(), table.copy()
    opt.Updater(opt.SGLD(seed=4)).update_rows("t", rows, dense_grad[rows], lazy)
    opt.Updater(opt.SGLD(seed=4))("t", dense_grad.reshape(-1), dense.reshape(-1))
    np.testing.assert_array_equal(lazy[rows], dense[rows])
    untouched = np.setdiff1d(np.arange(8), rows)
    np.testing.assert_array_equal(lazy[untouched], table[untouched])


# --------------------------------------------------------------------------------------
# Lazy row updates (every optimizer; MXNet 1.9 has a lazy kernel for Ftrl only)
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [n for n in NEW if n != "sgld"])
def test_lazy_rows_update_only_those_rows_as_a_dense_update_of_them_would(name):
    rng = np.random.default_rng(3)
    table = rng.standard_normal((6, 4)).astype(np.float32)
    pushes = [[0, 5], [2, 5], [0, 2, 5]]                      # row 5 every time
    grads = [(2 * rng.standard_normal((len(r), 4))).astype(np.float32) for r in pushes]
    u, lazy = opt.Updater(opt.create(name, **LIVELY[name])), table.copy()
    solo_u, solo = opt.Updater(opt.create(name, **LIVELY[name])), table[5].copy()
    for rows, g in zip(pushes, grads):
        u.update_rows(0, np.array(rows), g, lazy)
        solo_u(0, g[-1], solo)                                 # row 5 alone, densely
    np.testing.assert_array_equal(lazy[5], solo)
    untouched = [1, 3, 4]
    np.testing.assert_array_equal(lazy[untouched], table[untouched])
    fresh = opt.create(name, **LIVELY[name]).create_state(table.reshape(-1))
    for s, f in zip(u.get_states()[0]["state"], fresh):     # their state is as created
        np.testing.assert_array_equal(s.reshape(6, 4)[untouched], f.reshape(6, 4)[untouched])


# --------------------------------------------------------------------------------------
# The stores: servers against the local store, and optimizer-state save/load
# --------------------------------------------------------------------------------------

SHAPE = (3, 700)     # 8400 bytes: three chunks of 4096 bytes or less


def _grad(rank, step):
    base = np.arange(np.prod(SHAPE), dtype=np.float64).reshape(SHAPE) % 7 - 3
    return (0.25 * base * (rank + 1) + 0.1 * (step + 1)).astype(np.float32)


def _init():
    return np.linspace(-1, 1, np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)


@pytest.mark.parametrize("name", [n for n in NEW if n != "sgld"])
def test_servers_apply_the_same_updates_as_the_local_store(make_cluster, name):
    o = opt.create(name, **LIVELY[name])
    steps = 4

    def job(kv):
        kv.init("w", _init())
        kv.set_optimizer(o)
        out = np.empty(SHAPE, np.float32)
        for step in range(steps):
            kv.pushpull("w", _grad(kv.rank, step), out=out)
        return out
    got = make_cluster(2, 2, chunk_bytes=4096).run(job)
    with kvstore.create("local") as kv:
        kv.init("w", _init())
        kv.set_optimizer(o)
        want = np.empty(SHAPE, np.float32)
        for step in range(steps):
            kv.pushpull("w", [_grad(r, step) for r in range(2)], out=want)
    for out in got:
        np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-7)


def test_sgld_on_servers_does_not_depend_on_how_many_there_are(make_cluster):
    o = opt.SGLD(learning_rate=0.01, wd=0.01, seed=11)

    def job(kv):
        kv.init("w", _init())
        kv.set_optimizer(o)
        out = np.empty(SHAPE, np.float32)
        for step in range(3):
            kv.pushpull("w", _grad(kv.rank, step), out=out)
        return out
    one = make_cluster(2, 1, chunk_bytes=4096).run(job)
    three = make_cluster(2, 3, chunk_bytes=4096).run(job)
    np.testing.assert_array_equal(one[0], three[0])
    np.testing.assert_array_equal(one[0], one[1])
    assert not np.allclose(one[0], _init(), atol=1e-3)


@pytest.mark.parametrize("name", ["dcasgd", "ftml", "nadam", "sgld"])
def test_local_optimizer_states_save_and_load_resume_exactly(tmp_path, name):
    o = opt.create(name, **LIVELY[name])
    path = str(tmp_path / "states")
    with kvstore.create("local") as kv:
        kv.init("w", _init())
        kv.set_optimizer(o)
        for step in range(2):
            kv.push("w", _grad(0, step))
        kv.save_optimizer_states(path, dump_optimizer=True)
        saved = np.empty(SHAPE, np.float32)
        kv.pull("w", out=saved)
        for step in range(2, 4):
            kv.push("w", _grad(0, step))
        want = np.empty(SHAPE, np.float32)
        kv.pull("w", out=want)
    with kvstore.create("local") as kv:
        kv.init("w", saved)
        kv.load_optimizer_states(path)        # the file carries the optimizer too
        for step in range(2, 4):
            kv.push("w", _grad(0, step))
        got = np.empty(SHAPE, np.float32)
        kv.pull("w", out=got)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", ["dcasgd", "nadam", "sgld"])
def test_dist_optimizer_states_save_and_load_resume_exactly(make_cluster, tmp_path, name):
    o = opt.create(name, **LIVELY[name])
    path = str(tmp_path / "states")

    def first(kv):
        kv.init("w", _init())
        kv.set_optimizer(o)
        out = np.empty(SHAPE, np.float32)
        snapshot = None
        for step in range(4):
            kv.pushpull("w", _grad(kv.rank, step), out=out)
            if step == 1:
                kv.barrier()
                if kv.rank == 0:
                    kv.save_optimizer_states(path)
                snapshot = out.copy()
        return snapshot, out.copy()

    snapshot, final = make_cluster(2, 2, chunk_bytes=4096).run(first)[0]

    def resumed(kv):
        kv.init("w", snapshot)
        kv.set_optimizer(o)
        if kv.rank == 0:
            kv.load_optimizer_states(path)
        kv.barrier()
        out = np.empty(SHAPE, np.float32)
        for step in range(2, 4):
            kv.pushpull("w", _grad(kv.rank, step), out=out)
        return out
    for out in make_cluster(2, 2, chunk_bytes=4096).run(resumed):
        np.testing.assert_array_equal(out, final)


@pytest.mark.parametrize("name", ["ftrl", "dcasgd", "adamax"])
def test_row_sparse_keys_on_servers_update_lazily_as_the_local_store(make_cluster, name):
    rows_total, width, steps = 40, 3, 3
    init = kvstore.RowInit("uniform", 1.0, (rows_total, width), seed=2)

    def push_of(rank, step):
        rows = np.array([(5 * rank + 3 * step) % rows_total, (11 * rank + step + 17) % rows_total])
        data = np.stack([np.full(width, 0.5 * (rank + 1) - 0.3 * step + i, np.float32) for i in range(2)])
        return kvstore.RowSparse(data, rows, (rows_total, width))

    def job(kv):
        kv.init("emb", init)
        kv.set_optimizer(opt.create(name, **LIVELY[name]))
        for step in range(steps):
            kv.push("emb", push_of(kv.rank, step))
        out = np.empty((rows_total, width), np.float32)
        kv.row_sparse_pull("emb", out=out, row_ids=np.arange(rows_total))
        return out
    got = make_cluster(2, 2).run(job)
    with kvstore.create("local") as kv:
        kv.init("emb", init)
        kv.set_optimizer(opt.create(name, **LIVELY[name]))
        for step in range(steps):
            kv.push("emb", [push_of(r, step) for r in range(2)])
        want = np.empty((rows_total, width), np.float32)
        kv.row_sparse_pull("emb", out=want, row_ids=np.arange(rows_total))
    start = np.zeros((rows_total, width), np.float32)
    init.fill(start, np.arange(rows_total))
    pushed = {int(r) for rank in range(2) for step in range(steps) for r in push_of(rank, step).indices}
    untouched = sorted(set(range(rows_total)) - pushed)
    np.testing.assert_array_equal(want[untouched], start[untouched])
    assert not np.allclose(want[sorted(pushed)], start[sorted(pushed)])
    for out in got:
        np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------------------
# GPU: the generic path on CuPy (there is no fused kernel for these)
# --------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", NEW)
def test_cupy_matches_numpy_for_dense_and_lazy_updates(name):
    from kvstore.devices import gpu
    if not gpu.available():
        pytest.skip(f"needs a usable GPU with CuPy: {gpu.reason()}")
    import cupy
    w0, grads = _data(seed=2)
    results = {}
    for xp in (np, cupy):
        u = opt.Updater(opt.create(name, **LIVELY[name]))
        w, rows_w = xp.array(w0), xp.array(w0.reshape(6, 4))      # copies: w0 stays the start
        for t, g in enumerate(grads):
            u("dense", xp.asarray(g), w)
            u.update_rows("rows", xp.asarray([t % 5, 5]), xp.asarray(g[:8].reshape(2, 4)), rows_w)
        results[xp.__name__] = [cupy.asnumpy(a) if xp is cupy else a
                                for a in [w, rows_w, *u.get_states()["dense"]["state"]]]
    for a, b in zip(results["cupy"], results["numpy"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    if name == "sgld":                                   # the same noise on both
        pos = np.arange(1000)
        np.testing.assert_allclose(cupy.asnumpy(sgld.standard_normal(1, "k", 2, cupy.asarray(pos), cupy)),
                                   sgld.standard_normal(1, "k", 2, pos, np), rtol=1e-12, atol=1e-12)
