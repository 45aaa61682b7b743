"""Tests of kvstore.optimizer: update math against independent references
(scalar float64 formulas in optimizer_refs.py, and torch.optim where the semantics
are identical), in-place semantics, dtypes, argument checks and the array-module
(CuPy) dispatch. Config round trips, the registry, the Updater and the lr
schedulers are in test_optimizer_config.py."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from kvstore import optimizer as opt
from optimizer_refs import (LIVELY, _data, _halving, ref_adagrad, ref_adam, ref_nag, ref_rmsprop,
                            ref_sgd, run_reference)


CASES = [
    ("sgd", ref_sgd, {"learning_rate": 0.1}),
    ("sgd", ref_sgd, {"learning_rate": 0.05, "momentum": 0.9, "wd": 1e-3, "rescale_grad": 0.5,
                      "clip_gradient": 1.0}),
    ("sgd", ref_sgd, {"learning_rate": 0.05, "momentum": 0.8, "wd": 1e-2, "clip_gradient": 0.5,
                      "nesterov": True}),
    ("nag", ref_nag, {"learning_rate": 0.05, "momentum": 0.9, "wd": 1e-3, "rescale_grad": 2.0,
                      "clip_gradient": 1.5}),
    ("nag", ref_nag, {"learning_rate": 0.1}),
    ("adam", ref_adam, {}),
    ("adam", ref_adam, {"learning_rate": 0.01, "beta1": 0.8, "beta2": 0.99, "epsilon": 1e-6,
                        "wd": 1e-2, "rescale_grad": 0.5, "clip_gradient": 0.3}),
    ("adagrad", ref_adagrad, {"learning_rate": 0.1}),
    ("adagrad", ref_adagrad, {"learning_rate": 0.1, "epsilon": 1e-3, "wd": 1e-2,
                              "rescale_grad": 2.0, "clip_gradient": 1.0}),
    ("rmsprop", ref_rmsprop, {}),
    ("rmsprop", ref_rmsprop, {"learning_rate": 0.01, "gamma1": 0.8, "wd": 1e-2,
                              "rescale_grad": 0.5, "clip_gradient": 0.7, "clip_weights": 1.05}),
    ("rmsprop", ref_rmsprop, {"learning_rate": 0.01, "gamma1": 0.95, "gamma2": 0.8,
                              "epsilon": 1e-4, "centered": True, "wd": 1e-3,
                              "clip_gradient": 1.0, "clip_weights": 1.5}),
]


def _ids(cases):
    return [f"{c[0]}-{i}" for i, c in enumerate(cases)]


@pytest.mark.parametrize("name,ref,hp", CASES, ids=_ids(CASES))
@pytest.mark.parametrize("scheduled", [False, True])
def test_update_matches_scalar_reference(name, ref, hp, scheduled):
    w0, grads = _data(seed=len(hp))
    kwargs = dict(hp)
    base = opt.create(name, **kwargs).learning_rate
    lr_of_t = lambda t: base  # noqa: E731
    if scheduled:
        kwargs["lr_scheduler"] = opt.FactorScheduler(step=2, factor=0.5)
        lr_of_t = _halving(base)
    o = opt.create(name, **kwargs)
    w = w0.copy()
    state = o.create_state(w)
    expected = run_reference(ref, hp, w0, grads, lr_of_t)
    for k, grad in enumerate(grads):
        o.update(w, grad, state, k + 1)
        assert w.dtype == np.float32
        np.testing.assert_allclose(w, expected[k], rtol=1e-5, atol=1e-6,
                                   err_msg=f"{name} {hp} step {k + 1}")
    assert not np.allclose(w, w0)


def test_clipping_actually_happens_in_the_cases():
    # Guards the reference tests: with these data, clip_gradient and clip_weights
    # must change the outcome, else those code paths would go untested.
    w0, grads = _data(seed=5)
    hp = dict(CASES[10][2])
    a = run_reference(ref_rmsprop, hp, w0, grads, lambda t: 0.01)[-1]
    b = run_reference(ref_rmsprop, dict(hp, clip_gradient=None, clip_weights=None), w0, grads,
                      lambda t: 0.01)[-1]
    assert np.abs(a - b).max() > 1e-3


def test_rescale_and_clip_explicit_numbers():
    o = opt.SGD(learning_rate=1.0, rescale_grad=0.5, clip_gradient=1.0)
    w = np.zeros(4, np.float32)
    o.update(w, np.array([4.0, -4.0, 1.0, 0.5], np.float32), (), 1)
    np.testing.assert_array_equal(w, [-1.0, 1.0, -0.5, -0.25])
    # Adam/RMSProp add wd*w *before* clipping (MXNet order): a huge wd*w is clipped.
    o = opt.RMSProp(learning_rate=1.0, gamma1=0.0, epsilon=0.0, wd=100.0, clip_gradient=1.0)
    w = np.array([1.0], np.float32)
    o.update(w, np.array([0.0], np.float32), o.create_state(w), 1)
    np.testing.assert_allclose(w, [0.0], atol=1e-7)  # 1 - 1 * 1/sqrt(1)


def test_nag_is_mxnets_and_sgd_nesterov_is_torchs():
    # Equal while the rate is constant and wd is 0; the momentum of NAG (MXNet) holds
    # the rate, that of SGD(nesterov=True) (torch) does not: a new rate parts them.
    w0, grads = _data(seed=3)
    for sched, same in ((None, True), (opt.FactorScheduler(step=2, factor=0.5), False)):
        a, b = w0.copy(), w0.copy()
        oa = opt.SGD(learning_rate=0.05, momentum=0.9, nesterov=True, lr_scheduler=sched)
        ob = opt.NAG(learning_rate=0.05, momentum=0.9, lr_scheduler=sched)
        sa, sb = oa.create_state(a), ob.create_state(b)
        for k, g in enumerate(grads):
            oa.update(a, g, sa, k + 1)
            ob.update(b, g, sb, k + 1)
        assert np.allclose(a, b, rtol=1e-5, atol=1e-6) == same
        assert np.allclose(sb[0], -0.05 * sa[0], rtol=1e-5, atol=1e-7) == same


# --------------------------------------------------------------------------------------
# torch.optim where the semantics really are identical (constant lr; eps = 0 where
# torch puts eps elsewhere; wd only where torch adds it to the gradient the same way).
# --------------------------------------------------------------------------------------

TORCH_CASES = [
    ("sgd", {"learning_rate": 0.05, "momentum": 0.9, "wd": 1e-2},
     lambda T, p: T.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0, weight_decay=1e-2)),
    ("sgd", {"learning_rate": 0.05, "momentum": 0.9, "wd": 1e-2, "nesterov": True},
     lambda T, p: T.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-2, nesterov=True)),
    # MXNet's NAG: the same without wd (whose term MXNet takes from the new weight)
    ("nag", {"learning_rate": 0.05, "momentum": 0.9},
     lambda T, p: T.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True)),
    ("adam", {"learning_rate": 0.01, "epsilon": 0.0, "wd": 1e-2},
     lambda T, p: T.optim.Adam(p, lr=0.01, eps=0.0, weight_decay=1e-2)),
    ("adagrad", {"learning_rate": 0.1, "epsilon": 0.0},
     lambda T, p: T.optim.Adagrad(p, lr=0.1, eps=0.0, initial_accumulator_value=0.0)),
    ("rmsprop", {"learning_rate": 0.01, "gamma1": 0.9, "epsilon": 0.0, "wd": 1e-2},
     lambda T, p: T.optim.RMSprop(p, lr=0.01, alpha=0.9, eps=0.0, weight_decay=1e-2)),
    ("rmsprop", {"learning_rate": 0.01, "gamma1": 0.9, "gamma2": 0.8, "epsilon": 0.0,
                 "centered": True},
     lambda T, p: T.optim.RMSprop(p, lr=0.01, alpha=0.9, eps=0.0, momentum=0.8, centered=True)),
    # torch's Adadelta multiplies by lr (1.0 here); MXNet's has none
    ("adadelta", {"rho": 0.9, "epsilon": 1e-5},
     lambda T, p: T.optim.Adadelta(p, lr=1.0, rho=0.9, eps=1e-5)),
    # torch's Adamax adds eps to u; with 0 it is MXNet 1.9's
    ("adamax", {"learning_rate": 0.01, "beta1": 0.8, "beta2": 0.95, "wd": 1e-2},
     lambda T, p: T.optim.Adamax(p, lr=0.01, betas=(0.8, 0.95), eps=0.0, weight_decay=1e-2)),
    # torch's NAdam keeps its momentum product per parameter, as ours per weight
    ("nadam", {"learning_rate": 0.01, "beta2": 0.99, "epsilon": 1e-7, "wd": 1e-2},
     lambda T, p: T.optim.NAdam(p, lr=0.01, betas=(0.9, 0.99), eps=1e-7, weight_decay=1e-2,
                                momentum_decay=0.004)),
]


@pytest.mark.parametrize("name,hp,make", TORCH_CASES, ids=_ids(TORCH_CASES))
def test_update_matches_torch(name, hp, make):
    torch = pytest.importorskip("torch")
    w0, grads = _data(seed=7, steps=8)
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    topt = make(torch, [p])
    o = opt.create(name, **hp)
    w = w0.copy()
    state = o.create_state(w)
    for k, g in enumerate(grads):
        p.grad = torch.from_numpy(g.copy())
        topt.step()
        o.update(w, g, state, k + 1)
        np.testing.assert_allclose(w, p.detach().numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=f"{name} step {k + 1}")


# --------------------------------------------------------------------------------------
# In-place semantics, dtypes, argument checks
# --------------------------------------------------------------------------------------

# and the optimizers MXNet's own numbers check (test_optimizer_mxnet.py); MXNet's
# AdaDelta rescales the caller's gradient in place
IN_PLACE_CASES = CASES + [(name, None, hp) for name, hp in LIVELY.items()]


@pytest.mark.parametrize("name,ref,hp", IN_PLACE_CASES, ids=_ids(IN_PLACE_CASES))
def test_grad_untouched_dtype_kept_state_like_weight(name, ref, hp):
    o = opt.create(name, **hp)
    for dtype in (np.float32, np.float64):
        w0, grads = _data(seed=1)
        w = w0.astype(dtype)
        before = w.copy()
        state = o.create_state(w)
        assert len(state) == o.num_states
        for k, g in enumerate(grads[:2]):
            g_copy = g.copy()
            o.update(w, g, state, k + 1)
            np.testing.assert_array_equal(g, g_copy)
        assert w.dtype == dtype and all(s.dtype == dtype for s in state)
        assert all(s.shape == w.shape for s in state)
        assert not np.array_equal(w, before)  # updated in place


def test_grad_of_other_dtype_is_converted_not_modified():
    o = opt.Adam(learning_rate=0.1)
    w = np.ones(5, np.float32)
    g = np.full(5, 0.5, np.float64)
    o.update(w, g, o.create_state(w), 1)
    assert w.dtype == np.float32 and np.all(g == 0.5)
    np.testing.assert_allclose(w, 0.9, rtol=1e-5)  # first Adam step moves by ~lr


def test_update_argument_errors():
    o = opt.SGD(momentum=0.9)
    w = np.zeros(3, np.float32)
    s = o.create_state(w)
    with pytest.raises(ValueError):
        o.update(w, np.zeros(4, np.float32), s, 1)
    with pytest.raises(ValueError):
        o.update(w, np.zeros(3, np.float32), s, 0)
    with pytest.raises(TypeError):
        o.update(w, np.zeros(3, np.float32), s, 1.0)
    with pytest.raises(ValueError):
        o.update(w, np.zeros(3, np.float32), (), 1)
    with pytest.raises(ValueError):
        o.update(w, np.zeros(3, np.float32), (np.zeros(3, np.float64),), 1)
    with pytest.raises(TypeError):
        o.update(np.zeros(3, np.int32), np.zeros(3, np.float32), (np.zeros(3, np.int32),), 1)
    assert opt.SGD().create_state(w) == ()


def test_array_module_dispatch_is_lazy_and_finds_cupy(monkeypatch):
    from kvstore.optimizer._util import _array_module

    fake = types.ModuleType("cupy")
    monkeypatch.setitem(sys.modules, "cupy", fake)
    arr_type = type("ndarray", (), {"__module__": "cupy._core.core"})
    assert _array_module(arr_type()) is fake
    assert _array_module(np.zeros(1)) is np


@pytest.mark.gpu
def test_cupy_matches_numpy():
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception as exc:  # noqa: BLE001 - any CUDA init failure means "no GPU here"
        pytest.skip(f"CUDA unavailable: {exc}")
    for name, _, hp in CASES:
        o = opt.create(name, **hp)
        w0, grads = _data(seed=2)
        wn, wc = w0.copy(), cupy.asarray(w0)
        sn, sc = o.create_state(wn), o.create_state(wc)
        assert all(type(s) is cupy.ndarray for s in sc)
        for k, g in enumerate(grads):
            gc = cupy.asarray(g)
            o.update(wn, g, sn, k + 1)
            o.update(wc, gc, sc, k + 1)
            assert bool((gc == cupy.asarray(g)).all())
        assert wc.dtype == cupy.float32
        np.testing.assert_allclose(cupy.asnumpy(wc), wn, rtol=1e-5, atol=1e-6)
