"""Tests of kvstore.optimizer beyond the update math: the registry and create(),
config round trips and their validation, the Updater (per-weight step counts, state
save and restore) and the lr schedulers (against MXNet 1.x's stateful loops,
explicit values, validation, config round trip). The update math itself is in
test_optimizer.py."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest

from kvstore import optimizer as opt
from kvstore.errors import ConfigError
from kvstore.optimizer import base as opt_base
from optimizer_refs import _data


# --------------------------------------------------------------------------------------
# Registry, create, config round trip and validation
# --------------------------------------------------------------------------------------

def test_registered_names():
    assert opt.registered() == ["adadelta", "adagrad", "adam", "adamax", "dcasgd", "ftml", "ftrl", "lamb",
                                "lars", "lbsgd", "nadam", "nag", "rmsprop", "sgd", "sgld", "signum", "test",
                                # torch.optim's twins (kvstore.optimizer.torch_twin): named apart
                                "torch_adadelta", "torch_adagrad", "torch_adam", "torch_adamw", "torch_rmsprop",
                                "torch_sgd"]
    assert opt.registered_schedulers() == ["cosine", "factor", "multifactor", "poly"]


def test_create_is_case_insensitive_and_rejects_unknown():
    assert type(opt.create("SGD", learning_rate=0.1)) is opt.SGD
    assert type(opt.create("Adam")) is opt.Adam
    assert opt.create("sgd", learning_rate=0.1).learning_rate == 0.1
    with pytest.raises(ConfigError) as e:
        opt.create("adamw")
    for n in opt.registered():
        assert n in str(e.value)
    with pytest.raises(ConfigError, match="momentun"):
        opt.create("sgd", momentun=0.9)


def _plain(x):
    if isinstance(x, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in x.items())
    if isinstance(x, list):
        return all(map(_plain, x))
    return x is None or type(x) in (str, int, float, bool)


CONFIG_CASES = [
    opt.SGD(learning_rate=0.2, momentum=0.9, wd=1e-4, rescale_grad=0.25, clip_gradient=2.0,
            lr_scheduler=opt.FactorScheduler(step=2, factor=0.5)),
    opt.NAG(learning_rate=None, momentum=0.8,      # the scheduler's base_lr, 0.3
            lr_scheduler=opt.MultiFactorScheduler(step=[2, 4], factor=0.1, base_lr=0.3)),
    opt.Adam(learning_rate=0.01, beta1=0.8, beta2=0.99, epsilon=1e-6, wd=1e-3,
             lr_scheduler=opt.CosineScheduler(max_update=5, final_lr=0.001, warmup_steps=2)),
    opt.AdaGrad(learning_rate=0.1, epsilon=1e-5, clip_gradient=1.0),
    opt.RMSProp(learning_rate=0.01, gamma1=0.8, gamma2=0.7, centered=True, clip_weights=2.0),
    opt.Signum(learning_rate=0.01, momentum=0.8, wd_lh=0.01, clip_gradient=1.0),
    opt.FTML(learning_rate=0.02, beta1=0.5, epsilon=1e-6,
             lr_scheduler=opt.FactorScheduler(step=2, factor=0.5)),
    opt.DCASGD(learning_rate=0.05, momentum=0.9, lamda=0.1, wd=1e-3),
    opt.SGLD(learning_rate=0.01, wd=1e-3, seed=5),
    opt.AdaDelta(rho=0.8, epsilon=1e-4, rescale_grad=0.5),
    opt.Ftrl(learning_rate=0.2, lamda1=0.02, beta=0.5, wd=1e-3),
    opt.Adamax(learning_rate=0.01, beta1=0.8, beta2=0.99),
    opt.Nadam(learning_rate=0.01, schedule_decay=0.01, clip_gradient=1.0),
]


@pytest.mark.parametrize("o", CONFIG_CASES, ids=lambda o: o.name)
def test_config_round_trip_reproduces_updates(o):
    cfg = o.to_config()
    assert set(cfg) == {"name", "params", "lr_scheduler"}
    assert _plain(cfg)
    assert set(cfg["params"]) == set(type(o).param_names())
    wire = json.loads(json.dumps(cfg))  # what a msgpack/json hop leaves
    msgpack = pytest.importorskip("msgpack")
    wire = msgpack.unpackb(msgpack.packb(wire))
    o2 = opt.from_config(wire)
    assert type(o2) is type(o) and o2.to_config() == cfg
    w0, grads = _data(seed=9)
    a, b = w0.copy(), w0.copy()
    sa, sb = o.create_state(a), o2.create_state(b)
    for k, g in enumerate(grads):
        o.update(a, g, sa, k + 1)
        o2.update(b, g, sb, k + 1)
        assert o.learning_rate_at(k + 1) == o2.learning_rate_at(k + 1)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, w0)


def test_config_params_and_scheduler_are_optional():
    o = opt.from_config({"name": "SGD"})
    assert o.to_config() == opt.SGD().to_config()


@pytest.mark.parametrize("cfg,match", [
    ({"name": "adamw", "params": {}}, "adadelta, adagrad, adam, adamax, dcasgd, ftml, ftrl, lamb, lars, lbsgd, nadam"),
    ({"name": "sgd", "params": {"lr": 0.1}}, "'lr'"),
    ({"name": "nag", "params": {"nesterov": True}}, "nesterov"),
    ({"name": "sgd", "params": {"lr_scheduler": None}}, "lr_scheduler"),
    ({"name": "sgd", "params": {"learning_rate": "0.1"}}, "learning_rate"),
    ({"name": "sgd", "params": {"learning_rate": True}}, "learning_rate"),
    ({"name": "sgd", "params": {"learning_rate": -0.1}}, "learning_rate"),
    ({"name": "sgd", "params": {"learning_rate": float("nan")}}, "learning_rate"),
    ({"name": "sgd", "params": {"momentum": 1.5}}, "momentum"),
    ({"name": "adam", "params": {"beta1": 1.0}}, "beta1"),        # MXNet's would divide by 1 - 1**t
    ({"name": "adagrad", "params": {"clip_gradient": 0.0}}, "clip_gradient"),   # MXNet's zeroes g
    ({"name": "nadam", "params": {"clip_gradient": -1.0}}, "clip_gradient"),    # MXNet's inverts it
    ({"name": "adagrad", "params": {"eps": 1e-3, "epsilon": 1e-3}}, "eps"),
    ({"name": "sgd", "params": {"eps": 1e-3}}, "'eps'"),
    ({"name": "sgd", "params": {"rescale_grad": 0}}, "rescale_grad"),
    ({"name": "sgd", "params": {"wd": float("inf")}}, "wd"),
    ({"name": "sgd", "params": {"nesterov": "yes"}}, "nesterov"),
    ({"name": "adam", "params": {"beta2": 1.5}}, "beta2"),
    ({"name": "rmsprop", "params": {"centered": 1}}, "centered"),
    ({"name": "rmsprop", "params": {"clip_weights": -1.0}}, "clip_weights"),
    ({"name": "sgd", "lr_scheduler": {"name": "step"}}, "cosine, factor, multifactor, poly"),
    ({"name": "sgd", "lr_scheduler": {"name": "factor", "params": {"step": 0}}}, "step"),
    ({"name": "sgd", "lr_scheduler": {"name": "factor", "params": {"step": 2, "x": 1}}}, "'x'"),
    ({"name": "sgd", "lr_scheduler": {"name": "factor", "params": {"step": 2.0}}}, "step"),
    ({"name": "sgd", "lr_scheduler": "factor"}, "lr_scheduler"),
    ({"name": "sgd", "extra": 1}, "extra"),
    ({"params": {}}, "name"),
    ({"name": 3}, "name"),
    (["sgd"], "dict"),
])
def test_from_config_rejects(cfg, match):
    with pytest.raises(ConfigError, match=match):
        opt.from_config(cfg)


def test_config_error_is_value_error():
    with pytest.raises(ValueError):
        opt.from_config({"name": "nope"})


def test_register_rules():
    with pytest.raises(ConfigError):
        opt.register(object)

    class NoName(opt.Optimizer):
        pass

    with pytest.raises(ConfigError):
        opt.register(NoName)

    class Other(opt.Optimizer):
        name = "sgd"

    with pytest.raises(ConfigError, match="already registered"):
        opt.register(Other)
    assert opt.create("sgd").__class__ is opt.SGD

    class Plain(opt.Optimizer):
        """w -= lr * g, to show that a registered class round-trips."""
        name = "plain_test"

        def _step(self, weight, grad, state, t, lr, xp):
            weight -= lr * self._rescaled_grad(weight, grad, xp, wd_before_clip=False)

    try:
        opt.register(Plain)
        o = opt.from_config(opt.create("PLAIN_TEST", learning_rate=0.5).to_config())
        w = np.ones(2, np.float32)
        o.update(w, np.ones(2, np.float32), (), 1)
        np.testing.assert_array_equal(w, [0.5, 0.5])
    finally:
        opt_base._REGISTRY.pop("plain_test", None)


# --------------------------------------------------------------------------------------
# Updater
# --------------------------------------------------------------------------------------

def test_updater_counts_per_weight_and_uses_weight_t():
    o = opt.Adam(learning_rate=0.1)
    u = opt.Updater(o)
    assert u.optimizer is o
    w0, grads = _data(seed=4)
    ws = {0: w0.copy(), "a": w0.copy(), ("k", 2): w0.copy()}
    for _ in range(3):
        u(0, grads[0], ws[0])
    u("a", grads[0], ws["a"])
    u(("k", 2), grads[0], ws[("k", 2)])
    u(np.int64(0), grads[1], ws[0])  # numpy ints name the same weight as ints
    st_ = u.get_states()
    assert {k: v["t"] for k, v in st_.items()} == {0: 4, "a": 1, ("k", 2): 1}
    # Weight "a" got its own t = 1 (Adam's bias correction depends on it).
    w = w0.copy()
    o.update(w, grads[0], o.create_state(w), 1)
    np.testing.assert_array_equal(ws["a"], w)
    # ... and weight 0's fourth update used t = 4.
    w, s = w0.copy(), o.create_state(w0)
    for k, g in enumerate([grads[0]] * 3 + [grads[1]]):
        o.update(w, g, s, k + 1)
    np.testing.assert_array_equal(ws[0], w)
    for bad in (True, 1.5, [0], None):
        with pytest.raises(TypeError):
            u(bad, grads[0], w0.copy())


def test_updater_does_not_count_failed_updates():
    u = opt.Updater(opt.SGD(momentum=0.9))
    u(0, np.ones(3, np.float32), np.zeros(3, np.float32))
    with pytest.raises(ValueError):
        u(0, np.ones(4, np.float32), np.zeros(4, np.float32))
    assert u.get_states()[0]["t"] == 1


@pytest.mark.parametrize("o", CONFIG_CASES, ids=lambda o: o.name)
def test_updater_state_round_trip_continues_identically(o):
    w0, grads = _data(seed=11, steps=8)
    keys = [0, "b"]
    a = opt.Updater(o)
    wa = {k: w0.copy() for k in keys}
    for g in grads[:3]:
        for k in keys:
            a(k, g, wa[k])
    a(0, grads[3], wa[0])  # weights at different counts
    snap = {k: {"t": v["t"], "state": [s.copy() for s in v["state"]]}
            for k, v in a.get_states().items()}
    # A "restarted server": fresh optimizer from config, state restored.
    b = opt.Updater(opt.from_config(o.to_config()))
    b.set_states(copy.deepcopy(snap))
    wb = {k: wa[k].copy() for k in keys}
    for g in grads[4:]:
        for k in keys:
            a(k, g, wa[k])
            b(k, g, wb[k])
    for k in keys:
        np.testing.assert_array_equal(wa[k], wb[k])
    ga, gb = a.get_states(), b.get_states()
    assert {k: v["t"] for k, v in ga.items()} == {k: v["t"] for k, v in gb.items()} \
        == {0: 8, "b": 7}
    for k in keys:
        for x, y in zip(ga[k]["state"], gb[k]["state"]):
            np.testing.assert_array_equal(x, y)


def test_get_states_is_live_and_set_states_copies_in_place():
    u = opt.Updater(opt.SGD(learning_rate=0.1, momentum=0.9))
    w = np.zeros(3, np.float32)
    u(0, np.ones(3, np.float32), w)
    live = u.get_states()[0]["state"][0]
    np.testing.assert_allclose(live, -0.1)
    u(0, np.ones(3, np.float32), w)
    np.testing.assert_allclose(live, -0.19, rtol=1e-6)  # same array, updated
    src = np.full(3, 7.0, np.float32)
    u.set_states({0: {"t": 10, "state": [src]}})
    assert u.get_states()[0]["state"][0] is live and np.all(live == 7.0)
    src[:] = 0.0  # the updater copied, so this must not leak in
    assert np.all(live == 7.0) and u.get_states()[0]["t"] == 10
    # New weights get copies, too.
    src2 = np.ones(3, np.float32)
    u.set_states({"new": {"t": 2, "state": [src2]}})
    assert u.get_states()["new"]["state"][0] is not src2


def test_set_states_validates_and_is_atomic():
    u = opt.Updater(opt.Adam())
    w = np.zeros(3, np.float32)
    u(0, np.ones(3, np.float32), w)
    before = [s.copy() for s in u.get_states()[0]["state"]]
    good = {"t": 5, "state": [np.ones(3, np.float32), np.ones(3, np.float32)]}
    bad_cases = [
        ({0: {"t": 5, "state": [np.ones(4, np.float32)] * 2}}, ValueError),   # shape
        ({0: {"t": 5, "state": [np.ones(3, np.float64)] * 2}}, ValueError),   # dtype
        ({0: {"t": 5, "state": [np.ones(3, np.float32)]}}, ValueError),       # count
        ({0: {"t": -1, "state": good["state"]}}, ValueError),
        ({0: {"t": "5", "state": good["state"]}}, TypeError),
        ({0: {"t": 5}}, ValueError),
        ({0: {"t": 5, "state": [[1.0, 2.0, 3.0]] * 2}}, TypeError),
        ([("x", good)], TypeError),
    ]
    for states, exc in bad_cases:
        payload = {"other": good, **states} if isinstance(states, dict) else states
        with pytest.raises(exc):
            u.set_states(payload)
        assert set(u.get_states()) == {0}  # "other" was not applied either
        assert u.get_states()[0]["t"] == 1
        for x, y in zip(u.get_states()[0]["state"], before):
            np.testing.assert_array_equal(x, y)
    # Restored state that does not fit the weight is caught at the next update.
    u.set_states({"z": {"t": 1, "state": [np.zeros(2, np.float32)] * 2}})
    with pytest.raises(ValueError):
        u("z", np.ones(3, np.float32), np.zeros(3, np.float32))
    assert u.get_states()["z"]["t"] == 1


# --------------------------------------------------------------------------------------
# Learning-rate schedulers
# --------------------------------------------------------------------------------------

class MXNetFactor:
    """MXNet 1.x's stateful FactorScheduler loop, copied in spirit for comparison."""

    def __init__(self, step, factor, stop_factor_lr, base_lr):
        self.step, self.factor, self.stop, self.base_lr, self.count = (
            step, factor, stop_factor_lr, base_lr, 0)

    def __call__(self, num_update):
        while num_update > self.count + self.step:
            self.count += self.step
            self.base_lr *= self.factor
            if self.base_lr < self.stop:
                self.base_lr = self.stop
        return self.base_lr


class MXNetMultiFactor:
    def __init__(self, step, factor, base_lr):
        self.step, self.factor, self.base_lr, self.i = step, factor, base_lr, 0

    def __call__(self, num_update):
        while self.i < len(self.step) and num_update > self.step[self.i]:
            self.i += 1
            self.base_lr *= self.factor
        return self.base_lr


@pytest.mark.parametrize("step", [1, 2, 5])
@pytest.mark.parametrize("factor", [1.0, 0.9, 0.5, 0.1])
@pytest.mark.parametrize("stop,base", [(0.0, 0.3), (1e-8, 1.0), (1e-3, 0.2), (0.05, 0.01)])
def test_factor_scheduler_equals_mxnet_stateful_loop(step, factor, stop, base):
    # (0.05, 0.01): base below the floor, which MXNet returns until the first reduction.
    pure = opt.FactorScheduler(step=step, factor=factor, stop_factor_lr=stop)
    mx = MXNetFactor(step, factor, stop, base)
    for t in range(1, 80):
        assert pure(t, base) == mx(t), t      # to the last bit: one multiplication at a time


def test_factor_scheduler_values():
    s = opt.FactorScheduler(step=3, factor=0.1, stop_factor_lr=2e-3, base_lr=1.0)
    got = [s(t) for t in (1, 3, 4, 6, 7, 10, 100)]
    assert got == pytest.approx([1.0, 1.0, 0.1, 0.1, 0.01, 2e-3, 2e-3])
    # Pure: order of calls does not matter (a restart can jump straight to t).
    assert s(100) == s(100) and s(1) == 1.0


def test_multifactor_scheduler_values_and_mxnet_loop():
    s = opt.MultiFactorScheduler(step=[3, 6], factor=0.5, base_lr=1.0)
    assert [s(t) for t in range(1, 10)] == [1, 1, 1, .5, .5, .5, .25, .25, .25]
    mx = MXNetMultiFactor([2, 5, 9], 0.3, 0.7)
    s = opt.MultiFactorScheduler(step=[2, 5, 9], factor=0.3)
    for t in range(1, 20):
        assert s(t, 0.7) == mx(t)


def test_cosine_scheduler_values():
    s = opt.CosineScheduler(max_update=10, base_lr=1.0, final_lr=0.1, warmup_steps=2,
                            warmup_begin_lr=0.0)
    assert s(1) == pytest.approx(0.5)   # warmup: 0 + (1 - 0) * 1/2
    assert s(2) == pytest.approx(1.0)   # cos(0)
    assert s(6) == pytest.approx(0.55)  # 0.1 + 0.9 * (1 + cos(pi/2)) / 2
    assert s(10) == pytest.approx(0.1)
    assert s(50) == pytest.approx(0.1)
    s = opt.CosineScheduler(max_update=4, base_lr=2.0)
    assert s(2) == pytest.approx(2.0 * (1 + math.cos(math.pi * 2 / 4)) / 2)


def test_learning_rate_as_mxnets_test_learning_rate():
    # MXNet 1.9.1 tests/python/unittest/test_optimizer.py test_learning_rate: the
    # optimizer's learning_rate is written into the scheduler's base_lr and read from it
    lr_s = opt.FactorScheduler(step=1)
    o2 = opt.SGD(lr_scheduler=lr_s, learning_rate=0.3)
    assert o2.learning_rate == 0.3
    o2.lr_scheduler.base_lr = 0.4
    assert o2.learning_rate == 0.4
    assert o2.to_config()["params"]["learning_rate"] == 0.4
    assert lr_s.base_lr is None                 # the optimizer's copy, not the scheduler given
    o3 = opt.SGD(lr_scheduler=opt.FactorScheduler(step=1, base_lr=1024))
    assert o3.learning_rate == 1024
    assert opt.SGD().learning_rate == 0.01 and opt.SGD(learning_rate=None).learning_rate == 0.01


def test_learning_rate_overrides_a_schedulers_base_with_a_warning_as_mxnet():
    with pytest.warns(UserWarning, match="overrides the base_lr 1.0"):
        o = opt.SGD(learning_rate=0.4, lr_scheduler=opt.FactorScheduler(step=1, factor=0.5, base_lr=1.0))
    assert [o.learning_rate_at(t) for t in (1, 2, 3)] == [0.4, 0.2, 0.1]
    o = opt.SGD(learning_rate=None, lr_scheduler=opt.FactorScheduler(step=1, factor=0.5, base_lr=1.0))
    assert [o.learning_rate_at(t) for t in (1, 2)] == [1.0, 0.5]
    # a scheduler without base_lr takes the optimizer's, silently
    o = opt.SGD(learning_rate=0.4, lr_scheduler=opt.FactorScheduler(step=1, factor=0.5))
    assert o.learning_rate_at(2) == 0.2
    assert opt.SGD(learning_rate=0.3).learning_rate_at(99) == 0.3
    # MXNet's Adam has its own default rate, 0.001, which overrides the scheduler's too
    with pytest.warns(UserWarning):
        assert opt.Adam(lr_scheduler=opt.FactorScheduler(step=1, base_lr=0.1)).learning_rate_at(1) == 0.001
    # a config round trip keeps the rate and warns no more
    cfg = o.to_config()
    assert cfg["params"]["learning_rate"] == 0.4 and cfg["lr_scheduler"]["params"]["base_lr"] is None
    assert opt.from_config(cfg).learning_rate_at(2) == 0.2
    # The scheduled lr really drives the update: w -= lr_t * g.
    o = opt.SGD(learning_rate=1.0, lr_scheduler=opt.MultiFactorScheduler(step=[1], factor=0.25))
    w = np.zeros(2, np.float32)
    o.update(w, np.ones(2, np.float32), (), 1)
    o.update(w, np.ones(2, np.float32), (), 2)
    np.testing.assert_array_equal(w, [-1.25, -1.25])
    assert opt.FactorScheduler(step=2)(1) == 0.01          # MXNet's default base_lr


def test_with_learning_rate_keeps_the_kind_and_refuses_a_schedule_as_mxnet():
    o = opt.NAG(learning_rate=0.1, momentum=0.9, wd=1e-3)
    o2 = o.with_learning_rate(0.03)
    assert type(o2) is opt.NAG and o2.learning_rate == 0.03
    assert {**o2.to_config()["params"], "learning_rate": 0.1} == o.to_config()["params"]
    # MXNet 1.9.1 test_learning_rate_expect_user_warning: set_learning_rate with a scheduler
    s = opt.SGD(learning_rate=0.3, lr_scheduler=opt.FactorScheduler(step=1))
    with pytest.raises(ConfigError, match="lr_scheduler"):
        s.with_learning_rate(0.5)
    with pytest.raises(ConfigError, match="learning_rate"):
        o.with_learning_rate(-1.0)


def test_scheduler_warmup_as_mxnets_scheduler_tests():
    # MXNet 1.9.1 test_factor_scheduler, test_multifactor_scheduler, test_poly_scheduler,
    # test_cosine_scheduler (their t >= 1 values; t = 0 is no update here)
    s = opt.FactorScheduler(100, 0.1, stop_factor_lr=1e-4, base_lr=1, warmup_steps=20, warmup_begin_lr=0.1,
                            warmup_mode="constant")
    assert s(10) == pytest.approx(0.1) and s(21) == 1
    assert s(101) == pytest.approx(0.1) and s(201) == pytest.approx(0.01) and s(1000) == pytest.approx(1e-4)
    s = opt.MultiFactorScheduler([15, 25], 0.1, base_lr=0.1, warmup_steps=10, warmup_begin_lr=0.05)
    assert s(5) == pytest.approx(0.05 + (0.1 - 0.05) / 2) and s(15) == pytest.approx(0.1)
    assert s(16) == pytest.approx(0.01) and s(20) == pytest.approx(0.01)
    assert s(26) == pytest.approx(0.001) and s(100) == pytest.approx(0.001)
    s = opt.PolyScheduler(1000, base_lr=3, pwr=2, final_lr=0, warmup_steps=100, warmup_begin_lr=0)
    assert s(50) == pytest.approx(1.5) and s(100) == pytest.approx(3)
    assert s(101) < s(100) and s(500) < 1.6 and s(1000) == pytest.approx(0)
    s = opt.CosineScheduler(1000, base_lr=3, final_lr=0.1)
    assert s(1000) == pytest.approx(0.1) and s(500) > 1.5
    # the warm-up ends at the scheduler's base_lr, not at an optimizer's learning_rate
    o = opt.SGD(learning_rate=0.1, lr_scheduler=opt.FactorScheduler(step=3, warmup_steps=4))
    assert [o.learning_rate_at(t) for t in (1, 3, 4)] == [0.0025, 0.0075, 0.1]


@pytest.mark.parametrize("make", [
    lambda: opt.FactorScheduler(step=0),
    lambda: opt.FactorScheduler(step=2, factor=1.5),
    lambda: opt.FactorScheduler(step=2, factor=0.0),
    lambda: opt.FactorScheduler(step=2, stop_factor_lr=-1.0),
    lambda: opt.MultiFactorScheduler(step=[]),
    lambda: opt.MultiFactorScheduler(step=[3, 3]),
    lambda: opt.MultiFactorScheduler(step=[0, 3]),
    lambda: opt.MultiFactorScheduler(step=5),
    lambda: opt.CosineScheduler(max_update=0),
    lambda: opt.CosineScheduler(max_update=5, warmup_steps=5),
    lambda: opt.CosineScheduler(max_update=5, base_lr=0.1, warmup_begin_lr=0.2),
    lambda: opt.CosineScheduler(max_update=5, warmup_begin_lr=0.2),    # above MXNet's default base 0.01
    lambda: opt.FactorScheduler(step=2, warmup_steps=-1),
    lambda: opt.FactorScheduler(step=2, warmup_steps=2.0),
    lambda: opt.MultiFactorScheduler(step=[2], warmup_mode="cosine"),
    lambda: opt.PolyScheduler(max_update=0),
    lambda: opt.PolyScheduler(max_update=5, warmup_steps=5),
    lambda: opt.PolyScheduler(max_update=5, pwr="2"),
    lambda: opt.PolyScheduler(max_update=5, base_lr=0.1, warmup_begin_lr=0.2),
    lambda: opt.SGD(lr_scheduler="cosine"),
])
def test_scheduler_validation(make):
    with pytest.raises(ConfigError):
        make()


def test_scheduler_config_round_trip():
    for s in (opt.FactorScheduler(step=3, factor=0.5, stop_factor_lr=1e-4, base_lr=0.2),
              opt.MultiFactorScheduler(step=(2, 7), factor=0.1),
              opt.CosineScheduler(max_update=9, base_lr=0.5, final_lr=0.01, warmup_steps=3,
                                  warmup_begin_lr=0.1),
              opt.PolyScheduler(max_update=9, base_lr=0.5, pwr=3, final_lr=0.01, warmup_steps=2,
                                warmup_begin_lr=0.2, warmup_mode="constant"),
              opt.FactorScheduler(step=2, factor=0.5, warmup_steps=3, warmup_begin_lr=0.001)):
        cfg = s.to_config()
        assert _plain(cfg)
        s2 = opt.scheduler_from_config(json.loads(json.dumps(cfg)))
        assert type(s2) is type(s) and s2.to_config() == cfg
        assert [s2(t, 0.3) for t in range(1, 15)] == [s(t, 0.3) for t in range(1, 15)]


def test_values_mxnet_accepts():
    # (their numbers against MXNet's: the scenarios of test_optimizer_mxnet.py)
    assert opt.SGD(momentum=1.0).momentum == 1.0 and opt.NAG(momentum=1.0).num_states == 1
    assert opt.SGD(wd=-1e-4).wd == -1e-4
    for c in (0.0, -1.0):
        o = opt.SGD(clip_gradient=c)
        assert o.clip_bound is None and o.to_config()["params"]["clip_gradient"] == c
    assert opt.SGD(clip_gradient=2.0).clip_bound == 2.0
    a = opt.create("adagrad", eps=1e-3)
    assert a.epsilon == 1e-3 and a.to_config()["params"]["epsilon"] == 1e-3 and "eps" not in a.to_config()["params"]
    assert opt.from_config({"name": "adagrad", "params": {"eps": 1e-4}}).epsilon == 1e-4
    assert opt.FTML(learning_rate=0.0).learning_rate == 0.0


def test_lars_refuses_a_rate_that_divides_by_zero():
    # a negative wd cancels |g|: MXNet's layer rate would be inf
    o = opt.LARS(learning_rate=0.1, eta=1.0, wd=-0.5)
    w = np.array([3.0, 4.0], np.float32)          # |w| = 5
    with pytest.raises(ValueError, match="divides by"):
        o.update(w, np.array([2.5, 0.0], np.float32), (), 1)     # |g| = 2.5 = 0.5 * 5
    np.testing.assert_array_equal(w, [3.0, 4.0])


def test_a_scheduler_of_your_own_that_sets_base_lr_itself_keeps_it():
    class Halving(opt.LRScheduler):          # not registered: to_config needs no registry
        name = "halving-test"
        _params = ("base_lr",)

        def __init__(self, base_lr=None):
            self.base_lr = base_lr

        def _lr(self, t, base):
            return base * 0.5 ** (t - 1)
    s = Halving(base_lr=0.8)
    assert s.to_config() == {"name": "halving-test", "params": {"base_lr": 0.8}}
    assert s.warmup_final_lr == 0.8 and [s(1), s(3)] == [0.8, 0.2]
    o = opt.SGD(learning_rate=None, lr_scheduler=s)
    assert o.learning_rate == 0.8 and o.learning_rate_at(2) == 0.4
