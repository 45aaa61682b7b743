"""The GPU stores 'device' and 'dist_device_sync', the GPU probe and GPU arrays.

Everything not marked ``gpu`` runs on any machine: without a usable GPU both
stores fall back to the CPU ('local' / 'dist_sync' semantics) and are checked
against test_local.py's scenarios, the 'local' oracle and formulas. Tests marked
``gpu`` need CuPy and a working NVIDIA GPU (and torch with CUDA where they use
CUDA tensors); elsewhere they skip with the probe's reason. Run them with
``python -m pytest -m gpu tests/api/test_device.py``.
"""

import importlib.util
import inspect
import logging
import pathlib
import subprocess
import sys
import types

import numpy as np
import pytest

import kvstore
from kvstore.devices import arrays, gpu
from kvstore import devices
from kvstore.devices import HostAccelerators
from kvstore import optimizer as opt
from kvstore.errors import ConfigError

try:
    import torch
except ImportError:  # the torch parts skip
    torch = None

SMALL_CHUNKS = 4096
FALLBACK = "no GPU found: the '{}' store aggregates on the CPU"


def f32(*shape, fill=0.0):
    return np.full(shape, fill, np.float32)


def grad(rank, step, shape, device=0):
    """What worker ``rank`` pushes from device ``device`` at ``step``: exact in float32."""
    base = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) % 7
    return (base + (rank + 1) * (step + 1) + 10 * device).astype(np.float32)


def total(workers, devices, step, shape):
    return sum(grad(r, step, shape, d).astype(np.float64)
               for r in range(workers) for d in range(devices)).astype(np.float32)


@pytest.fixture
def force_cpu(monkeypatch):
    """Make this process believe there is no GPU (and forget earlier fallback logs)."""
    monkeypatch.setattr(gpu, "_probe_result", gpu.Probe(False, "forced by the test"))
    monkeypatch.setattr(gpu, "_fallbacks_logged", set())


@pytest.fixture
def emulated(monkeypatch):
    """The GPU stores' code path on two emulated GPUs (kvstore.devices.HostAccelerators:
    numpy arrays tagged as device memory, every copy checked): returns them."""
    acc = HostAccelerators(2)
    monkeypatch.setattr(devices, "worker_accelerators", lambda: acc)
    return acc


@pytest.fixture(params=["auto", "cpu", "emulated"])
def device_kv(request):
    """A 'device' store: on the GPU when one is usable ('auto'), forced onto the CPU,
    and on its GPU code path over emulated GPUs (values kept on emulated device 0)."""
    if request.param != "auto":
        request.getfixturevalue("force_cpu" if request.param == "cpu" else "emulated")
    with kvstore.create("device") as store:
        yield store


# ---- the probe ----------------------------------------------------------------------------------

def test_probe_is_cached_and_explains_itself():
    first = gpu.probe()
    assert gpu.probe() is first
    assert gpu.available() == first.ok
    assert isinstance(gpu.reason(), str) and gpu.reason()
    assert gpu.device_count() == (first.devices if first.ok else 0)


def test_importing_kvstore_probes_nothing():
    code = ("import sys, kvstore, kvstore.devices.gpu, kvstore.worker.device, kvstore.devices.arrays\n"
            "assert kvstore.devices.gpu._probe_result is None\n"
            "assert 'cupy' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n")
    root = pathlib.Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=root)


def test_probe_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)      # import cupy raises ImportError
    result = gpu._run_probe()
    assert not result.ok and "cupy cannot be imported" in result.reason
    assert "cupy-cuda12x or cupy-cuda13x" in result.reason


def _fake_cupy(device_count):
    fake = types.ModuleType("cupy")
    fake.__version__ = "0.test"
    runtime = types.SimpleNamespace(getDeviceCount=device_count)
    fake.cuda = types.SimpleNamespace(runtime=runtime)
    return fake


def test_probe_with_a_cupy_that_cannot_reach_a_gpu(monkeypatch):
    def broken():
        raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient")
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(broken))
    result = gpu._run_probe()
    assert not result.ok
    assert "cupy 0.test is installed but the GPU is not usable" in result.reason
    assert "cudaErrorInsufficientDriver" in result.reason


def test_probe_with_no_visible_device(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(lambda: 0))
    result = gpu._run_probe()
    assert not result.ok and "no CUDA device" in result.reason


def test_without_gpu_helpers_fall_back_to_numpy(force_cpu):
    host = gpu.pinned_empty(5, np.float32)
    assert type(host) is np.ndarray and host.shape == (5,) and host.dtype == np.float32
    assert not gpu.is_pinned(host)
    assert gpu.xp_for(np.zeros(2)) is np
    with pytest.raises(RuntimeError, match="no usable GPU: forced by the test"):
        gpu.cupy_module()
    if torch is not None:
        assert gpu.xp_for(torch.zeros(2)) is np


def test_cpu_fallback_logs_one_line_per_process(force_cpu, caplog):
    caplog.set_level(logging.INFO, logger="kvstore.devices.gpu")
    for _ in range(3):
        with kvstore.create("device") as kv:
            assert kv.type == "device" and kv.device_id is None
    lines = [r.getMessage() for r in caplog.records if "no GPU found" in r.getMessage()]
    assert lines == [FALLBACK.format("device") + " (forced by the test)"]
    assert all(r.levelno == logging.INFO for r in caplog.records if "no GPU found" in r.getMessage())


def test_unknown_store_type_lists_the_gpu_stores():
    with pytest.raises(ConfigError, match="device, dist_device_sync"):
        kvstore.create("devices")
    assert {"device", "dist_device_sync"} <= set(kvstore.STORE_TYPES)


# ---- 'device' keeps the semantics of 'local': test_local.py's scenarios -------------------------

LOCAL_SCENARIOS = [
    "test_push_list_sums_and_assigns",
    "test_same_key_twice_in_one_list_sums",
    "test_pull_fills_every_array_of_a_list",
    "test_pushpull_writes_back_into_value_when_out_is_none",
    "test_broadcast",
    "test_sgd_optimizer_applies_to_merged_gradient",
    "test_torch_tensors_in_and_out",
    "test_int_keys_are_64_bit",
    "test_save_and_load_optimizer_states_resume_exactly",
    "test_init_twice_is_an_error_and_keeps_the_value",
    "test_mixing_int_and_str_keys",
    "test_load_states_from_garbage_file",
]


@pytest.mark.parametrize("scenario", LOCAL_SCENARIOS)
def test_local_scenarios_hold_for_device(device_kv, scenario, tmp_path):
    check = getattr(pytest.importorskip("test_local"), scenario)
    given = {"kv": device_kv, "tmp_path": tmp_path}
    check(**{name: given[name] for name in inspect.signature(check).parameters})


@pytest.mark.parametrize("value", ["shape", "dtype"])
def test_bad_values_change_nothing(device_kv, value):
    device_kv.init(1, f32(3, fill=1))
    bad = np.zeros(4, np.float32) if value == "shape" else np.zeros(3, np.float64)
    with pytest.raises(kvstore.InvalidArgumentError, match=value):
        device_kv.push(1, [f32(3), bad])
    out = f32(3)
    device_kv.pull(1, out=out)
    np.testing.assert_array_equal(out, 1)


def local_and_device_rounds(kv, optimizer, compression=None):
    """Feed one store rounds of per-device lists; return every pulled value."""
    rng = np.random.default_rng(7)
    shapes = {"w": (4, 5), "b": (5,), "emb": (300,)}
    kv.init(list(shapes), [rng.standard_normal(s).astype(np.float32) for s in shapes.values()])
    if optimizer is not None:
        kv.set_optimizer(optimizer)
    if compression is not None:
        kv.set_gradient_compression(compression)
    seen = []
    for _ in range(4):
        kv.push(list(shapes), [[rng.standard_normal(s).astype(np.float32) for _ in range(3)]
                               for s in shapes.values()])
        outs = [np.empty(s, np.float32) for s in shapes.values()]
        kv.pull(list(shapes), out=outs)
        seen.append(outs)
    return seen


@pytest.mark.parametrize("optimizer, compression", [
    (None, None),
    (opt.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3), None),
    (opt.Adam(learning_rate=0.01), None),
    (opt.SGD(learning_rate=0.1), {"type": "2bit", "threshold": 0.5}),
], ids=["assign", "sgd-momentum", "adam", "sgd-2bit"])
def test_device_matches_the_local_oracle(device_kv, optimizer, compression):
    with kvstore.create("local") as local:
        want = local_and_device_rounds(local, optimizer, compression)
    got = local_and_device_rounds(device_kv, optimizer, compression)
    for got_round, want_round in zip(got, want):
        for g, w in zip(got_round, want_round):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


# ---- 'dist_device_sync' on an in-process cluster (CPU fallback here) --------------------------------

@pytest.mark.parametrize("workers, servers", [(1, 1), (2, 2), (3, 2)])
def test_dist_device_sync_matches_formulas(make_cluster, workers, servers):
    shapes = [(10,), (3000,), (40, 50)]
    keys = [3, -5, 1 << 40]
    cluster = make_cluster(workers, servers, chunk_bytes=SMALL_CHUNKS)

    def job(kv):
        assert kv.type == "dist_device_sync"
        kv.init(keys, [np.zeros(s, np.float32) for s in shapes])
        seen = []
        for step in range(2):        # no optimizer: the sum over workers and devices is assigned
            kv.push(keys, [[grad(kv.rank, step, s, d) for d in range(2)] for s in shapes])
            outs = [[np.empty(s, np.float32), np.empty(s, np.float32)] for s in shapes]
            kv.pull(keys, out=outs)
            seen.append(outs)
        g = [grad(kv.rank, 5, (10,), d) for d in range(2)]
        kv.pushpull(keys[0], g)      # out=None: written back into every device's value
        kv.init(100, np.ones((40, 50), np.float32))
        kv.set_optimizer(opt.SGD(learning_rate=1.0))
        for step in range(3):
            kv.push(100, [grad(kv.rank, step, (40, 50), d) for d in range(2)])
        w = np.empty((40, 50), np.float32)
        kv.pull(100, out=w)
        b = np.empty(4, np.float32)
        kv.broadcast(555, np.full(4, kv.rank + 10, np.float32), out=b)
        return seen, g, w, b

    for seen, g, w, b in cluster.run(job, "dist_device_sync"):
        for step, outs in enumerate(seen):
            for per_device, s in zip(outs, shapes):
                for out in per_device:
                    np.testing.assert_array_equal(out, total(workers, 2, step, s))
        for value in g:
            np.testing.assert_array_equal(value, total(workers, 2, 5, (10,)))
        expected = 1 - sum(total(workers, 2, step, (40, 50)).astype(np.float64) for step in range(3))
        np.testing.assert_allclose(w, expected.astype(np.float32), rtol=1e-6)
        np.testing.assert_array_equal(b, 10)


def test_dist_device_sync_without_gpu_logs_once(make_cluster, force_cpu, caplog):
    caplog.set_level(logging.INFO, logger="kvstore.devices.gpu")
    cluster = make_cluster(3, 1)
    cluster.run(lambda kv: kv.barrier(), "dist_device_sync")
    lines = [r.getMessage() for r in caplog.records if "no GPU found" in r.getMessage()]
    assert lines == [FALLBACK.format("dist_device_sync") + " (forced by the test)"]


# ---- the PyTorch Trainer on the GPU stores (CPU fallback here) -----------------------------------

def _trainer_helpers():
    """tests/torch_integration/test_torch_trainer.py's helpers (skip without torch)."""
    pytest.importorskip("torch")
    module = sys.modules.get("test_torch_trainer")
    if module is None:
        path = pathlib.Path(__file__).parents[1] / "torch_integration" / "test_torch_trainer.py"
        spec = importlib.util.spec_from_file_location("test_torch_trainer", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["test_torch_trainer"] = module
        spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_trainer_on_the_device_store(device_kv, update_on_kvstore):
    tt = _trainer_helpers()
    want = tt.reference_torch(lambda ps: torch.optim.SGD(ps, **tt.SGD))
    model = tt.make_model()
    trainer = tt.kvtorch.Trainer(model.parameters(), device_kv, torch.optim.SGD(model.parameters(), **tt.SGD),
                                 update_on_kvstore=update_on_kvstore)
    tt.assert_same(tt.train(model, trainer, 0, 1), want)


def test_trainer_on_dist_device_sync(make_cluster):
    tt = _trainer_helpers()
    want = tt.reference_torch(lambda ps: torch.optim.SGD(ps, **tt.SGD))
    for got in tt.run_dist(make_cluster, lambda m: (torch.optim.SGD(m.parameters(), **tt.SGD), {}),
                           store="dist_device_sync"):
        tt.assert_same(got, want)


# ---- bfloat16 torch tensors: kept, summed and sent as float32 ----------------------------------

# summed in float32: 258.25, which rounds to 258 in bfloat16; summed in bfloat16: 256
BF16_TERMS = (256.0, 0.75, 0.75, 0.75)


def needs_torch():
    if torch is None:
        pytest.skip("needs torch")


def bf16_expected(workers=1):
    return torch.full((3,), workers * sum(BF16_TERMS), dtype=torch.float32).to(torch.bfloat16)


def bf16_push_pull(kv, device="cpu", after_init=lambda: None):
    """init, push a list, pull into a contiguous and a strided output, pushpull in place."""
    bf = torch.bfloat16
    kv.init(0, torch.zeros(3, dtype=bf, device=device))
    after_init()
    kv.push(0, [torch.full((3,), v, dtype=bf, device=device) for v in BF16_TERMS])
    out, strided = torch.empty(3, dtype=bf, device=device), torch.zeros(3, 2, dtype=bf, device=device)[:, 0]
    kv.pull(0, out=[out, strided])
    values = [torch.full((3,), v, dtype=bf, device=device) for v in BF16_TERMS]
    kv.pushpull(0, values)                       # written back into every (bfloat16) value
    return [t.cpu() for t in (out, strided, *values)]


def stored_values(kv, key):
    return np.asarray(arrays.to_numpy(kv._store[key], "test"))


@pytest.mark.parametrize("store", ["local", "device"])
def test_bfloat16_tensors_are_summed_in_float32(store, force_cpu):
    needs_torch()
    with kvstore.create(store) as kv:
        got = bf16_push_pull(kv)
        held = stored_values(kv, 0)
    assert held.dtype == np.float32
    np.testing.assert_array_equal(held, sum(BF16_TERMS))          # exact: no bfloat16 rounding
    for t in got:
        assert t.dtype == torch.bfloat16 and torch.equal(t, bf16_expected())


def test_bfloat16_on_the_device_store(device_kv):
    needs_torch()
    for t in bf16_push_pull(device_kv):
        assert torch.equal(t, bf16_expected())


@pytest.mark.parametrize("store", ["dist_sync", "dist_device_sync"])
def test_bfloat16_tensors_on_the_wire(make_cluster, store):
    needs_torch()
    cluster = make_cluster(2, 2, chunk_bytes=SMALL_CHUNKS)
    for got in cluster.run(bf16_push_pull, store):
        for t in got:
            assert torch.equal(t, bf16_expected(workers=2))


def test_bfloat16_keys_check_dtypes_by_name(device_kv):
    needs_torch()
    bf = torch.bfloat16
    device_kv.init([0, 1], [torch.zeros(3, dtype=bf), torch.zeros(3)])
    with pytest.raises(kvstore.InvalidArgumentError, match="key 0 has dtype bfloat16, got float32"):
        device_kv.push(0, [torch.zeros(3, dtype=bf), torch.zeros(3)])
    with pytest.raises(kvstore.InvalidArgumentError, match="key 1 has dtype float32, got bfloat16"):
        device_kv.push(1, torch.zeros(3, dtype=bf))
    with pytest.raises(kvstore.InvalidArgumentError, match="key 0 has dtype bfloat16, got float32"):
        device_kv.pull(0, out=f32(3))
    device_kv.set_optimizer(opt.SGD(learning_rate=0.5))     # bfloat16 keys are floating point
    device_kv.push(0, torch.full((3,), 2.0, dtype=bf))
    out = torch.empty(3, dtype=bf)
    device_kv.pull(0, out=out)
    assert torch.equal(out, torch.full((3,), -1.0, dtype=bf))


# ---- the GPU stores' code path on emulated GPUs (kvstore.devices.HostAccelerators) --------------

def test_device_store_keeps_a_key_on_its_initial_values_gpu(emulated):
    """A key lives on the device of its initial value, else on the default device;
    pushes from either device are summed there (a peer copy for the other one) and
    pulls reach outputs on both devices and on the host."""
    kv = kvstore.create("device")
    on_1 = emulated.to_device(f32(2, fill=3), 1)
    kv.init(["on 1", "host"], [on_1, f32(2, fill=1)])
    assert kv.device_id == 0 and kv._init_devices == {}
    assert [emulated.index_of(kv._store[k]) for k in ("on 1", "host")] == [1, 0]
    with pytest.raises(kvstore.InvalidArgumentError, match="already initialised"):
        kv.init("host", emulated.to_device(f32(2), 1))
    assert emulated.index_of(kv._store["host"]) == 0
    kv.push("on 1", [emulated.to_device(f32(2, fill=2), 0), emulated.to_device(f32(2, fill=5), 1), f32(2, fill=1)])
    outs = [emulated.empty(0, 2, np.float32), emulated.empty(1, 2, np.float32), f32(2)]
    kv.pull("on 1", out=outs)
    for out in outs:
        np.testing.assert_array_equal(out, 8)
    assert [emulated.index_of(o) for o in outs[:2]] == [0, 1]        # still on their devices
    assert not emulated.holds(outs[2])
    np.testing.assert_array_equal(on_1, 3)                           # the caller's value intact


def test_device_store_saves_and_loads_row_sparse_states_on_its_gpu_path(emulated, tmp_path):
    """A row-sparse table stays in host memory in the device store; its GPU path saved
    the table's optimizer state flat (its own load refused it) and asked the numpy
    table for a CUDA device (issue 29, defect 4). Dense keys' states come from the
    device. Saved as the local store saves them; loaded back, both resume alike."""
    def trained(kind: str):
        kv = kvstore.create(kind)
        kv.init("emb", kvstore.RowSparse.zeros((6, 2)))
        kv.init("w", f32(3, fill=1))
        kv.set_optimizer(kvstore.optimizer.Adam(learning_rate=0.1))
        kv.push("emb", kvstore.RowSparse(np.ones((2, 2), np.float32), np.array([1, 4]), (6, 2)))
        kv.push("w", f32(3, fill=2))
        return kv
    kv, local = trained("device"), trained("local")
    assert emulated.holds(kv._store["w"]) and not emulated.holds(kv._store["emb"])
    path = str(tmp_path / "states")
    kv.save_optimizer_states(path)
    local.save_optimizer_states(str(tmp_path / "local"))
    assert open(path, "rb").read() == open(str(tmp_path / "local"), "rb").read()
    kv.load_optimizer_states(path)
    for store in (kv, local):
        store.push("emb", kvstore.RowSparse(np.ones((1, 2), np.float32), np.array([4]), (6, 2)))
        store.push("w", f32(3, fill=1))
    a, b = np.empty((6, 2), np.float32), np.empty((6, 2), np.float32)
    kv.row_sparse_pull("emb", out=a, row_ids=np.arange(6))
    local.row_sparse_pull("emb", out=b, row_ids=np.arange(6))
    np.testing.assert_array_equal(a, b)
    w, v = f32(3), f32(3)
    kv.pull("w", out=w)
    local.pull("w", out=v)
    np.testing.assert_allclose(w, v, rtol=1e-6)


class SpiedRequests:
    """Wraps every worker's Client.request and HostLink.send (a host group's socket):
    what goes out and where replies land must be host memory, never an emulated
    device's."""

    def __init__(self, monkeypatch, acc):
        from kvstore.hostgroup.link import HostLink
        from kvstore.worker.client import Client
        original, self.calls = Client.request, 0

        def request(client, server, op, what, arrays=(), *args, **kwargs):
            self.calls += 1
            for a in list(arrays or ()) + list(kwargs.get("into") or ()):
                assert not acc.holds(a), f"{what}: device memory handed to the client"
            return original(client, server, op, what, arrays, *args, **kwargs)
        monkeypatch.setattr(Client, "request", request)
        send, self.host_sends = HostLink.send, 0

        def host_send(link, ident, header, arrays=(), *args, **kwargs):
            self.host_sends += 1
            assert not any(acc.holds(a) for a in arrays), f"{header.get('op')}: device memory to the host group"
            return send(link, ident, header, arrays, *args, **kwargs)
        monkeypatch.setattr(HostLink, "send", host_send)


@pytest.mark.parametrize("workers, servers", [(1, 1), (2, 2)])
def test_dist_device_sync_on_emulated_gpus(make_cluster, emulated, monkeypatch, workers, servers):
    """dist_device_sync's GPU path (issue 29 item 2), in CI: per-device lists on two
    emulated GPUs summed on the first's, a call's sums downloaded in one copy, the
    replies uploaded in one copy and spread to outputs on both devices and the host;
    pushpull, its async form (the Trainer's overlap path; issue 29 defect 1) and an
    optimizer on the servers. The client sees host memory only."""
    shapes = [(10,), (3000,), (40, 50)]
    keys = [3, -5, 1 << 40]
    spied = SpiedRequests(monkeypatch, emulated)
    cluster = make_cluster(workers, servers, chunk_bytes=SMALL_CHUNKS)

    def on(x, d):
        return emulated.to_device(x, d)

    def job(kv):
        kv.init(keys, [on(np.zeros(s, np.float32), 0) for s in shapes])
        seen = []
        for step in range(2):
            kv.push(keys, [[on(grad(kv.rank, step, s, d), d) for d in range(2)] for s in shapes])
            outs = [[emulated.empty(0, int(np.prod(s)), np.float32).reshape(s),
                     emulated.empty(1, int(np.prod(s)), np.float32).reshape(s), np.empty(s, np.float32)]
                    for s in shapes]
            kv.pull(keys, out=outs)
            seen.append(outs)
        g = [on(grad(kv.rank, 5, (10,), d), d) for d in range(2)]
        kv.pushpull(keys[0], g)      # out=None: written back into every device's value
        out = emulated.empty(1, 3000, np.float32)
        downloads = emulated.downloads
        kv.pushpull_async(keys[1], [on(grad(kv.rank, 6, (3000,), d), d) for d in range(2)], out=out).wait()
        one_call = emulated.downloads - downloads
        kv.init(100, np.ones((40, 50), np.float32))
        kv.set_optimizer(opt.SGD(learning_rate=1.0))
        for step in range(3):
            kv.pushpull(100, [on(grad(kv.rank, step, (40, 50), d), d) for d in range(2)])
        w = on(np.empty((40, 50), np.float32), 1)
        kv.pull(100, out=w)
        return seen, g, out, one_call, w

    for seen, g, out, one_call, w in cluster.run(job, "dist_device_sync"):
        for step, outs in enumerate(seen):
            for per_device, s in zip(outs, shapes):
                assert [emulated.holds(o) for o in per_device] == [True, True, False]
                for o in per_device:
                    np.testing.assert_array_equal(o, total(workers, 2, step, s))
        for d, value in enumerate(g):
            assert emulated.index_of(value) == d
            np.testing.assert_array_equal(value, total(workers, 2, 5, (10,)))
        np.testing.assert_array_equal(out, total(workers, 2, 6, (3000,)))
        if workers == 1:                 # (the workers share the emulation's counters)
            assert one_call == 1         # the sum went to the host in one copy
        expected = 1 - sum(total(workers, 2, step, (40, 50)).astype(np.float64) for step in range(3))
        np.testing.assert_allclose(w, expected.astype(np.float32), rtol=1e-6)
        assert emulated.index_of(w) == 1
    assert spied.calls > 0


def test_dist_device_sync_host_group_on_emulated_gpus(make_cluster, emulated, monkeypatch):
    """KVSTORE_HOST_REDUCE with GPU values: each worker's device sums are staged to the
    host before they go to the host's leader, which pushes once for both; the total
    comes back to the device output (the exchange's staging in front of the group)."""
    spied = SpiedRequests(monkeypatch, emulated)
    cluster = make_cluster(2, 1, host_reduce=True)

    def job(kv):
        kv.init("w", np.zeros(6, np.float32))
        out = emulated.empty(1, 6, np.float32)
        for it in range(3):
            kv.pushpull_async("w", [emulated.to_device(np.full(6, kv.rank + 1 + it, np.float32), d)
                                    for d in range(2)], out=out).wait()
        return kv.host_group, np.array(out), emulated.index_of(out), kv.comm_stats()
    results = cluster.run(job, "dist_device_sync")
    for group, out, index, stats in results:
        assert group == (0, 1)
        np.testing.assert_array_equal(out, 2 * 3 + 2 * 4)       # the last step's total
        assert index == 1
    # the member's gradients went to the leader, not to the servers
    assert results[1][3]["host_bytes_sent"] > 0 and results[1][3]["bytes_sent"] < results[0][3]["bytes_sent"]
    assert spied.host_sends > 0


def test_staging_packs_and_spreads_by_device():
    """kvstore.devices.staging on its own: sums on one device go down in one packed
    copy, sums on two devices in one copy each; replies for outputs on a device come
    up in one copy and reach every output, host outputs are answered directly."""
    from kvstore.devices.staging import Staging
    from kvstore.worker.store import KeyInfo
    acc = HostAccelerators(2)
    infos = [KeyInfo(k, (n,), np.dtype(np.float32)) for k, n in (("a", 3), ("b", 5))]
    staging = Staging(acc)
    one = [(infos[0], acc.to_device(f32(3, fill=1), 0)), (infos[1], acc.to_device(f32(5, fill=2), 0))]
    items, keep = staging.to_host(one, None)
    assert acc.downloads == 1 and len(keep) == 2
    assert [acc.holds(flat) for _, flat in items] == [False, False]
    np.testing.assert_array_equal(items[1][1], 2)
    two = [(infos[0], acc.to_device(f32(3, fill=1), 0)), (infos[1], acc.to_device(f32(5, fill=2), 1))]
    staging.to_host(two, None)
    assert acc.downloads == 3
    host_out = f32(3)
    outs = [acc.empty(1, 5, np.float32), acc.empty(0, 5, np.float32)]
    targets, staged = staging.outputs([(infos[0], [host_out]), (infos[1], outs)])
    assert targets[0][1] == [host_out] and not acc.holds(targets[1][1][0])
    targets[1][1][0][:] = 7                        # the reply lands in host memory
    uploads = acc.uploads
    staged.deliver()
    assert acc.uploads == uploads + 1
    for o in outs:
        np.testing.assert_array_equal(o, 7)


def test_staging_answers_the_device_layers_own_outputs_in_place_over_device_links():
    """With links that deliver device to device (``on_device``: cuda_ipc), a key whose
    one output is a flat-able device array of the device layer, of the key's dtype
    and size, is answered into that output itself (no block, nothing left to
    deliver); an output given twice, several outputs of one key, a rounded reply,
    another dtype or a strided output still go through the block."""
    from kvstore.devices.staging import Staging
    from kvstore.worker.store import KeyInfo
    acc = HostAccelerators(1)
    staging = Staging(acc)
    infos = [KeyInfo(k, (2, 3), np.dtype(np.float32)) for k in "abcdef"]
    own = acc.empty(0, 6, np.float32).reshape(2, 3)
    twice = acc.empty(0, 6, np.float32).reshape(2, 3)
    pair = [acc.empty(0, 6, np.float32).reshape(2, 3) for _ in range(2)]
    wide = acc.empty(0, 6, np.float64).reshape(2, 3)
    strided = acc.empty(0, 12, np.float32).reshape(2, 6)[:, ::2]
    targets, staged = staging.outputs([(infos[0], [own])], on_device=True)
    assert staged is None and len(targets[0][1]) == 1
    flat = targets[0][1][0]
    assert flat.shape == (6,) and np.shares_memory(flat, own)
    calls = [(infos[1], [twice]), (infos[2], [twice]), (infos[3], pair), (infos[4], [wide]), (infos[5], [strided])]
    targets, staged = staging.outputs([(infos[0], [own])] + calls, on_device=True, dtypes={})
    assert np.shares_memory(targets[0][1][0], own)
    assert staged is not None
    for (_, outs), (_, given) in zip(targets[1:], calls):
        assert not any(np.shares_memory(outs[0], g) for g in given)      # a block's view
    # a reply rounded on the wire (multi-precision) is received into a block of its dtype
    targets, staged = staging.outputs([(infos[0], [own])], on_device=True, dtypes={"a": np.dtype(np.float16)})
    assert staged is not None and targets[0][1][0].dtype == np.float16
    # without device links the replies come up into a host block, as before
    targets, staged = staging.outputs([(infos[0], [own])])
    assert staged is not None and not acc.holds(targets[0][1][0])


# ==== GPU-only checks ===============================================================================

@pytest.fixture
def cp():
    """cupy, when a GPU is usable; otherwise skip with the probe's reason."""
    if not gpu.available():
        pytest.skip(f"needs a usable GPU with CuPy: {gpu.reason()}")
    import cupy
    return cupy


@pytest.fixture
def cuda(cp):
    """torch with CUDA (and cupy), or skip saying which is missing."""
    if torch is None:
        pytest.skip("needs torch")
    if not torch.cuda.is_available():
        pytest.skip(f"needs torch with CUDA; this torch is {torch.__version__}")
    return torch


def two_devices(n=2):
    if gpu.device_count() < n:
        pytest.skip(f"needs {n} GPUs, found {gpu.device_count()}")


@pytest.fixture
def no_host_copies(monkeypatch):
    """Calling this fixture's function makes every host round trip fail the test."""
    def forbid():
        def fail(*args, **kwargs):
            raise AssertionError("a GPU value went through the host")
        monkeypatch.setattr(arrays, "to_numpy", fail)
        monkeypatch.setattr(gpu, "to_host", fail)
    return forbid


def as_np(value):
    if arrays.is_torch(value):
        return value.detach().cpu().numpy()
    return value.get()


@pytest.mark.gpu
def test_gpu_probe_finds_the_gpu_and_does_not_log_a_fallback(cp, caplog, monkeypatch):
    monkeypatch.setattr(gpu, "_fallbacks_logged", set())
    caplog.set_level(logging.INFO, logger="kvstore.devices.gpu")
    with kvstore.create("device") as kv:
        assert kv.device_id == cp.cuda.Device().id
    assert not [r for r in caplog.records if "no GPU found" in r.getMessage()]
    assert gpu.device_count() >= 1 and "CUDA device" in gpu.reason()
    assert gpu.xp_for(cp.zeros(2)) is cp


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["torch", "cupy"])
def test_gpu_device_store_one_device(cp, kind, no_host_copies, request):
    if kind == "torch":
        request.getfixturevalue("cuda")
        make = lambda a: torch.from_numpy(a).to("cuda:0")            # noqa: E731
        empty = lambda s: torch.empty(s, device="cuda:0")             # noqa: E731
    else:
        make, empty = cp.asarray, lambda s: cp.empty(s, cp.float32)   # noqa: E731
    with kvstore.create("device") as kv:
        kv.init(0, make(f32(2, 3)))
        assert type(kv._store[0]).__module__.startswith("cupy")     # kept on the GPU
        a, b = make(f32(2, 3, fill=1)), make(f32(2, 3, fill=2))
        no_host_copies()
        kv.push(0, [a, b])
        outs = [empty((2, 3)), empty((2, 3))]
        kv.pull(0, out=outs)
        g = make(f32(2, 3, fill=5))
        kv.pushpull(0, [g])                                            # written back into g
    for o in outs:
        np.testing.assert_array_equal(as_np(o), 3)
    np.testing.assert_array_equal(as_np(a), 1)                        # inputs untouched
    np.testing.assert_array_equal(as_np(b), 2)
    np.testing.assert_array_equal(as_np(g), 5)


@pytest.mark.gpu
def test_gpu_device_store_two_devices_torch(cuda, no_host_copies):
    two_devices()
    with kvstore.create("device") as kv:
        kv.init("w", torch.zeros(4, 5))
        no_host_copies()
        for step in range(2):
            kv.push("w", [torch.from_numpy(grad(0, step, (4, 5), d)).to(f"cuda:{d}") for d in range(2)])
            outs = [torch.empty(4, 5, device=f"cuda:{d}") for d in range(2)]
            kv.pull("w", out=outs)
            for d, o in enumerate(outs):
                assert o.device == torch.device(f"cuda:{d}")
                np.testing.assert_array_equal(o.cpu().numpy(), total(1, 2, step, (4, 5)))


@pytest.mark.gpu
def test_gpu_device_store_two_devices_cupy(cp, no_host_copies):
    two_devices()
    with kvstore.create("device") as kv:
        kv.init(1, np.zeros(1000, np.float32))
        values = []
        for d in range(2):
            with cp.cuda.Device(d):
                values.append(cp.asarray(grad(0, 0, (1000,), d)))
        outs = []
        for d in range(2):
            with cp.cuda.Device(d):
                outs.append(cp.empty(1000, cp.float32))
        no_host_copies()
        kv.push(1, values[::-1])          # the sum is taken on device 1, the values live on 0
        kv.pull(1, out=outs)
    for d, o in enumerate(outs):
        assert o.device.id == d
        np.testing.assert_array_equal(o.get(), total(1, 2, 0, (1000,)))


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", [opt.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3),
                                       opt.Adam(learning_rate=0.01)], ids=["sgd", "adam"])
def test_gpu_device_store_optimizer_matches_local_on_cpu(cuda, optimizer, tmp_path):
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal((30, 7)).astype(np.float32)
    grads = [[rng.standard_normal((30, 7)).astype(np.float32) for _ in range(2)] for _ in range(5)]
    with kvstore.create("local") as local:
        local.init(0, w0)
        local.set_optimizer(optimizer)
        for gs in grads:
            local.push(0, gs)
        want = np.empty_like(w0)
        local.pull(0, out=want)
    with kvstore.create("device") as kv:
        kv.init(0, torch.from_numpy(w0).cuda())
        kv.set_optimizer(optimizer)
        for gs in grads[:3]:
            kv.push(0, [torch.from_numpy(g).cuda() for g in gs])
        path = str(tmp_path / "states")
        kv.save_optimizer_states(path)         # GPU state -> file
        kv.load_optimizer_states(path)         # file -> GPU state (no change)
        for gs in grads[3:]:
            kv.push(0, [torch.from_numpy(g).cuda() for g in gs])
        got = torch.empty(30, 7, device="cuda")
        kv.pull(0, out=got)
        state = kv._updater.get_states()[0]["state"][0]
        assert type(state).__module__.startswith("cupy")          # optimizer state on the GPU
    np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_gpu_mixed_lists_and_strided_outputs(cuda, cp):
    with kvstore.create("device") as kv:
        kv.init(0, f32(2, 2))
        kv.push(0, [f32(2, 2, fill=1), cp.full((2, 2), 2, cp.float32), torch.full((2, 2), 3.0, device="cuda")])
        strided = torch.zeros(2, 4, device="cuda")[:, ::2]
        host = f32(2, 4)[:, ::2]
        wide = cp.zeros((2, 4), cp.float32)
        kv.pull(0, out=[strided, host, wide[:, ::2]])
    np.testing.assert_array_equal(strided.cpu().numpy(), 6)
    np.testing.assert_array_equal(host, 6)
    np.testing.assert_array_equal(wide.get(), np.tile([6, 0], (2, 2)))


@pytest.mark.gpu
def test_gpu_dist_device_sync_with_cuda_tensors(make_cluster, cuda):
    devices = min(2, gpu.device_count())
    shapes = [(10,), (3000,)]
    cluster = make_cluster(2, 2, chunk_bytes=SMALL_CHUNKS)

    def job(kv):
        kv.init([0, 1], [torch.zeros(s, device="cuda") for s in shapes])
        pushes = [[torch.from_numpy(grad(kv.rank, 0, s, d)).to(f"cuda:{d % devices}") for d in range(2)]
                  for s in shapes]
        kv.push([0, 1], pushes)
        outs = [[torch.empty(s, device=f"cuda:{d % devices}") for d in range(2)] for s in shapes]
        kv.pull([0, 1], out=outs)
        g = [torch.from_numpy(grad(kv.rank, 1, (10,), d)).to(f"cuda:{d % devices}") for d in range(2)]
        kv.pushpull(0, g)
        return [[o.cpu().numpy() for o in per] for per in outs], [x.cpu().numpy() for x in g]

    for outs, g in cluster.run(job, "dist_device_sync"):
        for per_device, s in zip(outs, shapes):
            for o in per_device:
                np.testing.assert_array_equal(o, total(2, 2, 0, s))
        for x in g:
            np.testing.assert_array_equal(x, total(2, 2, 1, (10,)))


def _train_cuda(model, trainer, rank, size, tt):
    per = tt.W * tt.B // size
    for x, y in tt.batches():
        x, y = x[rank * per:(rank + 1) * per].cuda(), y[rank * per:(rank + 1) * per].cuda()
        trainer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        trainer.step()
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.gpu
@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_gpu_trainer_trains_on_cuda_like_on_the_cpu(cuda, update_on_kvstore):
    tt = _trainer_helpers()
    want = tt.reference_torch(lambda ps: torch.optim.SGD(ps, **tt.SGD))   # on the CPU
    model = tt.make_model().cuda()
    with kvstore.create("device") as kv:
        trainer = tt.kvtorch.Trainer(model.parameters(), kv, torch.optim.SGD(model.parameters(), **tt.SGD),
                                     update_on_kvstore=update_on_kvstore)
        got = _train_cuda(model, trainer, 0, 1, tt)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("flat_buckets", [False, True])
def test_gpu_trainer_on_dist_device_sync_with_cuda_models(make_cluster, cuda, flat_buckets):
    tt = _trainer_helpers()
    want = tt.reference_torch(lambda ps: torch.optim.SGD(ps, **tt.SGD))
    models = [tt.make_model(seed=0 if r == 0 else 100 + r).cuda() for r in range(tt.W)]
    cluster = make_cluster(tt.W, 2, chunk_bytes=64)

    def job(kv):
        model = models[kv.rank]
        trainer = tt.kvtorch.Trainer(model.parameters(), kv, torch.optim.SGD(model.parameters(), **tt.SGD),
                                     flat_buckets=flat_buckets, bucket_bytes=100)
        return _train_cuda(model, trainer, kv.rank, kv.num_workers, tt)

    for got in cluster.run(job, "dist_device_sync"):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_gpu_trainer_exchanges_cuda_buckets_on_the_communication_thread(make_cluster, cuda):
    """Autograd runs a CUDA model's hooks on its device threads: every bucket's
    exchange is started by the Trainer's communication thread during backward."""
    import threading
    tt = _trainer_helpers()
    want = tt.reference_torch(lambda ps: torch.optim.SGD(ps, **tt.SGD))
    models = [tt.make_model(seed=0 if r == 0 else 100 + r).cuda() for r in range(tt.W)]
    threads = [set() for _ in range(tt.W)]

    def job(kv):
        model = models[kv.rank]
        trainer = tt.kvtorch.Trainer(model.parameters(), kv, torch.optim.SGD(model.parameters(), **tt.SGD),
                                     bucket_bytes=1)
        start = trainer._start

        def spy(*args):
            # the exchange's copies go on a stream of its own, not behind backward's
            # kernels on the default stream (issue 29: the overlap bought nothing)
            on_default = torch.cuda.current_stream().cuda_stream == torch.cuda.default_stream().cuda_stream
            threads[kv.rank].add((threading.current_thread().name, on_default))
            return start(*args)
        trainer._start = spy
        return _train_cuda(model, trainer, kv.rank, kv.num_workers, tt)

    for got in make_cluster(tt.W, 2, chunk_bytes=64).run(job, "dist_device_sync"):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert threads == [{("kvstore-trainer-comm", False)}] * tt.W


@pytest.mark.gpu
def test_gpu_arrays_round_trips_without_host_copies(cuda, cp, no_host_copies):
    t = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4)
    view = arrays.as_cupy(t)
    assert view.data.ptr == t.data_ptr() and view.shape == (3, 4)      # DLPack: same memory
    assert arrays.is_gpu(t) and arrays.device_of(t) == t.device.index
    assert gpu.xp_for(t) is cp
    out_t = torch.empty(3, 4, device="cuda")
    out_c = cp.empty((3, 4), cp.float32)
    ptr_t, ptr_c = out_t.data_ptr(), out_c.data.ptr
    no_host_copies()
    src = cp.arange(12, dtype=cp.float32)
    arrays.write(out_t, src)                 # cupy -> torch CUDA, on the GPU
    arrays.write(out_c, src)                 # cupy -> cupy
    assert (out_t.data_ptr(), out_c.data.ptr) == (ptr_t, ptr_c)
    assert torch.equal(out_t, t)
    assert bool((out_c.reshape(-1) == src).all())


@pytest.mark.gpu
def test_gpu_torch_tensors_are_viewed_directly_where_the_streams_agree(cuda, cp):
    """as_cupy skips DLPack (~70 us a tensor) for a contiguous tensor when torch and
    cupy queue on the same stream, and uses it where it must: strided, empty,
    bfloat16 tensors and a torch stream that is not cupy's (DLPack orders them)."""
    base = torch.arange(24, dtype=torch.float32, device="cuda")
    t = base[4:16].reshape(3, 4)                     # a view at an offset: its own address
    direct = arrays._direct_view(t, t.device.index, cp, torch)
    assert direct is not None and direct.data.ptr == t.data_ptr() and direct.shape == (3, 4)
    assert direct.dtype == cp.float32 and bool((direct.reshape(-1) == cp.arange(4, 16)).all())
    for other in (t.t(), t[:0], t.to(torch.bfloat16), torch.ones(3, dtype=torch.float16, device="cuda")):
        view = arrays._direct_view(other, t.device.index, cp, torch)
        assert view is None or (other.dtype == torch.float16 and view.dtype == cp.float16)
        np.testing.assert_array_equal(cp.asnumpy(arrays.as_cupy(other)),
                                      other.float().cpu().numpy() if other.dtype == torch.bfloat16
                                      else other.cpu().numpy())
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):                    # torch on a side stream, cupy on its own
        assert arrays._direct_view(t, t.device.index, cp, torch) is None
        big = torch.empty(1 << 24, device="cuda")
        big.fill_(3.0)                               # queued on the side stream
        seen = float(arrays.as_cupy(big).sum())      # DLPack: cupy's stream waits for it
    assert seen == 3.0 * (1 << 24)


@pytest.mark.gpu
def test_gpu_host_copies_are_pinned(cuda, cp):
    t = torch.ones(1000, device="cuda")
    host = arrays.to_numpy(t, "test")
    assert gpu.is_pinned(host) and (host == 1).all()
    host_c = arrays.to_numpy(cp.ones(1000, cp.float32), "test")
    assert gpu.is_pinned(host_c) and (host_c == 1).all()
    buf, direct = arrays.flat_target(t, "test")
    assert not direct and buf.size == 1000 and gpu.is_pinned(buf)
    assert gpu.is_pinned(gpu.pinned_empty(10, np.float32))
    assert not gpu.is_pinned(np.empty(1000, np.float32))


@pytest.mark.gpu
def test_gpu_cross_device_write_is_a_peer_copy(cp, no_host_copies):
    two_devices()
    with cp.cuda.Device(0):
        src = cp.arange(1000, dtype=cp.float32)
    with cp.cuda.Device(1):
        out = cp.empty(1000, cp.float32)
    no_host_copies()
    arrays.write(out, src)
    assert out.device.id == 1
    np.testing.assert_array_equal(out.get(), np.arange(1000))


# ---- GPU checks from the review of 2026-12 (never run on a GPU yet) --------------------------------

def busy_cupy(cp, rounds=20):
    """Queue tens of milliseconds of matmuls on cupy's current stream (on the current
    device): work queued after it starts late, so a missing wait shows as wrong values."""
    a = cp.ones((4096, 4096), cp.float32)
    for _ in range(rounds):
        a @ a


def busy_torch(rounds=20):
    """busy_cupy on torch's current stream."""
    a = torch.ones(4096, 4096, device="cuda")
    for _ in range(rounds):
        a @ a


@pytest.mark.gpu
def test_gpu_copy_between_devices_keeps_the_source_until_it_is_read(cp):
    two_devices()
    n = 1 << 22
    for step in range(3):
        with cp.cuda.Device(0):
            src = cp.full(n, step + 7, cp.float32)
        with cp.cuda.Device(1):          # called under the destination, as arrays.write does
            dst = cp.zeros(n, cp.float32)
            busy_cupy(cp)                # the peer copy on device 1 runs late
            gpu.copy_between_devices(dst, src)
        with cp.cuda.Device(0):
            src.fill(-1)                 # device 0's stream must wait for the copy
        with cp.cuda.Device(1):
            np.testing.assert_array_equal(dst.get(), step + 7)


@pytest.mark.gpu
@pytest.mark.parametrize("store", ["local", "dist_sync", "dist_device_sync"])
def test_gpu_pulls_through_pinned_staging_into_cupy_outputs(cp, make_cluster, store):
    """Each pull stages in pinned memory that goes back to the pool right after; the
    upload into the cupy output must be done by then (the pool reuses it at once)."""
    keys, n = list(range(200)), 1 << 20

    def job(kv):
        kv.init(keys, [np.zeros(n, np.float32)] * len(keys))
        for k in keys:
            kv.push(k, np.full(n, k + 1, np.float32))
        outs = [cp.empty(n, cp.float32) for _ in keys]
        busy_cupy(cp)                    # the uploads queue behind this
        for k in keys:
            kv.pull(k, out=outs[k])
        return [k for k in keys if not bool((outs[k] == k + 1).all())]

    if store == "local":
        with kvstore.create(store) as kv:
            wrong = job(kv)
    else:
        [wrong] = make_cluster(1, 1).run(job, store, timeout=110)
    assert wrong == []


@pytest.mark.gpu
@pytest.mark.parametrize("streams", ["torch-side-stream", "cupy-stream", "both"])
def test_gpu_device_store_orders_non_default_streams(cuda, cp, streams):
    n = 1 << 22
    torch_stream = torch.cuda.current_stream() if streams == "cupy-stream" else torch.cuda.Stream()
    cupy_stream = cp.cuda.Stream.null if streams == "torch-side-stream" else cp.cuda.Stream(non_blocking=True)
    seen = []
    with kvstore.create("device") as kv, torch.cuda.stream(torch_stream), cupy_stream:
        kv.init(0, torch.zeros(n, device="cuda"))
        for step in range(3):
            busy_torch()
            g = torch.full((n,), float(step + 1), device="cuda")   # written late, on torch's stream
            busy_cupy(cp)                # the store's own copy runs late, on cupy's stream
            kv.push(0, g)                # cupy waits for torch's fill (DLPack)
            g.fill_(-1.0)                # torch waits for cupy's read (join_streams)
            out, c = torch.empty(n, device="cuda"), cp.empty(n, cp.float32)
            kv.pull(0, out=[out, c])     # torch's copy waits for cupy's update
            seen.append((out.cpu().numpy(), c.get()))   # each waits for its own stream only
    for step, (t_out, c_out) in enumerate(seen):
        np.testing.assert_array_equal(t_out, step + 1)
        np.testing.assert_array_equal(c_out, step + 1)


@pytest.mark.gpu
def test_gpu_join_streams_without_the_cuda_stream_protocol(cuda, cp, monkeypatch):
    """Older torch streams have no __cuda_stream__: join_streams uses ExternalStream."""
    n = 1 << 22
    side = torch.cuda.Stream()
    old_style = types.SimpleNamespace(cuda_stream=side.cuda_stream)   # the handle only
    with torch.cuda.stream(side):
        x = torch.zeros(n, device="cuda")
        side.synchronize()
        busy_torch()
        x.fill_(5.0)                     # late, on torch's side stream
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: old_style)
        gpu.join_streams(x.device.index)   # cupy's stream waits for the fill
        monkeypatch.undo()
    # x's memory, seen by cupy without DLPack's own stream handshake
    memory = cp.cuda.UnownedMemory(x.data_ptr(), n * 4, x, x.device.index)
    view = cp.ndarray((n,), cp.float32, cp.cuda.MemoryPointer(memory, 0))
    np.testing.assert_array_equal(view.copy().get(), 5)


@pytest.mark.gpu
def test_gpu_device_store_keeps_a_key_on_its_initial_values_device(cuda, cp, no_host_copies, monkeypatch):
    last = gpu.device_count() - 1    # with one GPU this checks the bookkeeping only
    sgd = opt.SGD(learning_rate=0.5, momentum=0.9)
    with kvstore.create("local") as local:
        local.init("w", f32(4, 5, fill=1))
        local.set_optimizer(sgd)
        for step in range(3):
            local.push("w", f32(4, 5, fill=step + 1.0))
        want = f32(4, 5)
        local.pull("w", out=want)
    with cp.cuda.Device(0):
        kv = kvstore.create("device")   # as a process creating the store before set_device
    with kv:
        kv.init(["w", "host"], [torch.ones(4, 5, device=f"cuda:{last}"), f32(4, 5)])
        kv.set_optimizer(sgd)
        assert kv.device_id == 0
        assert kv._store["w"].device.id == last and kv._store["host"].device.id == 0
        monkeypatch.setattr(gpu, "copy_between_devices", lambda *a: pytest.fail("a peer copy"))
        no_host_copies()
        for step in range(3):
            kv.push("w", torch.full((4, 5), step + 1.0, device=f"cuda:{last}"))
        got = torch.empty(4, 5, device=f"cuda:{last}")
        kv.pull("w", out=got)
        assert kv._updater.get_states()["w"]["state"][0].device.id == last   # the state too
    np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-6)


@pytest.mark.gpu
def test_gpu_store_created_before_set_device_works_on_the_ranks_gpu(cuda, cp, no_host_copies, monkeypatch):
    two_devices()
    previous = torch.cuda.current_device()
    try:
        torch.cuda.set_device(0)
        kv = kvstore.create("device")         # a process for GPU 1 that creates the store first
        torch.cuda.set_device(1)
        kv.init(0, torch.zeros(1000, device="cuda"))
        assert kv.device_id == 0 and kv._store[0].device.id == 1
        monkeypatch.setattr(gpu, "copy_between_devices", lambda *a: pytest.fail("a peer copy"))
        no_host_copies()
        kv.push(0, [torch.full((1000,), 2.0, device="cuda"), torch.full((1000,), 3.0, device="cuda")])
        out = torch.empty(1000, device="cuda")
        kv.pull(0, out=out)
        kv.close()
    finally:
        torch.cuda.set_device(previous)
    assert out.device.index == 1
    np.testing.assert_array_equal(out.cpu().numpy(), 5)


@pytest.mark.gpu
def test_gpu_bfloat16_cuda_tensors_on_the_device_store(cuda, no_host_copies):
    with kvstore.create("device") as kv:
        got = bf16_push_pull(kv, "cuda", after_init=no_host_copies)
        held = kv._store[0].get()
    assert held.dtype == np.float32
    np.testing.assert_array_equal(held, sum(BF16_TERMS))        # summed in float32 on the GPU
    for t in got:
        assert t.dtype == torch.bfloat16 and torch.equal(t, bf16_expected())


@pytest.mark.gpu
def test_gpu_bfloat16_cuda_tensors_on_dist_device_sync(make_cluster, cuda):
    cluster = make_cluster(2, 2, chunk_bytes=SMALL_CHUNKS)
    for got in cluster.run(lambda kv: bf16_push_pull(kv, "cuda"), "dist_device_sync"):
        for t in got:
            assert torch.equal(t, bf16_expected(workers=2))
