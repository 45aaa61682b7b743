"""The optimizers MXNet 1.9 has beyond SGD, NAG, Adam, AdaGrad and RMSProp (Signum,
FTML, DCASGD, SGLD, AdaDelta, Ftrl, Adamax, Nadam, and the layer-wise LARS, LAMB and
LBSGD) against MXNet 1.9.1's own numbers.

tests/data/mxnet_optimizers.json was written by MXNet itself
(benchmarks/harness/peers/mxnet_optimizer_fixture.py, which says how to regenerate it):
every case is an optimizer, its parameters, a weight, a few gradients, the weight
MXNet had after each step and its state after the last. Each case is replayed
here through ``kvstore.optimizer`` on one slot, the row-sparse Ftrl case through
the Updater's lazy ``update_rows``. SGLD's noise was replaced in MXNet by recorded
standard normals, and is here too. test_optimizer_more.py tests the rest (what
MXNet cannot run, validation, state save/load, servers).
"""

from __future__ import annotations

import json
import pathlib

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

    def replay(seed, slot, t, positions, xp):
        return np.asarray(next(draws), np.float64).reshape(positions.shape)
    monkeypatch.setattr(sgld, "standard_normal", replay)


def test_the_fixture_is_mxnets_and_covers_every_new_optimizer():
    assert DATA["mxnet"] == "1.9.1"
    names = {c["optimizer"] for c in CASES}
    assert names == {"signum", "ftml", "dcasgd", "sgld", "adadelta", "ftrl", "adamax", "nadam",
                     "lars", "lamb", "lbsgd"}
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
        # the slot names the weight (LARS leaves biases alone); MXNet's is its index, 0
        o.update(w, np.array(g, dtype), state, t, slot=case.get("slot") or 0)
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
