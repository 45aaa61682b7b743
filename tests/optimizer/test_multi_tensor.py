"""The multi-tensor optimizer updates (kvstore/optimizer/multi_tensor.py): one kernel
over many chunks against one fused kernel per chunk (kvstore/optimizer/fused.py).

CI has no GPU: the multi-tensor kernel's CUDA source is compiled for the host
(tests/optimizer/host_kernels.py) and run over the tables a batch builds, through
the real entry point (``Updater`` -> ``Optimizer.update`` -> the open batch) on the
host device (kvstore.devices.HostDevice, whose arrays stand for device memory). It
must give the bits of the per-chunk fused kernels, built for the host the same way,
for every optimizer with an elementwise kernel, on chunks of different sizes with
their own ``lr_mult`` and ``wd_mult``. The GPU test of the CUDA build is in
tests/server/test_gpu_server.py.
"""

import copy

import numpy as np
import pytest

from kvstore import optimizer as opt
from kvstore.devices import HostDevice
from kvstore.optimizer import fused, multi_tensor
from kvstore.optimizer.multi_tensor import MultiTensorBatch

from test_fused_optimizer import VARIANTS, _data, _forbid_step

# every variant with an elementwise kernel (LARS and LAMB: two phases, per chunk)
ELEMENTWISE = [v for v, (name, _) in VARIANTS.items() if name not in ("lars", "lamb")]
SIZES = {"a": 1, "b": 7, "c": 1000, "d": 4099, "e": 300}        # one chunk per key, sizes differ
MULTS = {"lr_mult": {"b": 0.5, "d": 2.0, "e": 0.25}, "wd_mult": {"a": 0.0, "c": 3.0, "e": 0.25}}
COMMON = {"wd": 1e-2, "rescale_grad": 0.5, "clip_gradient": 0.3}
STEPS = 3


@pytest.fixture
def hk():
    import host_kernels
    if host_kernels.compiler() is None:
        pytest.skip("needs a C++ compiler (g++) to build the kernels for the host")
    return host_kernels


def _optimizer(variant, **extra):
    name, hp = VARIANTS[variant]
    return opt.create(name, **dict(hp, **COMMON, **MULTS, **extra))


def _chunks(dtype, seed):
    """``{weight: (w0, [grads])}``: a server's weights ``(key, 0)``, one chunk each."""
    return {(k, 0): _data(n, dtype, seed=seed + i) for i, (k, n) in enumerate(SIZES.items())}


def _on_device(dev, a):
    d = dev.empty(a.size, a.dtype)
    d[...] = a
    return d


def _per_chunk_kernels(hk, variant, chunks, dtype):
    """One fused kernel (built for the host) per chunk and step, with the scalars the
    per-chunk path gives it: the weight's multipliers, its count, its rate."""
    o = _optimizer(variant)
    out = {}
    for index, (w0, grads) in chunks.items():
        view = o.for_index(index)
        w = w0.copy()
        state = view.create_state(w)
        for t, g in enumerate(grads[:STEPS], 1):
            lr = o.learning_rate_at(t) * view.lr_scale
            name, args = fused.plan_call(view, w.dtype, state, t, lr)
            hk.kernel(name, dtype)(np.ascontiguousarray(g), *args, w, *state)
        out[index] = (w, state)
    return out


def _batched(variant, chunks, dev, **extra):
    """The chunks updated by an Updater as a server event does it: every chunk's
    update of a step planned while one batch is open, run when it closes."""
    o = _optimizer(variant, **extra)
    _forbid_step(o)
    updater = opt.Updater(o)
    weights, batch = _steps_in_batches(updater, chunks, dev)
    states = updater.get_states()
    return {index: (weights[index], tuple(states[index]["state"])) for index in chunks}, batch


def _steps_in_batches(updater, chunks, dev, planned=None):
    """``STEPS`` server events: each step's update of every chunk (on ``dev``) planned
    while one batch is open; ``planned(t, weight, weight)`` runs after each plan, inside
    the batch. Returns the weights and the batch."""
    batch = MultiTensorBatch(dev)
    weights = {index: _on_device(dev, w0) for index, (w0, _) in chunks.items()}
    for t in range(STEPS):
        with batch.collect():
            for index, (_, grads) in chunks.items():
                updater(index, _on_device(dev, grads[t]), weights[index])
                if planned is not None:
                    planned(t, index, weights[index])
    return weights, batch


def _generic(variant, chunks):
    o = _optimizer(variant)
    updater = opt.Updater(o)
    weights = {index: w0.copy() for index, (w0, _) in chunks.items()}
    for t in range(STEPS):
        for index, (_, grads) in chunks.items():
            updater(index, grads[t], weights[index])
    states = updater.get_states()
    return {index: (weights[index], tuple(states[index]["state"])) for index in chunks}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("variant", ELEMENTWISE)
def test_one_launch_over_every_chunk_gives_the_bits_of_one_kernel_per_chunk(hk, variant, dtype):
    chunks = _chunks(dtype, seed=len(variant))
    want = _per_chunk_kernels(hk, variant, chunks, dtype)
    got, batch = _batched(variant, chunks, HostDevice(kernels=hk.run_group))
    assert (batch.launches, batch.updates) == (STEPS, STEPS * len(chunks))     # one launch per event
    for index, ((w, state), (w_want, state_want)) in zip(got, zip(got.values(), want.values())):
        np.testing.assert_array_equal(np.asarray(w), w_want, err_msg=f"{variant} {index} weight")
        assert len(state) == len(state_want)
        for k, (s, s_want) in enumerate(zip(state, state_want)):
            np.testing.assert_array_equal(np.asarray(s), s_want, err_msg=f"{variant} {index} state {k}")
    # and both are the numpy path's update (as the fused kernels' own tests compare them)
    rtol, atol = (1e-5, 1e-6) if dtype == np.float32 else (1e-10, 1e-12)
    for index, (w_np, state_np) in _generic(variant, chunks).items():
        np.testing.assert_allclose(np.asarray(got[index][0]), w_np, rtol=rtol, atol=atol, err_msg=f"{variant} {index}")
        for s, s_np in zip(got[index][1], state_np):
            np.testing.assert_allclose(np.asarray(s), s_np, rtol=rtol, atol=atol)
    moved = [index for index, (w0, _) in chunks.items() if not np.array_equal(np.asarray(got[index][0]), w0)]
    assert len(moved) == len(chunks), moved


@pytest.mark.parametrize("variant", ["sgd_momentum", "adam", "ftrl"])
def test_the_host_device_loop_runs_each_update_by_its_own_code(variant):
    """Without a kernel the host device runs a group as the per-chunk numpy updates, in
    turn: the batching (what it takes, when it runs) is the GPU's, the math numpy's."""
    chunks = _chunks(np.float32, seed=3)
    want = _generic(variant, chunks)
    name, hp = VARIANTS[variant]
    o = _optimizer(variant)
    updater = opt.Updater(o)

    def planned(t, index, weight):
        np.testing.assert_array_equal(weight, chunks[index][0] if t == 0 else weight)
    weights, batch = _steps_in_batches(updater, chunks, HostDevice(), planned)
    assert (batch.launches, batch.updates) == (STEPS, STEPS * len(chunks))
    for index, (w, _) in want.items():
        np.testing.assert_array_equal(np.asarray(weights[index]), w)


def test_an_update_waits_in_the_batch_until_it_closes_or_is_settled(hk):
    dev = HostDevice(kernels=hk.run_group)
    o = opt.SGD(learning_rate=0.5)
    updater = opt.Updater(o)
    w = _on_device(dev, np.ones(4, np.float32))
    batch = MultiTensorBatch(dev)
    with batch.collect():
        updater("k", _on_device(dev, np.ones(4, np.float32)), w)
        np.testing.assert_array_equal(w, 1.0)              # planned, not run
        multi_tensor.settle(_on_device(dev, np.ones(4, np.float32)))   # another array: still waits
        np.testing.assert_array_equal(w, 1.0)
        multi_tensor.settle(w)                             # about to be read: runs now
        np.testing.assert_array_equal(w, 0.5)
        updater("k", _on_device(dev, np.ones(4, np.float32)), w)
        updater("k", _on_device(dev, np.ones(4, np.float32)), w)    # the same weight: the first runs first
        np.testing.assert_array_equal(w, 0.0)
    np.testing.assert_array_equal(w, -0.5)
    assert (batch.launches, batch.updates) == (3, 3)
    assert multi_tensor.collecting() is None


def test_updates_of_several_kernels_and_dtypes_are_one_launch_each(hk):
    dev = HostDevice(kernels=hk.run_group)
    batch = MultiTensorBatch(dev)
    sgd, adam = opt.Updater(opt.SGD(learning_rate=0.1, momentum=0.9)), opt.Updater(opt.Adam(learning_rate=0.1))
    ws = [_on_device(dev, np.ones(n, dtype)) for n, dtype in ((5, np.float32), (6, np.float64), (7, np.float32))]
    with batch.collect():
        for i, w in enumerate(ws):
            sgd(i, _on_device(dev, np.ones(w.size, w.dtype)), w)
            adam(i, _on_device(dev, np.ones(w.size, w.dtype)), _on_device(dev, np.ones(w.size, w.dtype)))
    assert (batch.launches, batch.updates) == (4, 6)      # sgd_mom and adam, each in float32 and float64
    for w in ws:
        np.testing.assert_allclose(w, 1.0 - 0.1, rtol=1e-6)


def _fallback_cases():
    f16 = np.float16
    return {
        "float16 weight": (opt.SGD(learning_rate=0.5), f16, {}),
        "LARS (two phases)": (opt.create("lars", learning_rate=0.5, eta=0.01), np.float32, {}),
        "LAMB (two phases)": (opt.create("lamb", learning_rate=0.01), np.float32, {}),
        "SGLD (no kernel)": (opt.create("sgld", learning_rate=0.01), np.float32, {}),
        "a subclass": (type("MySGD", (opt.SGD,), {})(learning_rate=0.5), np.float32, {}),
        "fused off": (opt.SGD(learning_rate=0.5), np.float32, {"disable": True}),
        "host arrays": (opt.SGD(learning_rate=0.5), np.float32, {"host": True}),
    }


@pytest.mark.parametrize("case", list(_fallback_cases()))
def test_what_a_batch_does_not_take_is_updated_at_once_per_chunk(case, monkeypatch):
    o, dtype, how = _fallback_cases()[case]
    if how.get("disable"):
        monkeypatch.setattr(fused, "ENABLED", False)
    dev = HostDevice()
    batch = MultiTensorBatch(dev)
    rng = np.random.default_rng(0)
    w0, g = rng.standard_normal(8).astype(dtype), rng.standard_normal(8).astype(dtype)
    ref, want = opt.Updater(copy.deepcopy(o)), w0.copy()
    w = w0.copy() if how.get("host") else _on_device(dev, w0)
    updater = opt.Updater(o)
    with batch.collect():
        updater(("k", 0), g if how.get("host") else _on_device(dev, g), w)
        assert batch.updates == 0 and not np.array_equal(w, w0), "updated at once"
    assert batch.launches == 0
    if case != "SGLD (no kernel)":        # (SGLD draws its noise per update)
        ref(("k", 0), g, want)
        np.testing.assert_array_equal(np.asarray(w), want)


def test_a_lazy_update_of_some_rows_is_not_batched():
    dev = HostDevice()
    batch = MultiTensorBatch(dev)
    updater = opt.Updater(opt.SGD(learning_rate=0.5))       # lazy on dense keys (MXNet's lazy_update)
    w = _on_device(dev, np.ones(6, np.float32))
    with batch.collect():
        updater.update_lazy("k", _on_device(dev, np.ones(6, np.float32)), w, np.array([1, 4]))
        np.testing.assert_array_equal(w, [1, 0.5, 1, 1, 0.5, 1])
    assert batch.updates == 0


def test_multi_precision_rounds_the_master_after_its_batched_update(hk):
    """The float32 master copy's update is taken, and run before the float16 weight is
    rounded from it (Optimizer.update settles it): the numpy path's values."""
    dev = HostDevice(kernels=hk.run_group)
    batch = MultiTensorBatch(dev)
    o = opt.SGD(learning_rate=0.5, momentum=0.9, multi_precision=True)
    w0 = np.linspace(-1, 1, 9).astype(np.float16)
    g = np.full(9, 0.25, np.float16)
    want = w0.copy()
    ref = opt.Updater(opt.from_config(o.to_config()))
    updater = opt.Updater(o)
    w = _on_device(dev, w0)
    for _ in range(2):
        with batch.collect():
            updater("k", _on_device(dev, g), w)
        ref("k", g, want)
    np.testing.assert_array_equal(np.asarray(w), want)
    assert batch.updates == 2


def test_a_planning_error_leaves_the_weight_as_it_was():
    """What the per-chunk path refuses before anything changes is refused here too:
    nothing is queued, the weight's count does not move."""
    dev = HostDevice()
    batch = MultiTensorBatch(dev)
    updater = opt.Updater(opt.create("ftrl", learning_rate=0.1, lr_mult={"k": 0.0}))   # Ftrl divides by lr
    w = _on_device(dev, np.ones(3, np.float32))
    with batch.collect():
        with pytest.raises(ValueError, match="rate"):
            updater(("k", 0), _on_device(dev, np.ones(3, np.float32)), w)
    assert batch.updates == 0 and updater.get_states() == {}
    np.testing.assert_array_equal(w, 1.0)


def test_a_group_that_fails_to_launch_is_updated_by_its_optimizer_and_batching_stops(caplog):
    """A kernel that does not build (say) must not leave planned updates unapplied: the
    group's updates run by the optimizer's own code, the error is logged naming the
    kernel, and later updates go per chunk (where a failure fails its round)."""
    def broken(group):
        raise RuntimeError("nvrtc: the kernel did not compile")
    dev = HostDevice(kernels=broken)
    batch = MultiTensorBatch(dev)
    updater = opt.Updater(opt.SGD(learning_rate=0.5, momentum=0.9))
    w = _on_device(dev, np.ones(4, np.float32))
    with batch.collect():
        updater("k", _on_device(dev, np.ones(4, np.float32)), w)
    np.testing.assert_array_equal(w, 0.5)                   # applied, by the numpy code
    assert batch.failed == "RuntimeError: nvrtc: the kernel did not compile" and batch.launches == 0
    assert "kernel sgd_mom, float32" in caplog.text and "did not compile" in caplog.text
    with batch.collect():
        updater("k", _on_device(dev, np.ones(4, np.float32)), w)      # per chunk now: at once
        np.testing.assert_allclose(w, 0.5 + (0.9 * -0.5 - 0.5), rtol=1e-6)     # mom -0.95
        assert batch.updates == 0
