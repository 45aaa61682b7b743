"""GPU servers (KVSTORE_SERVER_DEVICE=gpu): values, sums and optimizer state on
the GPU, the same results as CPU servers, checkpoints that move between the two,
and a loud failure where no GPU is usable.

Tests marked ``gpu`` need CuPy and a working NVIDIA GPU and skip elsewhere with
the probe's reason; the rest run on any machine."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from kvstore.devices import gpu
from kvstore import optimizer as opt
from kvstore.errors import NodeFailedError
from kvstore.server.backend import GpuBackend, HostBackend, ServerDeviceError, for_config
from kvstore.config import Config
from state_driver import A, B, Server, expect_ok, only, peer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the kill-and-resume scenario of tests/faults/test_recovery.py, also when this
# module runs without it (the coverage step of .ci/run)
sys.path.insert(0, os.path.join(ROOT, "tests", "faults"))
from test_recovery import check_kill_and_resume  # noqa: E402
SHAPES = {"w": (3000,), "b": (7,), "big": (300_000,)}   # big spans servers at 256 KiB chunks
CHUNK_BYTES = 256 << 10
OPTIMIZERS = {
    "assign": None,
    "sgd_momentum": opt.SGD(learning_rate=0.05, momentum=0.9, wd=1e-4),
    "adam": opt.Adam(learning_rate=0.01, wd=1e-4, clip_gradient=2.0),
}


def python_path() -> str:
    """This checkout first, then whatever the caller had (e.g. carried wheels)."""
    return os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)


def needs_gpu():
    if not gpu.available():
        pytest.skip(f"needs a usable GPU with CuPy: {gpu.reason()}")
    import cupy
    return cupy


def grad(rank, step, shape):
    """Distinct per worker and step; small integers over 4, exact in float32 sums."""
    n = int(np.prod(shape))
    return ((np.arange(n) % 13 - 6 + rank * 3 + step) / 4.0).astype(np.float32).reshape(shape)


def training(optimizer, steps=4):
    def job(kv):
        keys = list(SHAPES)
        kv.init(keys, [np.linspace(-1, 1, int(np.prod(s)), dtype=np.float32).reshape(s)
                       for s in SHAPES.values()])
        if optimizer is not None:
            kv.set_optimizer(optimizer)
        seen = []
        for step in range(steps):
            kv.push(keys, [grad(kv.rank, step, s) for s in SHAPES.values()])
            outs = [np.empty(s, np.float32) for s in SHAPES.values()]
            kv.pull(keys, out=outs)
            seen.append(outs)
        return seen
    return job


def stored_modules(cluster) -> set:
    return {type(c.value).__module__.split(".")[0]
            for node in cluster.nodes for c in node.state.chunks.values()}


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_gpu_servers_give_what_cpu_servers_give_in_sync_mode(make_cluster, name, transport):
    needs_gpu()
    job = training(OPTIMIZERS[name])
    cpu = make_cluster(2, 2, chunk_bytes=CHUNK_BYTES).run(job)
    # over shared memory, workers would write large pushes into CPU servers' sums: a GPU
    # server's hello says its sums are not writable, so they push instead
    cluster = make_cluster(2, 2, chunk_bytes=CHUNK_BYTES, server_device="gpu", transport=transport,
                           write_in_bytes=4096)
    on_gpu = cluster.run(job)
    assert stored_modules(cluster) == {"cupy"}            # the GPU path was taken
    for rank in range(2):
        for want_step, got_step in zip(cpu[rank], on_gpu[rank]):
            for want, got in zip(want_step, got_step):
                if name == "assign":                      # sums of exact values: bit for bit
                    np.testing.assert_array_equal(got, want)
                else:
                    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_gpu_servers_in_async_mode_apply_every_push(make_cluster):
    needs_gpu()
    cluster = make_cluster(3, 2, chunk_bytes=CHUNK_BYTES, server_device="gpu")

    def job(kv):
        kv.init("big", np.zeros(SHAPES["big"], np.float32))
        kv.set_optimizer(opt.SGD(learning_rate=1.0))
        for step in range(5):
            kv.push("big", grad(kv.rank, step, SHAPES["big"]))
        kv.barrier()
        out = np.empty(SHAPES["big"], np.float32)
        kv.pull("big", out=out)
        return out

    expected = -sum(grad(r, s, SHAPES["big"]) for r in range(3) for s in range(5))
    for out in cluster.run(job, "dist_async"):
        np.testing.assert_array_equal(out, expected)     # any order: exact sums of quarters
    assert stored_modules(cluster) == {"cupy"}


@pytest.mark.gpu
def test_gpu_servers_with_2bit_compression_match_cpu_servers(make_cluster):
    needs_gpu()

    def job(kv):
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
        return training(opt.SGD(learning_rate=0.1, momentum=0.9))(kv)

    cpu = make_cluster(2, 1, chunk_bytes=CHUNK_BYTES).run(job)
    on_gpu = make_cluster(2, 1, chunk_bytes=CHUNK_BYTES, server_device="gpu").run(job)
    for want, got in zip(cpu[0][-1], on_gpu[0][-1]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_dist_device_sync_with_cuda_tensors_on_gpu_servers(make_cluster):
    needs_gpu()
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip(f"needs torch with CUDA; this torch is {torch.__version__}")
    cluster = make_cluster(2, 2, chunk_bytes=CHUNK_BYTES, server_device="gpu")

    def job(kv):
        shape = SHAPES["big"]
        kv.init("big", torch.zeros(shape, device="cuda"))
        kv.set_optimizer(opt.Adam(learning_rate=0.01))
        out = torch.empty(shape, device="cuda")
        for step in range(3):
            g = torch.from_numpy(grad(kv.rank, step, shape)).cuda()
            kv.pushpull("big", [g, g], out=out)              # two "devices": summed first
        return out.cpu().numpy()

    reference = make_cluster(2, 2, chunk_bytes=CHUNK_BYTES).run(
        lambda kv: _numpy_twin(kv, SHAPES["big"]))
    for got, want in zip(cluster.run(job, "dist_device_sync"), reference):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _numpy_twin(kv, shape):
    kv.init("big", np.zeros(shape, np.float32))
    kv.set_optimizer(opt.Adam(learning_rate=0.01))
    out = np.empty(shape, np.float32)
    for step in range(3):
        g = grad(kv.rank, step, shape)
        kv.pushpull("big", [g, g], out=out)
    return out


@pytest.mark.gpu
def test_cuda_ipc_between_worker_and_server_processes_on_one_gpu():
    """The cuda_ipc transport on hardware (issue 29 item 3): tracker.local starts 2
    workers and 2 GPU servers as processes on one GPU; the workers' cupy sums go to
    the servers by CUDA IPC handles and come back device to device, with the values
    the formulas give; kv.empty(..., device=0) memory and the flat-bucket Trainer's
    gradients are read in place (tests/scripts/cuda_ipc_job.py)."""
    needs_gpu()
    env = {**os.environ, "PYTHONPATH": python_path(), "KVSTORE_TIMEOUT": "120"}
    p = subprocess.run([sys.executable, "-m", "tracker.local", "-n", "2", "-s", "2", "--server-device", "gpu",
                        sys.executable, os.path.join(ROOT, "tests", "scripts", "cuda_ipc_job.py")],
                       env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    for rank in range(2):
        assert f"[worker:{rank}] transports=cuda_ipc ok" in out, out[-4000:]
    weights = {line.split("weights=")[1] for line in out.splitlines() if "weights=" in line}
    assert len(weights) == 1, out[-4000:]        # the flat-bucket Trainer in step on both workers


# -- the state machine on a GPU backend: checkpoints move between CPU and GPU ----------
def _trained_state(backend, steps=3):
    s = Server(num_workers=2, opt=opt.Adam(learning_rate=0.01, wd=1e-3), backend=backend,
               init={A: np.linspace(0, 1, 5000, dtype=np.float32), B: np.ones(7, np.float32)})
    for step in range(steps):
        for w in range(2):
            s.push(w, {A: grad(w, step, (5000,)), B: grad(w, step, (7,))})
    return s


def _step(s, step):
    for w in range(2):
        _, r = s.push(w, {A: grad(w, step, (5000,)), B: grad(w, step, (7,))})
    return s.value(A), s.value(B)


@pytest.mark.gpu
def test_a_gpu_checkpoint_restores_on_the_gpu_and_on_the_cpu():
    needs_gpu()
    original = _trained_state(GpuBackend(0))
    snap = original.state.snapshot({"step": 3})
    want = _step(original, 3)
    for backend in (GpuBackend(0), HostBackend()):
        restored = Server(num_workers=2, backend=backend)
        restored.state.restore(snap)
        restored.init({A: np.zeros(5000, np.float32), B: np.zeros(7, np.float32)})   # kept
        restored.set_optimizer(opt.Adam(learning_rate=0.01, wd=1e-3))              # state kept
        for got, expected in zip(_step(restored, 3), want):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
    cpu = _trained_state(HostBackend())   # and a CPU checkpoint restores on the GPU
    onto_gpu = Server(num_workers=2, backend=GpuBackend(0))
    onto_gpu.state.restore(cpu.state.snapshot({}))
    onto_gpu.init({A: np.zeros(5000, np.float32), B: np.zeros(7, np.float32)})
    onto_gpu.set_optimizer(opt.Adam(learning_rate=0.01, wd=1e-3))
    for got, expected in zip(_step(onto_gpu, 3), _step(cpu, 3)):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
def test_gpu_optimizer_states_are_host_copies_and_a_sync_reply_stays_on_the_device():
    cupy = needs_gpu()
    s = _trained_state(GpuBackend(0), steps=1)
    assert isinstance(s.state.chunks[A].value, cupy.ndarray)
    rid, r = s.send(0, "get_states")
    reply = expect_ok(only(r), peer(0), rid)
    assert reply.arrays and all(isinstance(a, np.ndarray) for a in reply.arrays)
    assert all(gpu.is_pinned(a) for a in reply.arrays if a.size)
    # a pull answered at once is a sync reply: it holds the device value until the data
    # plane sends it (by reference over cuda_ipc, else downloaded into pinned memory)
    rid, r = s.pull(0, [A])
    value = expect_ok(only(r), peer(0), rid).arrays[0]
    assert isinstance(value, cupy.ndarray) and s.state.backend.on_device([value])
    host = s.state.backend.download([value])[0]
    assert isinstance(host, np.ndarray) and gpu.is_pinned(host)
    np.testing.assert_array_equal(host, value.get())


# -- the same code path on the device layer's host device (runs in CI) -------------------
def _host_device_backend():
    from kvstore.devices import HostDevice
    from kvstore.server.backend import DeviceBackend
    return DeviceBackend(HostDevice())


def test_the_gpu_code_path_replies_with_host_copies_and_keeps_device_memory_apart():
    backend = _host_device_backend()
    s = _trained_state(backend, steps=1)
    assert backend.dev.is_device_array(s.state.chunks[A].value)
    for op in ("get_states", "pull"):
        rid, r = s.send(0, op, **({"chunks": [A]} if op == "pull" else {}))
        arrays = expect_ok(only(r), peer(0), rid).arrays
        if op == "pull":
            # a sync reply's values stay on the device until the data plane sends them:
            # by reference (cuda_ipc) or downloaded, as here, for any other peer
            assert all(backend.dev.is_device_array(a) for a in arrays) and backend.on_device(arrays)
            arrays = backend.download(arrays)
        assert arrays and not any(backend.dev.is_device_array(a) for a in arrays)
        assert not any(np.shares_memory(a, c.value) for a in arrays for c in s.state.chunks.values())
    g = grad(0, 9, (5000,))
    assert not np.shares_memory(backend.upload(g), g)     # an upload copies into device memory


def test_a_reply_is_one_download_into_one_shared_block_per_list_of_values():
    """DeviceBackend.download packs a reply's device values into one buffer and copies
    it to the host once (190 per-value copies ran at 7 GB/s on an H100): the values
    land in one block of the node's shared memory, reused by the next download of the
    same list; copies (copy=True) are fresh; host values in the list are copied."""
    from kvstore.devices import HostDevice
    from kvstore.server.backend import DeviceBackend
    from kvstore.transport.shm import Arena
    arena = Arena("test-reply")
    try:
        dev = HostDevice()
        downloads = []
        download = dev.download
        dev.download = lambda src, dst: (downloads.append(src.nbytes), download(src, dst))
        backend = DeviceBackend(dev, host=arena)
        values = [np.arange(10, dtype=np.float32), np.arange(3, dtype=np.int64) - 7, np.zeros(0, np.float16),
                  np.linspace(0, 1, 33, dtype=np.float64).reshape(3, 11)]
        on_device = [backend.upload(v) for v in values]
        host_value = np.ones(4, np.float32)
        got = backend.download([*on_device, host_value])
        for a, b in zip(got, [*values, host_value]):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)
            assert not dev.is_device_array(a)
        assert not np.shares_memory(got[-1], host_value)
        assert len(downloads) == 1                                     # one copy off the device
        shared = [arena.locate(a) for a in got[:4] if a.size]
        assert all(shared) and len({desc for desc, _ in shared}) == 1   # in one shared segment
        on_device[0] += 1
        again = backend.download(on_device)
        assert all(np.shares_memory(a, b) for a, b in zip(again, got) if a.size)   # the list's block
        np.testing.assert_array_equal(again[0], values[0] + 1)
        fresh = backend.download(on_device, copy=True)
        assert not any(np.shares_memory(a, b) for a, b in zip(fresh, again) if a.size)
        assert not any(arena.locate(a) for a in fresh if a.size)
        assert len(downloads) == 3
        single = backend.download([on_device[3]])[0]                   # one value: no packing
        assert single.shape == (3, 11) and not np.shares_memory(single, again[3])
        np.testing.assert_array_equal(single, values[3])
    finally:
        arena.close()


def test_the_gpu_code_path_gives_what_the_cpu_gives_and_checkpoints_move_between_them():
    on_device, on_host = _trained_state(_host_device_backend()), _trained_state(HostBackend())
    for got, want in zip(_step(on_device, 3), _step(on_host, 3)):
        np.testing.assert_array_equal(got, want)
    # a checkpoint of the device path restores on either path, optimizer state included
    snap = on_device.state.snapshot({"step": 4})
    want = _step(on_host, 4)
    for backend in (_host_device_backend(), HostBackend()):
        restored = Server(num_workers=2, backend=backend)
        restored.state.restore(snap)
        restored.init({A: np.zeros(5000, np.float32), B: np.zeros(7, np.float32)})   # kept
        restored.set_optimizer(opt.Adam(learning_rate=0.01, wd=1e-3))              # state kept
        for got, expected in zip(_step(restored, 4), want):
            np.testing.assert_array_equal(got, expected)


# -- no GPU where one was asked for: a loud, named failure (runs on any machine) --------
def test_a_gpu_server_without_a_usable_gpu_ends_the_job_naming_the_reason(make_cluster, monkeypatch):
    monkeypatch.setattr(gpu, "_probe_result", gpu.Probe(False, "forced by the test"))
    cluster = make_cluster(1, 1, server_device="gpu")
    with pytest.raises(NodeFailedError, match="server 0 cannot start: KVSTORE_SERVER_DEVICE=gpu, "
                                              "but no GPU is usable: forced by the test"):
        cluster.run(lambda kv: kv.init("w", np.zeros(3, np.float32)))


def test_server_gpus_pick_the_device_by_rank_and_a_missing_one_is_named(monkeypatch):
    assert isinstance(for_config(Config(), 0), HostBackend)
    monkeypatch.setattr(gpu, "_probe_result", gpu.Probe(True, "pretend", devices=2))
    with pytest.raises(ServerDeviceError, match="GPU 5 does not exist .this host has 2"):
        for_config(Config(server_device="gpu", server_gpus=(1, 5)), 1)


@pytest.mark.slow
def test_launcher_with_server_device_gpu_and_no_gpu_fails_fast_naming_the_server(tmp_path):
    env = {**os.environ, "PYTHONPATH": python_path(), "CUDA_VISIBLE_DEVICES": "",
           "KVSTORE_HEARTBEAT_INTERVAL": "0.2", "KVSTORE_TIMEOUT": "60"}
    code = "import kvstore, numpy; kv = kvstore.create('dist_sync'); kv.init(0, numpy.zeros(3))"
    p = subprocess.run([sys.executable, "-m", "tracker.local", "-n", "1", "-s", "1",
                        "--server-device", "gpu", sys.executable, "-c", code],
                       env=env, capture_output=True, text=True, timeout=90, cwd=ROOT)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert re.search(r"server 0 cannot start: KVSTORE_SERVER_DEVICE=gpu, but no GPU is usable: \S", out), out


# -- a GPU server killed mid-run, then the job resumed on GPU servers --------------------
@pytest.mark.gpu
@pytest.mark.slow
def test_a_gpu_server_killed_mid_run_ends_the_job_and_resumes_on_the_gpu(tmp_path):
    needs_gpu()
    text = check_kill_and_resume(tmp_path, "--server-device", "gpu", timeout=180)
    assert "values in GPU 0" in text


def test_a_sync_rounds_replies_download_its_values_once(make_cluster, monkeypatch):
    """Issue 29 item 5: a GPU server answering W workers that read host memory (tcp
    here) downloads a round's values once, not once per reply: the replies of one
    event share the download (the data plane's batch). On the host device."""
    from kvstore.devices import HostDevice
    from kvstore.server import backend as server_backend
    downloads: list = []

    class CountingDevice(HostDevice):
        def download(self, src, dst):
            downloads.append(src.nbytes)
            return super().download(src, dst)
    monkeypatch.setattr(server_backend, "for_config", lambda config, rank, alloc=None, shared=None, host=None:
                        server_backend.DeviceBackend(CountingDevice(), host))
    cluster = make_cluster(3, 1, transport="tcp", server_device="gpu")
    steps = 4

    def job(kv):
        kv.init("w", np.zeros(5000, np.float32))
        kv.barrier()
        outs = []
        for step in range(steps):
            out = np.empty(5000, np.float32)
            kv.pushpull("w", grad(kv.rank, step, (5000,)), out=out)
            outs.append(out)
        return outs
    before = len(downloads)
    for outs in cluster.run(job):
        for step, out in enumerate(outs):
            np.testing.assert_array_equal(out, sum(grad(r, step, (5000,)) for r in range(3)))
    # every round's 3 replies went out together, after its last push: one download each
    assert len(downloads) - before == steps, downloads
