"""A GPU server's updates, one launch per event (issue 45 item 2): the chunks a push
completes are updated by one multi-tensor kernel (kvstore/optimizer/multi_tensor.py,
owned by the GPU server's DeviceBackend), not one fused kernel each.

CI runs the GPU server's code path on the device layer's host device: with the
multi-tensor kernel's source built for the host (tests/optimizer/host_kernels.py),
and with the host device's own loop (each update's numpy code, at the same
moments), which must give the host server's bits. The test marked ``gpu`` runs the
CUDA build against the per-chunk fused kernels on the next GPU loan
(``python -m pytest -m gpu tests/server/test_multi_tensor_server.py``)."""

import os
import sys

import numpy as np
import pytest

from kvstore import optimizer as opt
from kvstore.devices import HostDevice, gpu
from kvstore.optimizer import multi_tensor
from kvstore.protocol import ops
from kvstore.server.backend import DeviceBackend, HostBackend
from state_driver import Server, expect_ok, peer

SIZES = {("a", 0): 1, ("b", 0): 7, ("c", 0): 1000, ("d", 0): 4099, ("e", 0): 300}
MULTS = {"lr_mult": {"b": 0.5, "d": 2.0}, "wd_mult": {"c": 3.0, "e": 0.0}}
OPTIMIZERS = {
    "sgd_momentum": lambda: opt.SGD(learning_rate=0.05, momentum=0.9, wd=1e-3, **MULTS),
    "adam": lambda: opt.Adam(learning_rate=0.01, wd=1e-3, clip_gradient=2.0, rescale_grad=0.5, **MULTS),
    "ftrl": lambda: opt.create("ftrl", learning_rate=0.1, lamda1=0.01, wd=1e-3, **MULTS),
    "nadam": lambda: opt.create("nadam", learning_rate=0.01, wd=1e-3, **MULTS),
}
ROUNDS = 3
GPU_CASES = {name: (name, np.float32) for name in OPTIMIZERS}
GPU_CASES.update({"adam_float64": ("adam", np.float64),
                  "sgd_momentum_multi_precision": ("sgd_momentum_mp", np.float16)})
OPTIMIZERS_GPU = dict(OPTIMIZERS, sgd_momentum_mp=lambda: opt.SGD(learning_rate=0.05, momentum=0.9, wd=1e-3,
                                                                  multi_precision=True, **MULTS))


def grad(rank, step, n):
    return ((np.arange(n) % 13 - 6 + rank * 3 + step) / 4.0).astype(np.float32)


def train(backend, optimizer, mode="sync", dtype=np.float32):
    """W=2 workers, ROUNDS rounds: worker 0 pushes every chunk in one request, worker 1
    pushpulls them in one (in sync mode its push completes the round). Returns the
    values worker 1's replies carried, per round, and the final values."""
    s = Server(mode=mode, num_workers=2, backend=backend,
               init={cid: np.linspace(-1, 1, n).astype(dtype) for cid, n in SIZES.items()})
    s.set_optimizer(optimizer)
    seen = []
    for step in range(ROUNDS):
        for rank, op in ((0, ops.PUSH), (1, ops.PUSHPULL)):
            rid, replies = s.push(rank, {cid: grad(rank, step, n).astype(dtype) for cid, n in SIZES.items()}, op=op)
        mine = [r for r in replies if r.peer == peer(1)]
        assert len(mine) == 1
        expect_ok(mine[0], peer(1), rid)
        seen.append([np.array(backend.to_numpy(a)) for a in mine[0].arrays])
    final = [np.array(backend.to_numpy(s.state.chunks[cid].value)) for cid in SIZES]
    return seen, final


@pytest.fixture
def hk():
    """The kernels built for the host (tests/optimizer/host_kernels.py)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "optimizer"))
    import host_kernels
    if host_kernels.compiler() is None:
        pytest.skip("needs a C++ compiler (g++) to build the kernels for the host")
    return host_kernels


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_event_updates_its_chunks_in_one_launch_of_the_kernel_built_for_the_host(hk, name, mode):
    backend = DeviceBackend(HostDevice(kernels=hk.run_group))
    seen, final = train(backend, OPTIMIZERS[name](), mode)
    # sync: one launch per round (worker 1's push completes all 5 chunks); async: per push
    assert backend.updates.launches == (ROUNDS if mode == "sync" else 2 * ROUNDS)
    assert backend.updates.updates == len(SIZES) * (ROUNDS if mode == "sync" else 2 * ROUNDS)
    want_seen, want = train(HostBackend(), OPTIMIZERS[name](), mode)
    for got, ref in zip(final, want):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    for got_round, ref_round in zip(seen, want_seen):      # every reply saw its round applied
        for got, ref in zip(got_round, ref_round):
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_host_devices_own_loop_gives_the_host_servers_bits(mode):
    """The batching without a kernel: each update's numpy code when the batch runs."""
    backend = DeviceBackend(HostDevice())
    seen, final = train(backend, OPTIMIZERS["adam"](), mode)
    assert backend.updates.launches == (ROUNDS if mode == "sync" else 2 * ROUNDS)
    want_seen, want = train(HostBackend(), OPTIMIZERS["adam"](), mode)
    for got, ref in zip(final + sum(seen, []), want + sum(want_seen, [])):
        np.testing.assert_array_equal(got, ref)


def test_float16_chunks_stay_per_chunk_and_float64_ones_are_batched():
    for dtype, batched in ((np.float16, False), (np.float64, True)):
        backend = DeviceBackend(HostDevice())
        _, final = train(backend, OPTIMIZERS["sgd_momentum"](), "sync", dtype)
        assert backend.updates.launches == (ROUNDS if batched else 0), dtype
        _, want = train(HostBackend(), OPTIMIZERS["sgd_momentum"](), "sync", dtype)
        for got, ref in zip(final, want):
            np.testing.assert_array_equal(got, ref)


def test_float16_weights_with_float32_master_copies_are_batched_and_rounded_after(hk):
    """multi_precision: the master copy's update is taken, and run before the float16
    weight is rounded from it (one launch per chunk, then), as the CPU server's."""
    backend = DeviceBackend(HostDevice(kernels=hk.run_group))
    _, final = train(backend, OPTIMIZERS_GPU["sgd_momentum_mp"](), dtype=np.float16)
    assert (backend.updates.launches, backend.updates.updates) == (ROUNDS * len(SIZES), ROUNDS * len(SIZES))
    _, want = train(HostBackend(), OPTIMIZERS_GPU["sgd_momentum_mp"](), dtype=np.float16)
    for got, ref in zip(final, want):
        np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-3)


# ==== GPU: runs on the next GPU loan =========================================================

@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_a_gpu_servers_one_launch_per_event_gives_the_per_chunk_kernels_bits(case, monkeypatch):
    """The CUDA build of the multi-tensor kernel in a GPU server (GpuBackend), against
    the same server with one fused kernel per chunk (multi_tensor.ENABLED off): the
    same bits in every reply and value; and the CPU server's values (rtol 1e-5; float16
    weights with float32 master copies: 2e-3)."""
    if not gpu.available():
        pytest.skip(f"needs a usable GPU with CuPy: {gpu.reason()}")
    from kvstore.server.backend import GpuBackend
    name, dtype = GPU_CASES[case]
    backend = GpuBackend(0)
    seen, final = train(backend, OPTIMIZERS_GPU[name](), dtype=dtype)
    assert (backend.updates.launches, backend.updates.updates) == (ROUNDS * len(SIZES) if dtype == np.float16
                                                                   else ROUNDS, ROUNDS * len(SIZES))
    assert backend.updates.failed is None
    monkeypatch.setattr(multi_tensor, "ENABLED", False)
    per_chunk = GpuBackend(0)
    want_seen, want = train(per_chunk, OPTIMIZERS_GPU[name](), dtype=dtype)
    assert per_chunk.updates.launches == 0
    for got, ref in zip(final + sum(seen, []), want + sum(want_seen, [])):
        np.testing.assert_array_equal(got, ref)
    _, on_cpu = train(HostBackend(), OPTIMIZERS_GPU[name](), dtype=dtype)
    tol = 2e-3 if dtype == np.float16 else 1e-5
    for got, ref in zip(final, on_cpu):
        np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)
