"""MXNet's per-parameter multipliers (issue 44 item 6): ``lr_mult``, ``wd_mult``,
``param_idx2name`` (with MXNet's rule: no weight decay for names not ending in
``_weight`` or ``_gamma``; LARS: ``_weight``), ``param_dict`` and ``begin_num_update``,
against MXNet 1.9.1's own numbers (tests/data/mxnet_optimizers.json, ``multipliers``:
its local KVStore, the keys being the indices) through the ``local`` and ``device``
stores and a dist_sync job, whose servers get them with the optimizer's config; and
``kv.set_learning_rate`` refused while a scheduler sets the rate, as MXNet refuses it."""

from __future__ import annotations

import json
import pathlib
import types

import msgpack
import numpy as np
import pytest

import kvstore
from kvstore import optimizer as opt
from kvstore.errors import ConfigError

DATA = json.loads((pathlib.Path(__file__).parents[1] / "data" / "mxnet_optimizers.json").read_text())["multipliers"]
TOL = {"rtol": 1e-6, "atol": 1e-7}
ADAM_TOL = {"rtol": 2e-5, "atol": 1e-6}      # MXNet's Adam rounds 1 - beta to float32 (api.md)
KEYS = [0, 1, 2, 3]


def _optimizer(case):
    kwargs = dict(case["params"], param_idx2name={int(k): v for k, v in case["names"].items()})
    if case["scheduler"]:
        kwargs["lr_scheduler"] = opt.FactorScheduler(**case["scheduler"])
    if case["param_dict"]:      # gluon Parameters in MXNet: anything with lr_mult and wd_mult here
        kwargs["param_dict"] = {k: types.SimpleNamespace(lr_mult=lr, wd_mult=wd) for k, lr, wd in case["param_dict"]}
    o = opt.create(case["optimizer"], **kwargs)
    o.set_lr_mult(dict((k, v) for k, v in case["lr_mult"]))
    o.set_wd_mult(dict((k, v) for k, v in case["wd_mult"]))
    return o


def _run(kv, case, share: float = 1.0) -> list:
    kv.init(KEYS, [np.array(w, np.float32) for w in case["w0"]])
    kv.set_optimizer(_optimizer(case))
    got = []
    for step in case["grads"]:
        kv.push(KEYS, [np.array(g, np.float32) * np.float32(share) for g in step])
        outs = [np.empty(4, np.float32) for _ in KEYS]
        kv.pull(KEYS, out=outs)
        got.append(outs)
    return got


def _check(got, case) -> None:
    tol = ADAM_TOL if case["optimizer"] == "adam" else TOL
    for k, (ours, theirs) in enumerate(zip(got, case["weights"])):
        for key in KEYS:
            np.testing.assert_allclose(ours[key], np.array(theirs[key], np.float32),
                                       err_msg=f"{case['id']} step {k + 1} key {key}", **tol)


# -- the rules ---------------------------------------------------------------------------------

@pytest.mark.parametrize("case", DATA, ids=lambda c: c["id"])
def test_each_parameter_gets_mxnets_multipliers(case):
    o = _optimizer(case)
    for key, (lr, wd) in zip(KEYS, case["scales"]):
        assert o._mults.scales(key) == (pytest.approx(lr), pytest.approx(wd)), (case["id"], key)
        view = o.for_index((key, 3))                     # a server's index: (key, chunk)
        assert view.wd == pytest.approx(o.wd * wd) and view.lr_scale == pytest.approx(lr)


def test_mxnets_wd_mult_rule_and_its_order():
    o = opt.SGD(wd=0.1, param_idx2name={0: "fc_weight", 1: "fc_bias", 2: "bn_gamma", 3: "bn_beta"})
    assert o.wd_mult == {"fc_bias": 0.0, "bn_beta": 0.0}
    assert opt.LARS(param_idx2name={0: "fc_weight", 2: "bn_gamma"}).wd_mult == {"bn_gamma": 0.0}
    # set_wd_mult: the defaults again, then the table; set_lr_mult replaces
    o.set_wd_mult({"fc_bias": 0.5, 3: 2.0})
    assert o.wd_mult == {"fc_bias": 0.5, "bn_beta": 0.0, 3: 2.0}
    assert o._mults.scales(3) == (1.0, 2.0)             # the index before the name
    o.set_lr_mult({1: 3.0})
    o.set_lr_mult({"fc_weight": 0.25})
    assert o.lr_mult == {"fc_weight": 0.25} and o._mults.scales(1) == (1.0, 0.5)
    # without param_idx2name no name rule: a key named like a bias keeps its decay
    assert opt.SGD(wd=0.1).for_index("fc_bias").wd == 0.1
    assert opt.SGD(wd=0.1, wd_mult={"fc.bias": 0}).for_index(("fc.bias", 2)).wd == 0.0
    # param_dict first, whatever the tables say
    o = opt.SGD(wd=0.1, lr_mult={5: 9.0}, param_dict={5: {"lr_mult": 0.5, "wd_mult": 3.0}})
    assert o._mults.scales(5) == (0.5, 3.0)


def test_the_multipliers_travel_with_the_config():
    o = opt.Adam(wd=0.1, param_idx2name={0: "w_weight", 1: "b_bias"}, begin_num_update=4,
                 param_dict={"emb": types.SimpleNamespace(lr_mult=2.0, wd_mult=0.0)})
    o.set_lr_mult({0: 0.5, "b_bias": 2.0})
    cfg = o.to_config()
    assert cfg["params"]["param_dict"] == {"emb": {"lr_mult": 2.0, "wd_mult": 0.0}}
    wire = msgpack.unpackb(msgpack.packb(cfg, use_bin_type=True), raw=False, strict_map_key=False)
    back = opt.from_config(wire)
    assert back.to_config() == cfg
    assert [back._mults.scales(k) for k in (0, 1, "emb", "other")] == [(0.5, 1.0), (2.0, 0.0), (2.0, 0.0),
                                                                       (1.0, 1.0)]
    assert back.begin_num_update == 4
    # a new learning rate keeps them (kv.set_learning_rate)
    assert o.with_learning_rate(0.01).to_config()["params"]["lr_mult"] == {0: 0.5, "b_bias": 2.0}


@pytest.mark.parametrize("kwargs, message", [
    ({"lr_mult": {0: -1.0}}, r"lr_mult\[0\] must be >= 0"),
    ({"lr_mult": [1.0]}, "lr_mult must be a dict"),
    ({"wd_mult": {True: 1.0}}, "wd_mult keys must be"),
    ({"wd_mult": {0: float("nan")}}, "must be finite"),
    ({"param_idx2name": {0: 3}}, r"param_idx2name\[0\] must be a name"),
    ({"param_dict": {0: object()}}, r"param_dict\[0\] must have lr_mult and wd_mult"),
    ({"param_dict": {0: {"lr_mult": 1.0}}}, r"param_dict\[0\] must have lr_mult and wd_mult"),
    ({"begin_num_update": -1}, "begin_num_update must be >= 0"),
    ({"begin_num_update": 1.5}, "begin_num_update must be an integer"),
])
def test_bad_multipliers_are_refused_by_name(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        opt.SGD(**kwargs)
    o = opt.SGD(lr_mult={0: 2.0})
    with pytest.raises(ConfigError, match="lr_mult"):
        o.set_lr_mult({0: -2.0})
    assert o.lr_mult == {0: 2.0}                       # a refused table changes nothing


def test_begin_num_update_starts_every_count_there():
    """MXNet's first update of a parameter is update begin_num_update + 1: Adam's bias
    correction and the schedule see it; the Updater's saved count includes it."""
    g = np.ones(3, np.float32)
    late = opt.Updater(opt.Adam(learning_rate=0.1, begin_num_update=9))
    w = np.zeros(3, np.float32)
    late(0, g, w)
    plain = opt.Adam(learning_rate=0.1)
    want = np.zeros(3, np.float32)
    plain.update(want, g, plain.create_state(want), 10)
    np.testing.assert_array_equal(w, want)
    assert late.get_states()[0]["t"] == 10
    sched = opt.Updater(opt.SGD(learning_rate=1.0, begin_num_update=2,
                                lr_scheduler=opt.FactorScheduler(step=2, factor=0.5)))
    w = np.zeros(3, np.float32)
    sched(0, g, w)
    np.testing.assert_array_equal(w, -0.5)              # the rate of update 3: 1 * 0.5


# -- through the stores -----------------------------------------------------------------------

@pytest.mark.parametrize("store", ["local", "device"])
@pytest.mark.parametrize("case", DATA, ids=lambda c: c["id"])
def test_local_stores_compute_mxnets_numbers(store, case):
    with kvstore.create(store) as kv:
        _check(_run(kv, case), case)


def test_a_dist_sync_job_computes_mxnets_numbers(make_cluster):
    # the optimizer, its multipliers by index and by name and begin_num_update reach the
    # servers in its config; two workers push half of each gradient
    def job(kv):
        results = []
        for case in DATA:
            keys = [100 * len(results) + k for k in KEYS]
            kv.init(keys, [np.array(w, np.float32) for w in case["w0"]])
            o = _optimizer(case)
            # the store's keys are 100 * i + index: the tables name them so (or by name)
            cfg = o.to_config()["params"]
            moved = {k + 100 * len(results) if isinstance(k, int) else k: v for k, v in cfg["lr_mult"].items()}
            o = opt.from_config({**o.to_config(), "params": {
                **cfg, "lr_mult": moved,
                "wd_mult": {k + 100 * len(results) if isinstance(k, int) else k: v for k, v in cfg["wd_mult"].items()},
                "param_idx2name": {k + 100 * len(results): v for k, v in cfg["param_idx2name"].items()},
                "param_dict": {k + 100 * len(results): v for k, v in cfg["param_dict"].items()}}})
            kv.set_optimizer(o)
            got = []
            for step in case["grads"]:
                kv.push(keys, [np.array(g, np.float32) * np.float32(0.5) for g in step])
                outs = [np.empty(4, np.float32) for _ in KEYS]
                kv.pull(keys, out=outs)
                got.append(outs)
            results.append(got)
        return results

    for results in make_cluster(2, 2).run(job, timeout=120):
        for got, case in zip(results, DATA):
            _check(got, case)


# -- set_learning_rate with a scheduler (item C) ------------------------------------------------

def _scheduled():
    return opt.SGD(learning_rate=0.1, momentum=0.9, lr_scheduler=opt.FactorScheduler(step=1, factor=0.5))


def _refuses_and_goes_on(kv) -> np.ndarray:
    kv.init("w", np.ones(3, np.float32))
    kv.set_optimizer(_scheduled())
    kv.push("w", np.ones(3, np.float32))
    with pytest.raises(ConfigError, match="lr_scheduler .* sets it"):
        kv.set_learning_rate(0.5)
    kv.push("w", np.ones(3, np.float32))               # the schedule and the momentum go on
    out = np.empty(3, np.float32)
    kv.pull("w", out=out)
    return out


def _scheduled_twice() -> np.ndarray:
    o = _scheduled()
    w = np.ones(3, np.float32)
    state = o.create_state(w)
    for t in (1, 2):
        o.update(w, np.ones(3, np.float32), state, t)
    return w


@pytest.mark.parametrize("store", ["local", "device"])
def test_set_learning_rate_is_refused_while_a_scheduler_sets_it(store):
    # MXNet 1.9.1's Optimizer.set_learning_rate raises (a UserWarning) when an
    # lr_scheduler is set: kv.set_learning_rate refuses it too, changing nothing
    with kvstore.create(store) as kv:
        np.testing.assert_array_equal(_refuses_and_goes_on(kv), _scheduled_twice())


def test_set_learning_rate_is_refused_in_a_dist_sync_job(make_cluster):
    for out in make_cluster(2, 1).run(_refuses_and_goes_on):
        np.testing.assert_allclose(out, 1 + 2 * (_scheduled_twice() - 1), rtol=1e-6)
