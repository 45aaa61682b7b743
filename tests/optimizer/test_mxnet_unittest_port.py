"""MXNet 1.9.1's own optimizer tests (tests/python/unittest/test_optimizer.py), ported.

Each ``compare_optimizer`` call of MXNet's file is one case here, in its sweeps (momentum,
wd, clip_gradient, rescale_grad, multi_precision, lazy_update, float16/32/64, dense,
row-sparse and CSR storage) and with its tolerances: one update from zero state of a
uniform [0, 1) weight by a uniform gradient, the state before and after and the weight
compared with ``allclose(reference, ours, rtol, atol)``. The references are MXNet's
pure-Python optimizers translated to NumPy (mxnet_reference.py); the optimizer under
test, in MXNet ``mx.optimizer.X(**kwargs)``, is ``kvstore.optimizer.create("x",
**kwargs)``, driven as the stores drive it:

- a dense weight and gradient: ``create_state`` and ``update`` on weight 0;
- MXNet's ``w_stype='row_sparse'`` (a row-sparse key): ``Updater.update_rows`` with the
  gradient's rows;
- a dense weight and a row-sparse gradient (a row-sparse push on a dense key):
  ``Updater.update_lazy`` with the gradient's rows;
- CSR weight and gradient (test_sgd's "operator fallback", which MXNet computes
  densely): a dense update by a gradient with CSR's zeros.

The dense cases run again through the fused kernels (their CUDA source built for the
host). MXNet's tolerances pass a 10% error of some steps (RMSProp's: atol 1e-2 against
a step of 0.003; float16 LAMB's), so each case also compares the steps, within 1%, and
a test checks that every case that moves the weight fails with its step 10% off.

MXNet's other tests of the file are ported below the cases: the learning-rate rules,
lr_mult / wd_mult, Nadam's convergence and the schedulers. MXNet seeds each run at
random (``with_seed``); here every case has its own fixed seed (its id's CRC-32).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import zlib

import numpy as np
import pytest

import mxnet_reference as ref
from kvstore import optimizer as opt
from kvstore.errors import ConfigError
from kvstore.optimizer import sgld


@dataclasses.dataclass(frozen=True)
class Case:
    """One compare_optimizer call of MXNet's file."""
    test: str                     # MXNet's test function
    reference: type               # its Py* optimizer
    ref_kwargs: dict              # what the reference is built with
    name: str                     # the optimizer under test (mx.optimizer.<X>)
    kwargs: dict                  # what it is built with
    shape: object                 # a shape, or a list of shapes (multi-tensor LAMB)
    dtype: type
    w_stype: str = "default"
    g_stype: str = "default"
    rtol: float = 1e-4            # compare_optimizer's defaults
    atol: float = 1e-5
    noise_seed: int | None = None  # SGLD: mx.random.seed before each update

    @property
    def id(self) -> str:
        own = ",".join(f"{k}={v}" for k, v in self.kwargs.items()) or "defaults"
        extra = {k: v for k, v in self.ref_kwargs.items() if self.kwargs.get(k, _MISSING) != v}
        refs = "".join(f",ref.{k}={v}" for k, v in extra.items())
        seed = f"-seed{self.noise_seed}" if self.noise_seed is not None else ""
        shape = f"-{len(self.shape)}tensors" if isinstance(self.shape, list) else ""
        return (f"{self.test}-{np.dtype(self.dtype).name}-{self.w_stype}/{self.g_stype}{shape}{seed}-"
                f"{own}{refs}")


_MISSING = object()


def _merged(options) -> dict:
    return {k: v for option in options for k, v in option.items()}


MOM = [{}, {"momentum": 0.9}]
CG = [{}, {"clip_gradient": 0.4}, {"clip_gradient": 0.5}]
RG = [{}, {"rescale_grad": 0.14}, {"rescale_grad": 0.8}]
WD = [{}, {"wd": 0.03}, {"wd": 0.05}, {"wd": 0.07}]
MP = [{}, {"multi_precision": False}, {"multi_precision": True}]
SHAPE = (3, 4, 5)


def _fp16_without_mp(dtype, kwarg) -> bool:
    # MXNet's tests skip float16 weights unless multi_precision is on
    return dtype == np.float16 and not kwarg.get("multi_precision")


def _cases(full_multilamb: bool = False) -> list[Case]:
    """Every compare_optimizer call of MXNet's file, in its order."""
    cases: list[Case] = []

    def add(test, reference, name, kwarg, dtype, ref_kwarg=None, **how):
        cases.append(Case(test, reference, dict(kwarg if ref_kwarg is None else ref_kwarg), name,
                          dict(kwarg), how.pop("shape", SHAPE), dtype, **how))

    # test_sgd
    for dtype in (np.float16, np.float32, np.float64):
        for options in itertools.product(MOM, CG, RG, WD, MP):
            kwarg = _merged(options)
            if _fp16_without_mp(dtype, kwarg):
                continue
            add("test_sgd", ref.PySGD, "sgd", kwarg, dtype, **({"rtol": 1e-3} if dtype == np.float16 else {}))
            if dtype != np.float16:      # "test operator fallback on cpu"
                add("test_sgd", ref.PySGD, "sgd", kwarg, dtype, shape=SHAPE[:2], w_stype="csr", g_stype="csr")
    # test_sparse_sgd
    for options in itertools.product(MOM, CG, RG, WD, MP):
        kwarg = _merged(options)
        add("test_sparse_sgd", ref.PySparseSGD, "sgd", kwarg, np.float32, w_stype="row_sparse",
            g_stype="row_sparse")
        add("test_sparse_sgd", ref.PySparseSGD, "sgd", kwarg, np.float32, g_stype="row_sparse")
    # test_std_sparse_sgd
    for options in itertools.product([{"momentum": 0.0}, {"momentum": 0.9}], CG, RG, WD):
        kwarg = _merged(options)
        for w_stype in ("row_sparse", "default"):
            add("test_std_sparse_sgd", ref.PySGD, "sgd", {"lazy_update": False, **kwarg}, np.float32,
                ref_kwarg=kwarg, w_stype=w_stype, g_stype="row_sparse")
    # test_nag
    for dtype in (np.float16, np.float32, np.float64):
        for options in itertools.product(MOM, CG, RG, WD, MP):
            kwarg = _merged(options)
            if _fp16_without_mp(dtype, kwarg):
                continue
            add("test_nag", ref.PyNAG, "nag", kwarg, dtype, rtol=1e-3, atol=1e-4)
    # test_lamb
    bc = [{}, {"bias_correction": False}, {"bias_correction": True}]
    lb = [{}, {"lower_bound": None}, {"lower_bound": 1e-3}]
    ub = [{}, {"upper_bound": None}, {"upper_bound": 10}]
    for options in itertools.product(CG, RG, WD, bc, lb, ub):
        kwarg = _merged(options)
        add("test_lamb", ref.PyLAMB, "lamb", {**kwarg, "multi_precision": False}, np.float32)
        add("test_lamb", ref.PyLAMB, "lamb", {**kwarg, "multi_precision": True}, np.float16, rtol=1e-3, atol=1e-3)
    # test_multilamb: MXNet's multi-tensor kernel against the single-tensor reference; here
    # every tensor is a key of its own. MXNet's 4 layers of 5 tensors (8.4 million values)
    # take 2 s a case in NumPy: by default each case has a layer's three small tensors, the
    # last of each dtype (every option on) its whole layer; full_multilamb: MXNet's 20.
    layer = [(1024, 1), (1024, 1), (4096, 1), (1024, 1024), (1024, 1024)]
    for dtype in (np.float16, np.float32, np.float64):
        sweep = list(itertools.product(CG, RG, WD, [{"bias_correction": False}, {"bias_correction": True}]))
        for k, options in enumerate(sweep):
            kwarg = _merged(options)
            if dtype == np.float16:
                kwarg["multi_precision"] = True
            shapes = layer * 4 if full_multilamb else layer if k == len(sweep) - 1 else layer[:3]
            add("test_multilamb", ref.PyLAMB, "lamb", kwarg, dtype, shape=shapes, rtol=1e-6, atol=1e-3)
    # test_sgld (compare_optimizer_noise_seeded: the same noise on both sides)
    for seed in (1234, 42):
        for dtype in (np.float16, np.float32, np.float64):
            for options in itertools.product(CG, WD, MP):
                kwarg = _merged(options)
                if _fp16_without_mp(dtype, kwarg):
                    continue
                tol = {"atol": 1e-2, "rtol": 1e-4} if dtype == np.float16 else {"atol": 1e-3, "rtol": 1e-5}
                add("test_sgld", ref.PySGLD, "sgld", kwarg, dtype, noise_seed=seed, **tol)
    # test_ftml
    b1 = [{}, {"beta1": 0.5}, {"beta1": 0.7}]
    b2 = [{}, {"beta2": 0.8}, {"beta2": 0.9}]
    for options in itertools.product(b1, b2, CG, RG, WD):
        add("test_ftml", ref.PyFTML, "ftml", _merged(options), np.float32, rtol=1e-3, atol=1e-4)
    # test_adam
    for dtype in (np.float16, np.float32, np.float64):
        for options in itertools.product(CG, RG, WD, MP):
            kwarg = _merged(options)
            if _fp16_without_mp(dtype, kwarg):
                continue
            tol = {"rtol": 1e-4, "atol": 2e-5}
            eager = {"lazy_update": False, **kwarg}
            add("test_adam", ref.PyAdam, "adam", kwarg, dtype, ref_kwarg=eager, **tol)
            add("test_adam", ref.PyAdam, "adam", kwarg, dtype, w_stype="row_sparse", g_stype="row_sparse", **tol)
            add("test_adam", ref.PyAdam, "adam", eager, dtype, w_stype="row_sparse", g_stype="row_sparse", **tol)
            add("test_adam", ref.PyAdam, "adam", kwarg, dtype, g_stype="row_sparse", **tol)
            add("test_adam", ref.PyAdam, "adam", eager, dtype, g_stype="row_sparse", **tol)
    # test_adamax
    for dtype in (np.float16, np.float32, np.float64):
        for options in itertools.product(CG, RG, WD, MP):
            kwarg = _merged(options)
            if not _fp16_without_mp(dtype, kwarg):
                add("test_adamax", ref.PyAdamax, "adamax", kwarg, dtype)
    # test_signum
    wd_lh = [{}, {"wd_lh": 0.015}, {"wd_lh": 0.0}]
    lrs = [{"learning_rate": 0.05}, {"learning_rate": 0.01}]
    for dtype in (np.float32, np.float64):
        for options in itertools.product(CG, RG, WD, wd_lh, lrs, MOM):
            add("test_signum", ref.PySignum, "signum", _merged(options), dtype)
    # test_rms
    cw = [{}, {"clip_weights": 0.01}]
    centered = [{}, {"centered": False}, {"centered": True}]
    for dtype in (np.float16, np.float32):
        tol = {"rtol": 1e-1, "atol": 1e-1} if dtype == np.float16 else {"rtol": 1e-2, "atol": 1e-2}
        for options in itertools.product(cw, CG, centered, RG, WD, MP):
            kwarg = _merged(options)
            if _fp16_without_mp(dtype, kwarg):
                continue
            add("test_rms", ref.PyRMSProp, "rmsprop", kwarg, dtype, **tol)
            add("test_rms", ref.PyRMSProp, "rmsprop", kwarg, dtype, g_stype="row_sparse", **tol)
    # test_ftrl
    for kwarg in ({}, {"clip_gradient": 0.5}, {"clip_gradient": 0.4, "rescale_grad": 0.14}, {"rescale_grad": 0.8},
                  {"clip_gradient": 0.5, "wd": 0.07}, {"clip_gradient": 0.4, "rescale_grad": 0.14, "wd": 0.03},
                  {"rescale_grad": 0.8, "wd": 0.05}, {"rescale_grad": 0.8, "wd": 0.05, "lamda1": 0.01},
                  {"clip_gradient": 0.5, "wd": 0.07, "lamda1": 1.0}):
        add("test_ftrl", ref.PyFtrl, "ftrl", kwarg, np.float32)
        add("test_ftrl", ref.PyFtrl, "ftrl", kwarg, np.float32, ref_kwarg={"lazy_update": True, **kwarg},
            w_stype="row_sparse", g_stype="row_sparse")
    # test_adagrad
    for options in itertools.product([{}, {"eps": 1e-8}], CG, RG, [{}, {"wd": 0.0}]):
        kwarg = _merged(options)
        add("test_adagrad", ref.PyAdaGrad, "adagrad", kwarg, np.float32)
        if kwarg.get("wd", 0.0) == 0.0:
            add("test_adagrad", ref.PyAdaGrad, "adagrad", kwarg, np.float32, w_stype="row_sparse",
                g_stype="row_sparse")
            add("test_adagrad", ref.PyAdaGrad, "adagrad", kwarg, np.float32, g_stype="row_sparse")
    # test_adadelta
    for dtype in (np.float16, np.float32):
        for options in itertools.product([{"rho": 0.9}], [{}, {"epsilon": 1e-8}], CG, RG, [{}, {"wd": 0.0}]):
            kwarg = _merged(options)
            if dtype == np.float16:
                kwarg["multi_precision"] = True
            add("test_adadelta", ref.PyAdaDelta, "adadelta", kwarg, dtype)
    return cases


CASES = _cases()


# -- compare_optimizer ------------------------------------------------------------------

def _data(case: Case, rng):
    """compare_optimizer's weight and gradient (dense arrays) and the gradient's rows."""
    shape, dtype = case.shape, case.dtype
    if case.w_stype == "default":
        w = ref.uniform(rng, shape, dtype)
    elif case.w_stype == "row_sparse":
        w, _ = ref.rand_row_sparse(rng, shape, dtype, density=1)
    else:
        w = ref.rand_csr(rng, shape, dtype, density=1)
    rows = None
    if case.g_stype == "default":
        g = ref.uniform(rng, shape, dtype)
    elif case.g_stype == "row_sparse":
        g, rows = ref.rand_row_sparse(rng, shape, dtype)
    else:
        g = ref.rand_csr(rng, shape, dtype)
    return w, g, rows


def _update_ours(case: Case, o, w, g, rows, kernels=None) -> list:
    """One update of ``w`` by ``g`` as the stores make it; returns the state arrays (the
    master copy first), shaped as the weight. ``kernels``: tests/optimizer/host_kernels.py,
    to make a dense update with the fused kernel a GPU server runs, built for the host."""
    if case.w_stype == "row_sparse":          # a row-sparse key: its weight is (rows, width)
        u = opt.Updater(o)
        n = w.shape[0]
        u.update_rows(0, rows, g.reshape(n, -1)[rows], w.reshape(n, -1))
        return [s.reshape(w.shape) for s in u.get_states()[0]["state"]]
    if case.g_stype == "row_sparse":          # a row-sparse push on a dense key
        u = opt.Updater(o)
        u.update_lazy(0, g, w, rows)
        return [s.reshape(w.shape) for s in u.get_states()[0]["state"]]
    state = o.create_state(w)
    if kernels is None:
        o.update(w, g, state, 1, index=0)
    elif o.keeps_master(w.dtype):                 # the float32 master copy, as Optimizer.update
        kernels.fused_update(o, state[0], g.astype(np.float32), state[1:], 1)
        w[...] = state[0]
    else:
        kernels.fused_update(o, w, g, state, 1)
    return list(state)


def _ours_as_reference(case: Case, reference, ref_state, ours: list, dtype):
    """Our state arrays nested as the reference's state."""
    order = reference.state_order(multi_precision=dtype == np.float16 and bool(case.kwargs.get("multi_precision")))
    arrays = ours if order is None else [ours[i] for i in order]
    if len(arrays) != len(ref.leaves(ref_state)):
        raise AssertionError(f"state: the reference keeps {len(ref.leaves(ref_state))} arrays, ours {len(arrays)}")
    return ref.nest_like(ref_state, list(arrays))


def run_case(case: Case, monkeypatch=None, perturb: float | None = None, kernels=None) -> float:
    """MXNet's compare_optimizer (and, for SGLD, compare_optimizer_noise_seeded) for one
    case; raises AssertionError where ours differs beyond the case's tolerance.
    ``perturb``: our update step scaled by 1 + perturb before the comparison (the check
    that the tolerance catches such an error). ``kernels``: see :func:`_update_ours`. Returns the largest change of a weight
    (or of its float32 master copy) that the reference made."""
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    reference = case.reference(**case.ref_kwargs)
    o = opt.create(case.name, **case.kwargs)
    if case.noise_seed is not None:
        _same_noise(case.noise_seed, reference, monkeypatch)
    shapes = case.shape if isinstance(case.shape, list) else [case.shape]
    largest = 0.0
    for index, shape in enumerate(shapes):
        one = dataclasses.replace(case, shape=shape)
        w2, g2, rows = _data(one, rng)
        w1, g1 = w2.copy(), g2.copy()
        w0 = w2.copy()
        state1 = reference.create_state_multi_precision(index, w1)
        if not isinstance(case.shape, list):     # the multi-tensor comparison skips this
            ref.compare_ndarray_tuple(state1, _ours_as_reference(case, reference, state1, list(o.create_state(w2)),
                                                                 w2.dtype), what="initial state")
        reference.update_multi_precision(index, w1, g1, state1)
        ours = _update_ours(one, o, w2, g2, rows, kernels)
        if perturb is not None:
            _scale_step(w2, w0, ours, 1.0 + perturb)
        where = f" of tensor {index}" if len(shapes) > 1 else ""
        ref.compare_ndarray_tuple(state1, _ours_as_reference(case, reference, state1, ours, w2.dtype), case.rtol,
                                  case.atol, what="state" + where)
        ref.assert_almost_equal(w1, w2, case.rtol, case.atol, what="weight" + where)
        # the steps, of the weights or (float16) of their float32 master copies
        mine, theirs = w2, w1
        if w1.dtype == np.float16 and case.kwargs.get("multi_precision"):
            order = reference.state_order(multi_precision=True)
            mine, theirs = ours[0], ref.leaves(state1)[0 if order is None else order.index(0)]
        largest = max(largest, assert_same_step(theirs, mine, w0, what="step" + where))
    return largest


STEP_RTOL, STEP_ATOL = 1e-2, 1e-3


def assert_same_step(theirs, mine, w0, what="step") -> float:
    """The check MXNet's tolerances need where they would pass a 10% error: our step
    (the change of the weight) against the reference's, within 1% of each element's
    step and 0.1% of the largest; returns the largest step."""
    step = theirs.astype(np.float64) - w0
    largest = float(np.max(np.abs(step))) if step.size else 0.0
    ref.assert_almost_equal(step, mine.astype(np.float64) - w0, STEP_RTOL, STEP_ATOL * largest, what)
    return largest


def _scale_step(w, w0, state, factor) -> None:
    """Our result off by ``factor - 1`` of its step: the weight's change (and a master
    copy's) scaled by ``factor``."""
    w[...] = (w0.astype(np.float64) + factor * (w.astype(np.float64) - w0)).astype(w.dtype)
    if state and state[0].dtype == np.float32 and w.dtype == np.float16:
        master = state[0]
        master[...] = w0.astype(np.float64) + factor * (master.astype(np.float64) - w0)


def _same_noise(seed: int, reference, monkeypatch) -> None:
    """MXNet's ``mx.random.seed(noise_seed)`` before each update: both draw the same
    standard normals (ours from sgld.standard_normal, scaled by sqrt(lr) there)."""
    def normal(loc, scale, shape, dtype):
        z = np.random.default_rng(seed).standard_normal(shape)
        return (loc + scale * z).astype(dtype)

    def standard_normal(seed_, index, t, positions, xp):
        return np.random.default_rng(seed).standard_normal(positions.shape)
    reference.normal = normal
    monkeypatch.setattr(sgld, "standard_normal", standard_normal)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_compare_optimizer(case, monkeypatch):
    run_case(case, monkeypatch)


# SGLD has no fused kernel (its noise is drawn apart); a row-sparse update is by rows
FUSED = [c for c in CASES if c.name != "sgld" and "row_sparse" not in (c.w_stype, c.g_stype)]


@pytest.mark.parametrize("test", sorted({c.test for c in FUSED}))
def test_compare_optimizer_with_the_fused_kernels(test):
    """The dense cases again, each update by the fused kernel of a GPU server (its CUDA
    source built for the host, as CI checks the kernels): all of a test's cases in one
    item, the failures listed."""
    hk = pytest.importorskip("host_kernels")
    if hk.compiler() is None:
        pytest.skip("needs a C++ compiler (g++) to build the fused kernels for the host")
    failed = []
    for case in (c for c in FUSED if c.test == test):
        try:
            run_case(case, kernels=hk)
        except AssertionError as e:
            failed.append(f"{case.id}: {str(e).splitlines()[0]}")
    assert not failed, f"{len(failed)} case(s) differ:\n" + "\n".join(failed)


def test_the_port_has_every_compare_optimizer_call_of_mxnets_file():
    per_test = {}
    for c in CASES:
        per_test[c.test] = per_test.get(c.test, 0) + 1
    assert per_test == {"test_sgd": 936, "test_sparse_sgd": 432, "test_std_sparse_sgd": 144, "test_nag": 504,
                        "test_lamb": 1944, "test_multilamb": 216, "test_sgld": 168, "test_ftml": 324,
                        "test_adam": 1260, "test_adamax": 252, "test_signum": 864, "test_rms": 1728,
                        "test_ftrl": 18, "test_adagrad": 108, "test_adadelta": 72}
    assert len({c.id for c in CASES}) == len(CASES)


# -- the tolerances against a 10% error -----------------------------------------------

TESTS = sorted({c.test for c in CASES})


@pytest.mark.parametrize("test", TESTS)
def test_a_ten_percent_error_fails_the_comparison(test, monkeypatch):
    """Every case whose reference moved the weight fails when our step is 10% too long
    or too short. A case whose gradient has no rows (row-sparse at a random density,
    as MXNet draws it) and no weight decay moves nothing: there is no step to get wrong."""
    moved = 0
    for case in (c for c in CASES if c.test == test):
        if run_case(case, monkeypatch) == 0.0:
            continue
        moved += 1
        for error in (0.1, -0.1):
            with pytest.raises(AssertionError):
                run_case(case, monkeypatch, perturb=error)
    assert moved >= 0.7 * sum(c.test == test for c in CASES)


def test_mxnets_own_tolerances_miss_a_ten_percent_error_of_rmsprop_and_float16_lamb():
    """Why run_case compares the steps too: with test_rms's tolerances (atol 1e-2, and 1e-1
    for float16) and test_lamb's for float16 (atol 1e-3), a step of 0.003 (RMSProp at its
    rate of 0.001) or 0.0006 (LAMB's first) passes 10% off, or not taken at all."""
    for test, dtype in (("test_rms", np.float32), ("test_rms", np.float16), ("test_lamb", np.float16)):
        case = next(c for c in CASES if c.test == test and c.dtype == dtype and c.g_stype == "default"
                    and not c.kwargs.get("clip_weights"))
        rng = np.random.default_rng(0)
        w, g, _ = _data(case, rng)
        w0 = w.copy()
        reference = case.reference(**case.ref_kwargs)
        state = reference.create_state_multi_precision(0, w)
        reference.update_multi_precision(0, w, g, state)
        for error in (0.1, -1.0):
            off = (w0.astype(np.float64) + (1 + error) * (w.astype(np.float64) - w0)).astype(w.dtype)
            assert ref.almost_equal(w, off, case.rtol, case.atol)
            with pytest.raises(AssertionError):
                assert_same_step(w, off, w0)


# -- MXNet's other tests of the file ------------------------------------------------------

def test_learning_rate():
    o1 = opt.Optimizer(learning_rate=0.01)
    # MXNet's o1.set_learning_rate(0.2): an optimizer is immutable here (kv.set_learning_rate
    # replaces the servers' with this one)
    o1 = opt.create("sgd", learning_rate=0.01).with_learning_rate(0.2)
    assert o1.learning_rate == 0.2

    lr_s = opt.FactorScheduler(step=1)
    o2 = opt.Optimizer(lr_scheduler=lr_s, learning_rate=0.3)
    assert o2.learning_rate == 0.3
    o2.lr_scheduler.base_lr = 0.4
    assert o2.learning_rate == 0.4

    lr_s = opt.FactorScheduler(step=1, base_lr=1024)
    o3 = opt.Optimizer(lr_scheduler=lr_s)
    assert o3.learning_rate == 1024


def test_learning_rate_expect_user_warning():
    # MXNet raises UserWarning; here ConfigError (docs/api.md, MXNet-options table)
    o = opt.create("sgd", lr_scheduler=opt.FactorScheduler(step=1), learning_rate=0.3)
    with pytest.raises(ConfigError, match="lr_scheduler"):
        o.with_learning_rate(0.5)


def test_lr_wd_mult():
    """MXNet's Module with fc1 at lr_mult 0 (its bias at 1) and fc2 at wd_mult 0.5: one SGD
    step (learning_rate 1, Module's rescale_grad 1/batch) of a two-layer net whose output
    is its own gradient, through an Updater with MXNet's index-to-name table."""
    names = ["fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"]
    o = opt.create("sgd", learning_rate=1.0, rescale_grad=1 / 5, param_idx2name=dict(enumerate(names)),
                   lr_mult={"fc1_bias": 1.0, "fc1_weight": 0.0}, wd_mult={"fc2_bias": 0.5, "fc2_weight": 0.5})
    assert o.lr_mult == {"fc1_bias": 1.0, "fc1_weight": 0.0}
    assert o.wd_mult == {"fc2_bias": 0.5, "fc2_weight": 0.5, "fc1_bias": 0.0}
    rng = np.random.default_rng(0)
    # mx.init.Uniform(1.0): weights uniform in [-1, 1], biases 0
    args1 = {"fc1_weight": rng.uniform(-1, 1, (10, 10)), "fc1_bias": np.zeros(10),
             "fc2_weight": rng.uniform(-1, 1, (10, 10)), "fc2_bias": np.zeros(10)}
    args1 = {k: v.astype(np.float32) for k, v in args1.items()}
    args2 = {k: v.copy() for k, v in args1.items()}
    data = rng.uniform(-1, 1, (5, 10)).astype(np.float32)
    fc1 = data @ args2["fc1_weight"].T + args2["fc1_bias"]
    fc2 = fc1 @ args2["fc2_weight"].T + args2["fc2_bias"]
    d2 = fc2                                      # mod.backward(mod.get_outputs())
    d1 = d2 @ args2["fc2_weight"]
    grads = {"fc1_weight": d1.T @ data, "fc1_bias": d1.sum(0), "fc2_weight": d2.T @ fc1, "fc2_bias": d2.sum(0)}
    u = opt.Updater(o)
    for i, name in enumerate(names):
        u(i, grads[name], args2[name])
    assert ref.almost_equal(args1["fc1_weight"], args2["fc1_weight"], 1e-10)
    assert not ref.almost_equal(args1["fc1_bias"], args2["fc1_bias"], 1e-1)
    assert not ref.almost_equal(args1["fc2_weight"], args2["fc2_weight"], 1e-1)


def test_nadam():
    """MXNet's Module.fit of a 10-128-64-1 ReLU net (Xavier(magnitude=2), L1 loss) on 20
    random points for 60 epochs of 4 batches with Nadam (learning_rate 0.001, wd 0.0005;
    Module's rescale_grad 1/batch, biases without weight decay by their names): the
    loss ends below 0.11. Forward and backward in NumPy."""
    rng = np.random.default_rng(0)
    n, batch = 20, 5
    data = rng.uniform(-1, 1, (n, 10)).astype(np.float32)
    label = rng.uniform(-1, 1, (n, 1)).astype(np.float32)
    sizes = [(128, 10), (64, 128), (1, 64)]
    params = []
    for rows, cols in sizes:
        scale = math.sqrt(2.0 / ((rows + cols) / 2.0))     # Xavier: uniform, factor_type "avg"
        params += [rng.uniform(-scale, scale, (rows, cols)).astype(np.float32), np.zeros(rows, np.float32)]
    names = [f"fc{i // 2 + 1}_{'weight' if i % 2 == 0 else 'bias'}" for i in range(6)]
    u = opt.Updater(opt.create("nadam", learning_rate=0.001, wd=0.0005, rescale_grad=1 / batch,
                               param_idx2name=dict(enumerate(names))))

    def forward(x):
        acts = [x]
        for k in range(3):
            z = acts[-1] @ params[2 * k].T + params[2 * k + 1]
            acts.append(np.maximum(z, 0) if k < 2 else z)
        return acts

    for _ in range(60):
        order = rng.permutation(n)
        for b in range(0, n, batch):
            x, y = data[order[b:b + batch]], label[order[b:b + batch]]
            acts = forward(x)
            delta = np.sign(acts[-1] - y)                  # L1Loss, summed over the batch by make_loss
            grads = [None] * 6
            for k in (2, 1, 0):
                grads[2 * k], grads[2 * k + 1] = delta.T @ acts[k], delta.sum(0)
                if k:
                    delta = (delta @ params[2 * k]) * (acts[k] > 0)
            for i in range(6):
                u(i, grads[i], params[i])
    loss = float(np.mean(np.abs(forward(data)[-1] - label)))
    assert loss < 0.11, loss


def test_factor_scheduler():
    base_lr, step, factor = 1, 100, 0.1
    sched = opt.FactorScheduler(step, factor, stop_factor_lr=1e-4, base_lr=base_lr, warmup_steps=20,
                                warmup_begin_lr=0.1, warmup_mode="constant")
    assert sched(0) == 0.1
    np.testing.assert_almost_equal(sched(10), 0.1)
    assert sched(21) == base_lr, sched(21)
    np.testing.assert_almost_equal(sched(101), base_lr * factor)
    np.testing.assert_almost_equal(sched(201), base_lr * factor * factor)
    np.testing.assert_almost_equal(sched(1000), 1e-4)


def test_multifactor_scheduler():
    base_lr, steps, factor = 0.1, [15, 25], 0.1
    sched = opt.MultiFactorScheduler(steps, factor, base_lr=base_lr, warmup_steps=10, warmup_begin_lr=0.05,
                                     warmup_mode="linear")
    assert sched(0) == 0.05
    np.testing.assert_almost_equal(sched(5), 0.05 + (base_lr - 0.05) / 2)
    np.testing.assert_almost_equal(sched(15), base_lr)
    np.testing.assert_almost_equal(sched(16), base_lr * factor)
    np.testing.assert_almost_equal(sched(20), base_lr * factor)
    np.testing.assert_almost_equal(sched(26), base_lr * factor * factor)
    np.testing.assert_almost_equal(sched(100), base_lr * factor * factor)


def test_poly_scheduler():
    base_lr, final_lr, steps = 3, 0, 1000
    poly_sched = opt.PolyScheduler(steps, base_lr=base_lr, pwr=2, final_lr=final_lr, warmup_steps=100,
                                   warmup_begin_lr=0, warmup_mode="linear")
    np.testing.assert_almost_equal(poly_sched(0), 0)
    np.testing.assert_almost_equal(poly_sched(50), float(base_lr) / 2)
    np.testing.assert_almost_equal(poly_sched(100), base_lr)
    assert poly_sched(101) < poly_sched(100)
    assert poly_sched(500) < 1.6
    np.testing.assert_almost_equal(poly_sched(steps), final_lr)


def test_cosine_scheduler():
    # also tests case without warmup
    base_lr, final_lr, steps = 3, 0.1, 1000
    cosine_sched = opt.CosineScheduler(steps, base_lr=base_lr, final_lr=final_lr)
    np.testing.assert_almost_equal(cosine_sched(0), base_lr)
    np.testing.assert_almost_equal(cosine_sched(steps), final_lr)
    assert cosine_sched(500) > 1.5


def test_schedulers_are_defined_before_the_first_update_as_mxnets():
    """Not MXNet's test: ``t = 0`` (MXNet's ``num_update`` before any update, which its
    tests above call) is the warm-up's first rate or the base; below 0, or not an int,
    is refused. An update's count stays 1-based (Optimizer.update refuses 0)."""
    assert opt.FactorScheduler(2, 0.5, base_lr=1.0)(0) == 1.0
    assert [opt.FactorScheduler(2, 0.5, base_lr=1.0)(t) for t in range(6)] == [1.0, 1.0, 1.0, 0.5, 0.5, 0.25]
    assert opt.CosineScheduler(10, base_lr=2.0, warmup_steps=2, warmup_begin_lr=0.5)(0) == 0.5
    with pytest.raises(ValueError, match=">= 0"):
        opt.PolyScheduler(10, base_lr=1.0)(-1)
    with pytest.raises(TypeError):
        opt.PolyScheduler(10, base_lr=1.0)(True)
    with pytest.raises(ValueError, match="1-based"):
        o = opt.create("sgd", lr_scheduler=opt.FactorScheduler(2))
        w = np.zeros(2, np.float32)
        o.update(w, w.copy(), o.create_state(w), 0)


# -- a report: cases, passes and failures by MXNet test and option --------------------------

def report(cases: list[Case], out=print) -> int:
    """Run ``cases`` and print, for each MXNet test, its cases, passes and failures, and
    the same by dtype, storage and each option's value; then every failure. Returns the
    number of failures."""
    failures: dict[str, str] = {}
    with pytest.MonkeyPatch.context() as mp:
        for case in cases:
            try:
                run_case(case, mp)
            except AssertionError as e:
                failures[case.id] = str(e).splitlines()[0]
            mp.undo()
    for test in sorted({c.test for c in cases}, key=[c.test for c in cases].index):
        mine = [c for c in cases if c.test == test]
        bad = sum(c.id in failures for c in mine)
        out(f"{test}: {len(mine)} cases, {len(mine) - bad} passed, {bad} failed")
        groups: dict[str, dict[str, list[int]]] = {}
        for c in mine:
            facets = {"dtype": np.dtype(c.dtype).name, "storage": f"{c.w_stype}/{c.g_stype}"}
            keys = sorted({k for x in mine for k in (*x.kwargs, *x.ref_kwargs)})
            facets.update({k: f"{c.kwargs.get(k, '-')}" + (f" (reference {c.ref_kwargs[k]})" if k in c.ref_kwargs
                                                            and c.ref_kwargs[k] != c.kwargs.get(k) else "")
                           for k in keys})
            for facet, value in facets.items():
                tally = groups.setdefault(facet, {}).setdefault(value, [0, 0])
                tally[0] += 1
                tally[1] += c.id not in failures
        for facet, values in groups.items():
            out(f"    {facet}: " + ", ".join(f"{v} {p}/{n}" for v, (n, p) in values.items()))
    for case_id, why in failures.items():
        out(f"FAILED {case_id}: {why}")
    out(f"{len(cases)} cases, {len(cases) - len(failures)} passed, {len(failures)} failed")
    return len(failures)


if __name__ == "__main__":
    # python tests/optimizer/test_mxnet_unittest_port.py [--full-multilamb]
    import sys
    sys.exit(1 if report(_cases(full_multilamb="--full-multilamb" in sys.argv)) else 0)
