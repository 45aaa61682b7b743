"""The optimizers MXNet 1.9 has beyond SGD, Adam, AdaGrad and RMSProp (NAG, Signum,
FTML, DCASGD, SGLD, AdaDelta, Ftrl, Adamax, Nadam, and the layer-wise LARS, LAMB and
LBSGD), the learning-rate rules (an optimizer's rate against its scheduler's base,
``set_learning_rate``, warm-up) and the schedulers against MXNet 1.9.1's own numbers.

tests/data/mxnet_optimizers.json was written by MXNet itself
(benchmarks/harness/peers/mxnet_optimizer_fixture.py, which says how to regenerate it):
every case is an optimizer, its parameters, a weight, a few gradients, the weight
MXNet had after each step and its state after the last. Each case is replayed
here through ``kvstore.optimizer`` on one weight, the row-sparse Ftrl case through
the Updater's lazy ``update_rows``, NAG's also through its fused kernel's source built
for the host. SGLD's noise was replaced in MXNet by recorded standard normals, and is
here too. The ``scenarios`` are MXNet runs of one weight whose learning rate changes
(a schedule; ``set_learning_rate`` before some steps, which here is what
``kv.set_learning_rate`` does in every store: ``Updater.replace_optimizer`` with
``Optimizer.with_learning_rate``); the ``schedules`` are MXNet's schedulers called for
``t = 1, 2, ...``. test_optimizer_more.py tests the rest (what MXNet cannot run,
validation, state save/load, servers); test_optimizer_mxnet_stores.py runs MXNet's
numbers through the stores.
"""

from __future__ import annotations

import json
import pathlib
import warnings

import numpy as np
import pytest

from kvstore import optimizer as opt
from kvstore.optimizer import sgld

FIXTURE = pathlib.Path(__file__).parents[1] / "data" / "mxnet_optimizers.json"
DATA = json.loads(FIXTURE.read_text())
CASES = DATA["cases"]
# float32 to MXNet's last bits or so; a float16 weight is its float32 master copy rounded
TOLERANCE = {"float32": {"rtol": 1e-6, "atol": 1e-7}, "float16": {"rtol": 1e-3, "atol": 1e-4}}


def _case_id(case):
    extra = "-rsp" if case["rows"] else ("-sched" if case["scheduler"] else "")
    return f"{case['optimizer']}-{case['dtype']}{extra}"


def _optimizer(case):
    kwargs = dict(case["params"])
    if case["scheduler"]:
        kwargs["lr_scheduler"] = opt.FactorScheduler(**case["scheduler"])
    return opt.create(case["optimizer"], **kwargs)


def _recorded_noise(monkeypatch, case):
    draws = iter(case["noise"])

    def replay(seed, index, t, positions, xp):
        return np.asarray(next(draws), np.float64).reshape(positions.shape)
    monkeypatch.setattr(sgld, "standard_normal", replay)


def test_the_fixture_is_mxnets_and_covers_every_new_optimizer():
    assert DATA["mxnet"] == "1.9.1"
    names = {c["optimizer"] for c in CASES}
    assert names == {"signum", "ftml", "dcasgd", "sgld", "adadelta", "ftrl", "adamax", "nadam",
                     "lars", "lamb", "lbsgd", "nag"}
    assert names <= set(opt.registered())


@pytest.mark.parametrize("case", [c for c in CASES if not c["rows"]], ids=_case_id)
def test_dense_updates_match_mxnet(case, monkeypatch):
    if case["noise"]:
        _recorded_noise(monkeypatch, case)
    dtype, tol = np.dtype(case["dtype"]), TOLERANCE[case["dtype"]]
    o = _optimizer(case)
    w = np.array(case["w0"], dtype)
    state = o.create_state(w)
    for t, (g, want) in enumerate(zip(case["grads"], case["weights"]), start=1):
        # the weight names the weight (LARS leaves biases alone); MXNet's is its index, 0
        o.update(w, np.array(g, dtype), state, t, index=case.get("slot") or 0)
        assert w.dtype == dtype
        np.testing.assert_allclose(w, np.array(want, dtype), err_msg=f"step {t}", **tol)
    if case["optimizer"] == "lbsgd":
        state = state[1:]     # our first state array is the summed gradients, kept outside MXNet's state
    assert len(state) == len(case["states"])
    for k, (ours, theirs) in enumerate(zip(state, case["states"])):
        np.testing.assert_allclose(ours, np.array(theirs, ours.dtype), err_msg=f"state {k}",
                                   **TOLERANCE["float32"] if ours.dtype == np.float32 else tol)
    assert not np.allclose(w, np.array(case["w0"], dtype))


def test_ftrl_row_sparse_update_is_lazy_as_mxnets():
    (case,) = [c for c in CASES if c["rows"]]
    o = _optimizer(case)
    u = opt.Updater(o)
    weight = np.array(case["w0"], np.float32)
    for rows, g, want in zip(case["rows"], case["grads"], case["weights"]):
        before = weight.copy()
        u.update_rows(0, np.array(rows), np.array(g, np.float32), weight)
        np.testing.assert_allclose(weight, np.array(want, np.float32), **TOLERANCE["float32"])
        untouched = np.setdiff1d(np.arange(len(weight)), rows)
        np.testing.assert_array_equal(weight[untouched], before[untouched])
    state = u.get_states()[0]["state"]
    for ours, theirs in zip(state, case["states"]):
        np.testing.assert_allclose(ours.reshape(weight.shape), np.array(theirs, np.float32),
                                   **TOLERANCE["float32"])


def test_the_cases_exercise_clipping_thresholds_and_schedules():
    # Guards the comparisons above: without these the code paths would go unchecked.
    assert any(c["params"].get("clip_gradient") for c in CASES)
    assert {c["optimizer"] for c in CASES if c["scheduler"]} >= {"ftml", "ftrl", "nadam"}
    ftrl_l1 = [c for c in CASES if c["optimizer"] == "ftrl" and c["params"].get("lamda1") == 0.5]
    assert any(w == 0.0 for w in ftrl_l1[0]["weights"][-1])       # L1 zeroes some weights
    assert any(c["dtype"] == "float16" for c in CASES)


# --------------------------------------------------------------------------------------
# NAG through its fused kernel (the CUDA source, built for the host)
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", [c for c in CASES if c["optimizer"] == "nag"], ids=_case_id)
def test_nag_fused_kernel_matches_mxnet(case):
    hk = pytest.importorskip("host_kernels")
    if hk.compiler() is None:
        pytest.skip("no C++ compiler to build the fused kernels for the host")
    dtype, tol = np.dtype(case["dtype"]), TOLERANCE[case["dtype"]]
    o = _optimizer(case)
    w = np.array(case["w0"], dtype)
    state = o.create_state(w)
    for t, (g, want) in enumerate(zip(case["grads"], case["weights"]), start=1):
        if o.keeps_master(dtype):          # the float32 master copy, as Optimizer.update
            hk.fused_update(o, state[0], np.array(g, dtype).astype(np.float32), state[1:], t)
            w[...] = state[0]
        else:
            hk.fused_update(o, w, np.array(g, dtype), state, t)
        np.testing.assert_allclose(w, np.array(want, dtype), err_msg=f"step {t}", **tol)
    for k, (ours, theirs) in enumerate(zip(state, case["states"])):
        np.testing.assert_allclose(ours, np.array(theirs, ours.dtype), err_msg=f"state {k}", **TOLERANCE["float32"])


# --------------------------------------------------------------------------------------
# Learning rates: MXNet's runs of one weight, and its schedulers
# --------------------------------------------------------------------------------------

SCENARIOS = DATA["scenarios"]


def scenario_optimizer(sc):
    """The scenario's optimizer, built as MXNet's was (the warning where MXNet prints one
    is silenced: test_optimizer_config.py checks it)."""
    kwargs = dict(sc["params"])
    if sc["scheduler"]:
        kwargs["lr_scheduler"] = opt.scheduler_from_config(sc["scheduler"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return opt.create(sc["optimizer"], **kwargs)


def test_the_scenarios_hold_the_numbers_of_issue_44():
    by_id = {sc["id"]: sc for sc in SCENARIOS}
    assert round(by_id["nag-factor-schedule"]["weights"][2][0], 4) == 0.2901
    assert round(by_id["lars-set-learning-rate"]["weights"][2][0], 4) == 1.2004
    assert by_id["sgd-rate-over-scheduler-base"]["rates"][0] == 0.3
    assert {sc["scheduler"]["name"] for sc in SCENARIOS if sc["scheduler"]} == {"factor", "multifactor",
                                                                               "cosine", "poly"}


@pytest.mark.parametrize("sc", SCENARIOS, ids=[sc["id"] for sc in SCENARIOS])
def test_learning_rate_scenarios_match_mxnet(sc):
    u = opt.Updater(scenario_optimizer(sc))
    if not sc["scheduler"] or sc["scheduler"]["params"].get("warmup_steps", 0) == 0:
        # MXNet's learning_rate is the rate at its update count, 0 here: the base without a warm-up
        assert u.optimizer.learning_rate == sc["learning_rate"]
    set_lr = dict(sc["set_lr"])
    w = np.array(sc["w0"], np.float32)
    for k, (g, want, rate) in enumerate(zip(sc["grads"], sc["weights"], sc["rates"])):
        if k in set_lr:        # what kv.set_learning_rate does in every store
            u.replace_optimizer(u.optimizer.with_learning_rate(set_lr[k]))
        u(0, np.array(g, np.float32), w)
        if rate is not None:
            assert u.optimizer.learning_rate_at(k + 1) == rate, f"rate of step {k + 1}"
        np.testing.assert_allclose(w, np.array(want, np.float32), err_msg=f"step {k + 1}", **TOLERANCE["float32"])
    state = u.get_states()[0]["state"]
    assert len(state) == len(sc["states"])
    for ours, theirs in zip(state, sc["states"]):
        np.testing.assert_allclose(ours, np.array(theirs, np.float32), **TOLERANCE["float32"])


@pytest.mark.parametrize("sched", DATA["schedules"],
                         ids=[f"{s['name']}-{i}" for i, s in enumerate(DATA["schedules"])])
def test_schedulers_match_mxnet_to_the_last_bit(sched):
    s = opt.scheduler_from_config({"name": sched["name"], "params": sched["params"]})
    assert [s(t) for t in range(1, len(sched["rates"]) + 1)] == sched["rates"]
    assert opt.scheduler_from_config(s.to_config()).to_config() == s.to_config()


def test_the_tolerance_would_catch_the_old_nag_and_lars():
    # torch's Nesterov (the old NAG, now SGD(nesterov=True)) and LARS without its
    # correction after set_learning_rate differ from MXNet by far more than TOLERANCE
    by_id = {sc["id"]: sc for sc in SCENARIOS}
    nag = by_id["nag-factor-schedule"]
    torchs = opt.SGD(learning_rate=0.1, momentum=0.9, nesterov=True, lr_scheduler=opt.FactorScheduler(2, 0.5))
    w = np.array(nag["w0"], np.float32)
    state = torchs.create_state(w)
    for t, g in enumerate(nag["grads"], start=1):
        torchs.update(w, np.array(g, np.float32), state, t)
    assert not np.allclose(w, nag["weights"][-1], **TOLERANCE["float32"])
    assert not np.allclose(by_id["lars-set-learning-rate-uncorrected"]["weights"][2],
                           by_id["lars-set-learning-rate"]["weights"][2], **TOLERANCE["float32"])


FUSED_SCENARIOS = [sc for sc in SCENARIOS if not sc["set_lr"]
                   and sc["optimizer"] in ("sgd", "nag", "ftml", "adagrad", "lars", "signum")]


@pytest.mark.parametrize("sc", FUSED_SCENARIOS, ids=[sc["id"] for sc in FUSED_SCENARIOS])
def test_learning_rate_scenarios_through_the_fused_kernels(sc):
    # the CUDA kernels' source built for the host: their scalars (rates, clip_gradient
    # <= 0 as no clipping, a negative wd, momentum 1) as the generic path's
    hk = pytest.importorskip("host_kernels")
    if hk.compiler() is None:
        pytest.skip("no C++ compiler to build the fused kernels for the host")
    o = scenario_optimizer(sc)
    w = np.array(sc["w0"], np.float32)
    state = o.create_state(w)
    for t, (g, want) in enumerate(zip(sc["grads"], sc["weights"]), start=1):
        hk.fused_update(o, w, np.array(g, np.float32), state, t)
        np.testing.assert_allclose(w, np.array(want, np.float32), err_msg=f"step {t}", **TOLERANCE["float32"])


def test_the_scenarios_hold_values_mxnet_accepts():
    by_id = {sc["id"]: sc for sc in SCENARIOS}
    assert by_id["sgd-momentum-one"]["params"]["momentum"] == 1.0
    assert by_id["sgd-negative-wd"]["params"]["wd"] < 0
    assert by_id["nag-clip-negative-is-no-clipping"]["params"]["clip_gradient"] < 0
    assert by_id["adagrad-eps"]["params"]["eps"] == 1e-3
    # the gradients exceed 1, so a clip at |c| would show
    assert max(abs(g) for step in by_id["sgd-clip-zero-is-no-clipping"]["grads"] for g in step) > 1
