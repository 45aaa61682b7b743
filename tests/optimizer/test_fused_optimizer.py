"""The fused CuPy optimizer kernels (kvstore/optimizer/fused.py) against the
generic NumPy path, which test_optimizer.py checks against scalar references.

Tests marked ``gpu`` need CuPy and a working NVIDIA GPU; elsewhere they skip
with the probe's reason. Run them with
``python -m pytest -m gpu tests/optimizer/test_fused_optimizer.py``.
"""

import subprocess
import sys
import types

import numpy as np
import pytest

from kvstore.devices import gpu
from kvstore import optimizer as opt
from kvstore.optimizer import fused

VARIANTS = {
    "sgd": ("sgd", {"learning_rate": 0.1}),
    "sgd_momentum": ("sgd", {"learning_rate": 0.05, "momentum": 0.9}),
    "sgd_nesterov": ("sgd", {"learning_rate": 0.05, "momentum": 0.8, "nesterov": True}),
    "nag": ("nag", {"learning_rate": 0.05, "momentum": 0.9}),
    "adam": ("adam", {"learning_rate": 0.01, "beta1": 0.8, "beta2": 0.99, "epsilon": 1e-6}),
    "adagrad": ("adagrad", {"learning_rate": 0.1, "epsilon": 1e-3}),
    "rmsprop": ("rmsprop", {"learning_rate": 0.01, "gamma1": 0.8}),
    "rmsprop_clip_weights": ("rmsprop", {"learning_rate": 0.01, "gamma1": 0.8,
                                         "clip_weights": 1.05}),
    "rmsprop_centered": ("rmsprop", {"learning_rate": 0.01, "gamma1": 0.95, "gamma2": 0.8,
                                     "epsilon": 1e-4, "centered": True, "clip_weights": 1.5}),
    # MXNet's other elementwise optimizers (issue 31)
    "signsgd": ("signum", {"learning_rate": 0.01, "momentum": 0.0}),
    "signum": ("signum", {"learning_rate": 0.01, "momentum": 0.9}),
    "signum_wd_lh": ("signum", {"learning_rate": 0.01, "momentum": 0.8, "wd_lh": 0.02}),
    "ftml": ("ftml", {"learning_rate": 0.01, "beta1": 0.7, "beta2": 0.99}),
    "dcasgd": ("dcasgd", {"learning_rate": 0.05, "lamda": 0.1}),
    "dcasgd_momentum": ("dcasgd", {"learning_rate": 0.05, "momentum": 0.9, "lamda": 0.1}),
    "adadelta": ("adadelta", {"rho": 0.9, "epsilon": 1e-5}),
    "ftrl": ("ftrl", {"learning_rate": 0.1, "lamda1": 0.5, "beta": 1.0}),
    "adamax": ("adamax", {"learning_rate": 0.01, "beta1": 0.8, "beta2": 0.99}),
    "nadam": ("nadam", {"learning_rate": 0.01, "schedule_decay": 0.004}),
    # layer-wise (the key whole here; split over servers: test_..._in_chunks)
    "lars": ("lars", {"learning_rate": 0.5, "eta": 0.01}),
    "lars_momentum": ("lars", {"learning_rate": 0.5, "momentum": 0.9, "eta": 0.01}),
    "lamb": ("lamb", {"learning_rate": 0.01, "beta1": 0.8, "beta2": 0.99}),
    "lamb_bounded_uncorrected": ("lamb", {"learning_rate": 0.01, "upper_bound": 5.0,
                                          "bias_correction": False}),
}
# wd = 0 and rescale_grad = 1 take NumPy's shortcuts; the others the full formulas.
COMMON = {
    "plain": {},
    "wd_rescale": {"wd": 1e-2, "rescale_grad": 0.5},
    "wd_rescale_clip": {"wd": 1e-2, "rescale_grad": 0.5, "clip_gradient": 0.3},
}
STEPS = 5


def _hp(variant, common):
    name, hp = VARIANTS[variant]
    return name, dict(hp, **COMMON[common])


@pytest.fixture
def cp():
    """cupy, when a GPU is usable; otherwise skip with the probe's reason."""
    if not gpu.available():
        pytest.skip(f"needs a usable GPU with CuPy: {gpu.reason()}")
    import cupy
    return cupy


def _forbid_step(o):
    """Make ``o``'s generic path fail, so that only the fused kernel can succeed."""
    def fail(*args, **kwargs):
        raise AssertionError("the generic _step ran instead of the fused kernel")
    o._step = o._step_at = o._apply = fail      # (LARS and LAMB step through _step_at, _apply)


def _data(shape, dtype, seed=0, away_from_zero=False):
    rng = np.random.default_rng(seed)
    w0 = rng.standard_normal(shape).astype(dtype)
    if away_from_zero:
        # float16's NumPy path underflows g**2 of tiny gradients to 0 (Adam then
        # divides by epsilon); keep gradients where both paths are meaningful.
        grads = [(rng.choice([-1.0, 1.0], shape) * rng.uniform(0.5, 2.0, shape)).astype(dtype)
                 for _ in range(STEPS)]
    else:
        grads = [(2 * rng.standard_normal(shape)).astype(dtype) for _ in range(STEPS)]
    return w0, grads


def _run_numpy(name, hp, w0, grads):
    o = opt.create(name, **hp)
    w = w0.copy()
    state = o.create_state(w)
    for t, g in enumerate(grads, 1):
        o.update(w, g, state, t)
    return w, state


def _run_fused(cp, name, hp, wc, grads, to_gpu=None):
    """Update cupy weight ``wc`` in place with ``grads``; the fused kernel must do it."""
    o = opt.create(name, **hp)
    _forbid_step(o)
    state = o.create_state(wc)
    for t, g in enumerate(grads, 1):
        gc = to_gpu(g) if to_gpu else cp.asarray(g)
        before = cp.asnumpy(gc)
        o.update(wc, gc, state, t)
        np.testing.assert_array_equal(cp.asnumpy(gc), before, err_msg="grad was modified")
    return wc, state


def _assert_same(cp, got, want, rtol, atol, what):
    (wc, sc), (wn, sn) = got, want
    assert wc.dtype == wn.dtype and len(sc) == len(sn)
    np.testing.assert_allclose(cp.asnumpy(wc), wn, rtol=rtol, atol=atol, err_msg=f"{what} weight")
    for k, (a, b) in enumerate(zip(sc, sn)):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(cp.asnumpy(a), b, rtol=rtol, atol=atol,
                                   err_msg=f"{what} state {k}")


@pytest.mark.gpu
@pytest.mark.parametrize("common", COMMON)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype,rtol,atol", [(np.float32, 1e-5, 1e-6),
                                             (np.float64, 1e-10, 1e-12)])
def test_fused_matches_numpy(cp, variant, common, dtype, rtol, atol):
    name, hp = _hp(variant, common)
    w0, grads = _data(10_000, dtype, seed=len(variant))
    want = _run_numpy(name, hp, w0, grads)
    got = _run_fused(cp, name, hp, cp.asarray(w0), grads)
    _assert_same(cp, got, want, rtol, atol, f"{variant}/{common}")
    assert not np.allclose(cp.asnumpy(got[0]), w0)


@pytest.mark.gpu
@pytest.mark.parametrize("common", COMMON)
@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_float16_is_close_to_numpy_float16(cp, variant, common):
    name, hp = _hp(variant, common)
    w0, grads = _data(10_000, np.float16, seed=3, away_from_zero=True)
    want = _run_numpy(name, hp, w0, grads)
    got = _run_fused(cp, name, hp, cp.asarray(w0), grads)
    # The kernel rounds to float16 once per stored value, NumPy after every operation.
    _assert_same(cp, got, want, 1e-2, 1e-2, f"float16 {variant}/{common}")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_on_strided_views(cp, variant):
    name, hp = _hp(variant, "wd_rescale_clip")
    w0, grads = _data((64, 50), np.float32, seed=7)
    want = _run_numpy(name, hp, w0, grads)
    base = cp.full((64, 100), 7.0, cp.float32)
    wc = base[:, ::2]                      # the weight is every other column
    wc[...] = cp.asarray(w0)
    # and each gradient a transposed (Fortran-ordered) array
    got = _run_fused(cp, name, hp, wc, grads, to_gpu=lambda g: cp.asarray(g.T.copy()).T)
    assert not wc.flags.c_contiguous
    _assert_same(cp, got, want, 1e-5, 1e-6, f"strided {variant}")
    np.testing.assert_array_equal(cp.asnumpy(base[:, 1::2]), 7.0)   # untouched in between


@pytest.mark.gpu
@pytest.mark.parametrize("size", [0, 1])
@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_on_tiny_arrays(cp, variant, size):
    name, hp = _hp(variant, "wd_rescale_clip")
    w0, grads = _data(size, np.float32, seed=11)
    want = _run_numpy(name, hp, w0, grads)
    got = _run_fused(cp, name, hp, cp.asarray(w0), grads)
    _assert_same(cp, got, want, 1e-5, 1e-6, f"size {size} {variant}")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["sgd_momentum", "adam", "rmsprop_centered"])
def test_fused_converts_a_grad_of_another_dtype_without_touching_it(cp, variant):
    name, hp = _hp(variant, "wd_rescale_clip")
    w0, grads = _data(1000, np.float32, seed=5)
    grads64 = [g.astype(np.float64) / 3 for g in grads]
    want = _run_numpy(name, hp, w0, grads64)
    got = _run_fused(cp, name, hp, cp.asarray(w0), grads64)   # float64 grads, float32 weight
    _assert_same(cp, got, want, 1e-5, 1e-6, f"float64 grad {variant}")


@pytest.mark.gpu
def test_fused_uses_the_scheduled_learning_rate(cp):
    hp = {"learning_rate": 0.01, "wd": 1e-3,
          "lr_scheduler": opt.FactorScheduler(step=2, factor=0.5)}
    w0, grads = _data(1000, np.float32, seed=9)
    want = _run_numpy("adam", hp, w0, grads)
    got = _run_fused(cp, "adam", hp, cp.asarray(w0), grads)
    _assert_same(cp, got, want, 1e-5, 1e-6, "scheduled adam")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_update_takes_the_fused_path_unless_disabled(cp, variant, monkeypatch):
    name, hp = _hp(variant, "wd_rescale")
    o = opt.create(name, **hp)
    _forbid_step(o)
    w = cp.ones(10, cp.float32)
    state = o.create_state(w)
    o.update(w, cp.ones(10, cp.float32), state, 1)      # fused: _step is never called
    monkeypatch.setattr(fused, "ENABLED", False)
    with pytest.raises(AssertionError, match="generic _step ran"):
        o.update(w, cp.ones(10, cp.float32), state, 2)


@pytest.mark.gpu
def test_a_user_subclass_keeps_its_own_step(cp):
    calls = []

    class HalfSGD(opt.SGD):    # same math entry point, different _step
        def _step(self, weight, grad, state, t, lr, xp):
            calls.append(t)
            weight -= 0.5 * lr * grad

    w = cp.ones(4, cp.float32)
    o = HalfSGD(learning_rate=1.0)
    o.update(w, cp.ones(4, cp.float32), o.create_state(w), 1)
    assert calls == [1]
    np.testing.assert_array_equal(cp.asnumpy(w), 0.5)


# ==== CPU: runs everywhere ==============================================================

@pytest.fixture
def host_kernels():
    """The fused kernels' source compiled for the host (tests/optimizer/host_kernels.py)."""
    import host_kernels as hk
    if hk.compiler() is None:
        pytest.skip("needs a C++ compiler (g++) to build the fused kernels for the host")
    return hk


def _run_host(hk, name, hp, w0, grads):
    o = opt.create(name, **hp)
    _forbid_step(o)
    w = w0.copy()
    state = o.create_state(w)
    for t, g in enumerate(grads, 1):
        before = g.copy()
        hk.fused_update(o, w, g, state, t)
        np.testing.assert_array_equal(g, before, err_msg="grad was modified")
    return w, state


@pytest.mark.parametrize("common", COMMON)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype,rtol,atol", [(np.float32, 1e-5, 1e-6),
                                             (np.float64, 1e-10, 1e-12)])
def test_fused_kernels_built_for_the_host_match_numpy(host_kernels, variant, common, dtype, rtol, atol):
    """Every fused kernel's math against the generic path, in CI: the CUDA source's
    loop body and preamble compiled for the host, run on the data of the GPU test."""
    name, hp = _hp(variant, common)
    w0, grads = _data(10_000, dtype, seed=len(variant))
    want = _run_numpy(name, hp, w0, grads)
    got = _run_host(host_kernels, name, hp, w0, grads)
    _assert_same(types.SimpleNamespace(asnumpy=np.asarray), got, want, rtol, atol, f"host {variant}/{common}")
    assert not np.allclose(got[0], w0)


@pytest.mark.parametrize("common", COMMON)
@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_kernels_built_for_the_host_float16_is_close_to_numpy_float16(host_kernels, variant, common):
    """As the GPU's float16 test: the kernel computes in float32 and rounds once per
    stored value, NumPy rounds after every operation."""
    name, hp = _hp(variant, common)
    w0, grads = _data(10_000, np.float16, seed=3, away_from_zero=True)
    want = _run_numpy(name, hp, w0, grads)
    got = _run_host(host_kernels, name, hp, w0, grads)
    _assert_same(types.SimpleNamespace(asnumpy=np.asarray), got, want, 1e-2, 1e-2,
                 f"host float16 {variant}/{common}")


@pytest.mark.parametrize("variant", ["lars", "lars_momentum", "lamb", "lamb_bounded_uncorrected"])
@pytest.mark.parametrize("common", COMMON)
def test_layerwise_fused_phases_over_chunks_match_the_whole_key(host_kernels, variant, common):
    """LARS and LAMB as servers run them on a key cut into 3 chunks: each phase's
    fused kernel per chunk, the terms added up between, equal the one-process formula."""
    name, hp = _hp(variant, common)
    w0, grads = _data(10_000, np.float32, seed=5)
    want = _run_numpy(name, hp, w0, grads)
    o = opt.create(name, **hp)
    _forbid_step(o)
    w = w0.copy()
    state = o.create_state(w)
    for t, g in enumerate(grads, 1):
        host_kernels.fused_update_in_chunks(o, w, g, state, t, pieces=3)
    _assert_same(types.SimpleNamespace(asnumpy=np.asarray), (w, state), want, 1e-5, 1e-6,
                 f"chunks {variant}/{common}")


def test_every_builtin_elementwise_optimizer_has_a_fused_kernel():
    """The optimizers left on the generic path on GPUs, and why: LBSGD's warm-up and
    norms of the whole weight (reductions), SGLD draws its noise per position from
    the host's counter-based stream; torch.optim's twins run torch's own step (on a
    GPU through DLPack, torch's kernels: kvstore.optimizer.torch_twin). The bases
    TorchTwin and LayerwiseOptimizer are no optimizer of their own."""
    twins = {"TorchTwin", "TorchSGD", "TorchAdam", "TorchAdamW", "TorchRMSprop", "TorchAdagrad", "TorchAdadelta"}
    generic = {"LBSGD", "SGLD", "Test", "LayerwiseOptimizer"} | twins
    classes = [*opt.Optimizer.__subclasses__()]
    classes += [sub for cls in classes for sub in cls.__subclasses__()]
    classes += [sub for cls in classes for sub in cls.__subclasses__()]     # TorchAdamW: a twin's subclass
    builtin = {cls.__name__ for cls in classes if cls.__module__.startswith("kvstore.optimizer")}
    planned = {cls.__name__ for cls in classes if fused.has_kernel(cls)}
    assert builtin - generic <= planned, builtin - generic - planned

@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_step_declines_numpy_arrays(variant):
    name, hp = _hp(variant, "wd_rescale_clip")
    o = opt.create(name, **hp)
    w = np.ones(3, np.float32)
    state = o.create_state(w)
    assert fused.ENABLED is True
    assert fused.fused_step(o, w, np.ones(3, np.float32), state, 1, 0.1) is False
    np.testing.assert_array_equal(w, 1.0)
    for s, fresh in zip(state, o.create_state(np.ones(3, np.float32))):   # (DCASGD's holds w)
        np.testing.assert_array_equal(s, fresh)


def test_importing_fused_does_not_import_cupy():
    code = "import kvstore.optimizer.fused, sys; assert 'cupy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
