"""Mixed precision on the wire (issue 45 item 3, kvstore.precision): float16 and
bfloat16 gradients pushed as they are to float32 keys (``kv.set_multi_precision``),
widened exactly and summed and updated in float32 by the servers, pulled back in
float32 or rounded once into float16/bfloat16 outputs; refused without the opt-in.

The whole-job test runs ``python -m tracker.local -n 2 -s 2`` on
tests/scripts/mixed_precision_job.py, which compares every value with twin keys
pushed the same gradients upcast to float32, bit for bit, and counts the bytes."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import kvstore
import kvstore.optimizer
from kvstore import precision
from kvstore import devices
from kvstore.devices import HostAccelerators, HostDevice
from kvstore.errors import InvalidArgumentError, ProtocolError
from kvstore.protocol import ops
from kvstore.server.backend import DeviceBackend, HostBackend
from state_driver import A, Server, by_id, expect_error, expect_ok, only, peer, vec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def every_pattern(dtype) -> torch.Tensor:
    return torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)


@pytest.mark.parametrize("name,dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_widen_gives_torchs_float32_for_every_2_byte_pattern(name, dtype):
    values = every_pattern(dtype)
    payload = values.view(torch.int16).numpy().view(np.uint16) if name == "bfloat16" else values.numpy()
    wide = precision.widen(name, payload, payload.size, "chunk x:0")
    want = values.float().numpy()
    finite = np.isfinite(want)
    assert wide.dtype == np.float32
    assert (wide.view(np.uint32)[finite] == want.view(np.uint32)[finite]).all()
    assert (np.isnan(wide) == np.isnan(want)).all() and (wide[np.isinf(want)] == want[np.isinf(want)]).all()


def test_widen_refuses_a_chunk_or_payload_it_does_not_fit():
    with pytest.raises(InvalidArgumentError, match="float32 keys only"):
        precision.widen("bfloat16", np.zeros(3, np.uint16), 3, "chunk w:0", np.float64)
    with pytest.raises(InvalidArgumentError, match="expected 3 x uint16"):
        precision.widen("bfloat16", np.zeros(3, np.float16), 3, "chunk w:0")
    with pytest.raises(InvalidArgumentError, match="expected 4 x float16"):
        precision.widen("float16", np.zeros(3, np.float16), 4, "chunk w:0")
    with pytest.raises(ProtocolError, match="one entry"):
        precision.parse(["bfloat16"], 2)
    with pytest.raises(ProtocolError, match="'int8' is not one of"):
        precision.parse(["int8"], 1)


def bf16(*values) -> np.ndarray:
    return torch.tensor(values, dtype=torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("backend", [HostBackend, lambda: DeviceBackend(HostDevice())], ids=["host", "device"])
def test_the_server_widens_marked_chunks_and_sums_them_with_float32_pushes(backend):
    """A round of a bfloat16, a float16 and a float32 push is their float32 sum (the
    device layer's host device runs the GPU server's path)."""
    s = Server(num_workers=3, init={A: vec(0, 0, 0)}, backend=backend())
    s.send(0, ops.PUSH, [A], [bf16(1.5, -2.0, 3.0078125)], precision=["bfloat16"])
    s.send(1, ops.PUSH, [A], [np.array([0.25, 1e-3, -65504], np.float16)], precision=["float16"])
    s.send(2, ops.PUSH, [A], [vec(1e-7, 0, 1)], precision=[None])
    want = (torch.tensor([1.5, -2.0, 3.0078125], dtype=torch.bfloat16).float().numpy() + np.array([0.25, 1e-3, -65504], np.float16).astype(np.float32)
            + vec(1e-7, 0, 1))
    assert s.value(A).tobytes() == want.tobytes()


def test_the_server_refuses_what_the_precision_field_cannot_carry():
    s = Server(num_workers=1, init={A: vec(0, 0), ("d", 0): np.zeros(2, np.float64)})
    cases = [
        ([A], [bf16(1, 2)], {"precision": ["int8"]}, "ProtocolError", "not one of"),
        ([A], [bf16(1, 2)], {"precision": ["bfloat16", None]}, "ProtocolError", "one entry"),
        ([A], [vec(1, 2)], {"precision": ["bfloat16"]}, "InvalidArgumentError", "expected 2 x uint16"),
        ([("d", 0)], [bf16(1, 2)], {"precision": ["bfloat16"]}, "InvalidArgumentError", "float32 keys only"),
        ([A], [np.zeros(2, np.float16)], {"precision": ["float16"], "compression": {"type": "fp16"}},
         "ProtocolError", "not both"),
        ([A], [bf16(1, 2)], {}, "InvalidArgumentError", "uint16"),          # unmarked: the dtype check
    ]
    for chunks, arrays, fields, kind, fragment in cases:
        rid, r = s.send(0, ops.PUSH, chunks, arrays, **fields)
        expect_error(only(r), peer(0), rid, kind, fragment)
    assert s.value(A).tolist() == [0, 0]               # nothing refused joined a round
    rid, r = s.send(0, ops.PUSHPULL, [A], [bf16(1, 2)], precision=["bfloat16"])
    assert by_id(r)[rid].arrays[0].tolist() == [1, 2]
    expect_ok(by_id(r)[rid], peer(0), rid)


def test_stores_without_servers_refuse_the_opt_in_and_a_dtype_mismatch_names_it():
    with kvstore.create("local") as kv:
        with pytest.raises(InvalidArgumentError, match="'local' stores keep values in their keys' dtypes"):
            kv.set_multi_precision(True)
        kv.init("w", np.zeros(3, np.float32))
        with pytest.raises(InvalidArgumentError, match=r"has dtype float32, got bfloat16 .*set_multi_precision"):
            kv.push("w", torch.zeros(3, dtype=torch.bfloat16))
        with pytest.raises(InvalidArgumentError, match=r"has dtype float32, got float16 .*set_multi_precision"):
            kv.pull("w", out=np.zeros(3, np.float16))


def test_numpy_float16_and_refusals_before_sending_in_a_cluster(make_cluster):
    """numpy float16 values (no torch) go as they are; compression and low precision
    together, and a float16 value for a float64 key, are refused before sending."""
    cluster = make_cluster(2, 2, chunk_bytes=64)

    def work(kv):
        kv.init(["w", "d"], [np.zeros(40, np.float32), np.zeros(4, np.float64)])
        kv.set_multi_precision(True)
        g = np.linspace(-3, 3, 40).astype(np.float16) * (kv.rank + 1)
        out16, out32 = np.empty(40, np.float16), np.empty(40, np.float32)
        kv.pushpull("w", g, out=out16)
        kv.pull("w", out=out32)
        want = g.astype(np.float32) + (g.astype(np.float32) / (kv.rank + 1)) * (2 - kv.rank)   # the 2 ranks' sum
        exact = out32.tobytes() == want.tobytes() and out16.tobytes() == want.astype(np.float16).tobytes()
        sent = kv.comm_stats()["bytes_sent"]
        errors = []
        for call in (lambda: kv.push("d", np.zeros(4, np.float16)),
                     lambda: (kv.set_gradient_compression({"type": "fp16"}), kv.push("w", g))):
            try:
                call()
                errors.append(None)
            except InvalidArgumentError as e:
                errors.append(str(e))
        kv.barrier()
        return exact, kv.comm_stats()["bytes_sent"] == sent, errors
    for exact, nothing_sent, errors in cluster.run(work):
        assert exact and nothing_sent
        assert "has dtype float64, got float16" in errors[0], errors
        assert "gradient compression does not take" in errors[1], errors


def job_lines(tmp_path, *args) -> list[list[str]]:
    env = {**os.environ, "PYTHONPATH": ROOT, "KVSTORE_TIMEOUT": "30", "KVSTORE_CHUNK_BYTES": "65536"}
    p = subprocess.run([sys.executable, "-m", "tracker.local", "-n", "2", "-s", "2", sys.executable,
                        os.path.join(ROOT, "tests", "scripts", "mixed_precision_job.py"), *args],
                       env=env, capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    return [line.split("] ", 1)[1].split() for line in p.stdout.splitlines() if "] RANK " in line or "] BYTES " in line]


@pytest.mark.parametrize("mode", ["arrival", "deterministic"])
def test_a_2_worker_job_gets_the_float32_pushes_bits_in_half_the_bytes(tmp_path, mode):
    lines = job_lines(tmp_path, *(["deterministic"] if mode == "deterministic" else []))
    checks = [line for line in lines if line[0] == "RANK"]
    byte_lines = [line for line in lines if line[0] == "BYTES"]
    # per rank: 3 refusals off, 5 steps x 2 precisions x 3 checks, 2 pushpull steps x 2, 4 + 2 refusals
    assert len(checks) == 2 * (3 + 5 * 2 * 3 + 2 * 2 + 6), checks
    failed = [line for line in checks if line[3] != "True"]
    assert not failed, failed
    assert len(byte_lines) == 2 * 5 * 2
    for _, rank, name, step, low, wide in byte_lines:
        # the gradients' bytes halve; each message's header stays (a few dozen bytes)
        assert 0.49 < int(low) / int(wide) < 0.51, (rank, name, step, low, wide)


@pytest.mark.parametrize("update_on_kvstore", [False, True])
def test_a_trainer_of_bfloat16_parameters_sends_half_the_bytes_and_trains_the_same(make_cluster, update_on_kvstore):
    """kvstore.torch.Trainer with bfloat16 parameters: their keys are float32 on the
    servers; with multi-precision their gradients travel as bfloat16 (before, upcast to
    float32) and every worker ends with the same bits as without."""
    from kvstore import torch as kvtorch

    def train(multi: bool):
        cluster = make_cluster(2, 2, chunk_bytes=1024)

        def work(kv):
            if multi:
                kv.set_multi_precision(True)
            g = torch.Generator().manual_seed(3)
            model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 5))
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            model = model.to(torch.bfloat16)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            trainer = kvtorch.Trainer(model.parameters(), kv, opt, update_on_kvstore=update_on_kvstore)
            data = torch.Generator().manual_seed(10 + kv.rank)
            sent = kv.comm_stats()["bytes_sent"]
            for _ in range(4):
                trainer.zero_grad()
                x = torch.randn(8, 24, generator=data).to(torch.bfloat16)
                (model(x).float() ** 2).mean().backward()
                trainer.step()
            return [p.detach().clone() for p in model.parameters()], kv.comm_stats()["bytes_sent"] - sent
        return cluster.run(work)

    wide, low = train(False), train(True)
    for (w_params, w_sent), (l_params, l_sent) in zip(wide, low):
        assert all(torch.equal(a, b) and a.dtype == torch.bfloat16 for a, b in zip(w_params, l_params))
        assert l_sent < 0.6 * w_sent, (l_sent, w_sent)
    assert all(torch.equal(a, b) for a, b in zip(low[0][0], low[1][0]))      # the workers agree


def _low_and_twin(kv, size: int, optimizer, seed: int) -> tuple[np.ndarray, np.ndarray, list[torch.Tensor]]:
    """Keys "low" and "twin" of the same float32 values updated by ``optimizer`` on the
    servers (multi precision on): 3 pushpulls of a bfloat16 gradient (drawn from
    ``seed``) to "low" and of it upcast to float32 to "twin". Returns both keys pulled
    in float32 and the last pushpull's outputs (bfloat16, float32)."""
    kv.init(["low", "twin"], [np.linspace(-1, 1, size, dtype=np.float32)] * 2)
    kv.set_optimizer(optimizer)
    kv.set_multi_precision(True)
    g = torch.Generator().manual_seed(seed)
    outs = [torch.empty(size, dtype=torch.bfloat16), torch.empty(size)]
    for _ in range(3):
        grad = torch.randn(size, generator=g).to(torch.bfloat16)
        kv.pushpull(["low", "twin"], [grad, grad.float()], out=outs)
    low, twin = np.empty(size, np.float32), np.empty(size, np.float32)
    kv.pull(["low", "twin"], out=[low, twin])
    return low, twin, outs


@pytest.mark.parametrize("store", ["dist_async", "dist_ssp"])
def test_async_and_ssp_servers_update_from_low_precision_pushes_as_from_float32(make_cluster, store):
    cluster = make_cluster(1, 2, chunk_bytes=64)

    def work(kv):
        low, twin, outs = _low_and_twin(kv, 50, kvstore.optimizer.SGD(learning_rate=0.1, momentum=0.9), seed=1)
        return low.tobytes() == twin.tobytes(), torch.equal(outs[0], outs[1].to(torch.bfloat16))
    assert cluster.run(work, store_type=store) == [(True, True)]


def test_dist_device_sync_on_emulated_gpus_takes_float16_both_ways_in_half_the_bytes(make_cluster, monkeypatch):
    """dist_device_sync's GPU path (the device layer's host accelerators, two emulated
    GPUs) with multi-precision: a key's float16 values on both devices are widened
    and summed in float32 on the first one, one float16 value goes as it is, and
    float16 outputs on the devices (and the host) get the float32 sum rounded once,
    through a float16 staging block: the bits of the same values pushed in float32
    and rounded by numpy, in half the bytes each way. Async calls too."""
    acc = HostAccelerators(2)
    monkeypatch.setattr(devices, "worker_accelerators", lambda: acc)
    cluster = make_cluster(2, 2, chunk_bytes=8192)
    n = 12_000                  # (chunks of 2048 values: each message's header stays, ~1 % of it)

    def work(kv):
        kv.init(["low", "twin"], [acc.to_device(np.zeros(n, np.float32), 0)] * 2)
        kv.set_multi_precision(True)
        g = [(np.linspace(-3, 3, n) * (kv.rank + 1 + d) / 7).astype(np.float16) for d in range(2)]
        low_outs = [acc.empty(d, n, np.float16) for d in range(2)] + [np.empty(n, np.float16)]
        twin_outs = [acc.empty(d, n, np.float32) for d in range(2)]
        s0 = kv.comm_stats()
        kv.pushpull("low", [acc.to_device(x, d) for d, x in enumerate(g)], out=low_outs)
        s1 = kv.comm_stats()
        kv.pushpull("twin", [acc.to_device(x.astype(np.float32), d) for d, x in enumerate(g)], out=twin_outs)
        s2 = kv.comm_stats()
        one = acc.to_device(g[1], 1)          # one float16 value: on the wire as it is
        kv.pushpull_async("low", one, out=low_outs[1]).wait()
        s3 = kv.comm_stats()
        kv.pushpull_async("twin", acc.to_device(g[1].astype(np.float32), 1), out=twin_outs[1]).wait()
        s4 = kv.comm_stats()
        back = acc.empty(0, n, np.float16)
        kv.pull_async("low", out=back).wait()
        wide = np.empty(n, np.float32)
        kv.pull("twin", out=wide)
        # (a list of values is summed in float32 and sent so: the sent bytes halve for one value)
        ratio = [(s1["bytes_received"] - s0["bytes_received"]) / (s2["bytes_received"] - s1["bytes_received"])] + \
            [(s3[f] - s2[f]) / (s4[f] - s3[f]) for f in ("bytes_sent", "bytes_received")]
        return ([np.asarray(o).tobytes() for o in low_outs[::2]], np.asarray(twin_outs[0]).astype(np.float16).tobytes(),
                np.asarray(back).tobytes(), wide.astype(np.float16).tobytes(), [acc.holds(o) for o in low_outs], ratio)
    for lows, twin, back, wide, on_device, ratio in cluster.run(work, store_type="dist_device_sync"):
        assert lows == [twin, twin] and back == wide
        assert on_device == [True, True, False]
        assert all(0.49 < r < 0.52 for r in ratio), ratio


def test_without_a_gpu_dist_device_sync_is_dist_sync_and_async_calls_take_low_precision(make_cluster):
    """dist_device_sync without a GPU is dist_sync, which takes low-precision values
    and outputs through pushpull_async and pull_async too."""
    def handles(kv):
        kv.init(3, np.arange(6, dtype=np.float32))
        kv.set_multi_precision(True)
        out = torch.empty(6, dtype=torch.float16)
        kv.pushpull_async(3, torch.full((6,), 0.5, dtype=torch.bfloat16), out=out).wait()
        back = torch.empty(6, dtype=torch.bfloat16)
        kv.pull_async(3, out=back).wait()
        return out.tolist(), back.tolist()
    assert make_cluster(1, 1).run(handles, store_type="dist_device_sync") == [([0.5] * 6, [0.5] * 6)]   # (no GPU here)


def test_lamb_on_keys_cut_over_servers_takes_low_precision_pushes_in_its_two_phases(make_cluster):
    """LAMB's norms across servers (phase 1 terms from the widened values, phase 2
    step): the same bits as the float32 twin's."""
    cluster = make_cluster(2, 2, chunk_bytes=64)

    def work(kv):
        low, twin, _ = _low_and_twin(kv, 100, kvstore.optimizer.create("lamb", learning_rate=0.01), seed=7 + kv.rank)
        kv.barrier()
        return len(kv._keys["low"].chunks) > 1, low.tobytes() == twin.tobytes(), not np.array_equal(
            low, np.linspace(-1, 1, 100, dtype=np.float32))
    assert cluster.run(work) == [(True, True, True)] * 2


@pytest.mark.gpu
def test_gpu_dist_device_sync_takes_bfloat16_cuda_tensors_both_ways_in_half_the_bytes(make_cluster):
    """On a GPU: a bfloat16 CUDA gradient goes as its 2-byte patterns (a view on its
    device) and a bfloat16 CUDA output receives the servers' rounding as patterns: the
    float32 twin's value rounded by torch on the GPU, bit for bit, in half the bytes."""
    from kvstore.devices import gpu
    if not (gpu.available() and torch.cuda.is_available()):
        pytest.skip(f"needs a usable GPU with CuPy and torch with CUDA: {gpu.reason()}")
    n = 100_000

    def work(kv):
        kv.init(["low", "twin"], [torch.zeros(n, device="cuda")] * 2)
        kv.set_multi_precision(True)
        g = (torch.linspace(-3, 3, n, device="cuda") * (kv.rank + 1)).to(torch.bfloat16)
        out, twin = torch.empty(n, dtype=torch.bfloat16, device="cuda"), torch.empty(n, device="cuda")
        s0 = kv.comm_stats()
        kv.pushpull("low", g, out=out)
        s1 = kv.comm_stats()
        kv.pushpull("twin", g.float(), out=twin)
        s2 = kv.comm_stats()
        ratio = [(s1[f] - s0[f]) / (s2[f] - s1[f]) for f in ("bytes_sent", "bytes_received")]
        return torch.equal(out.view(torch.int16), twin.to(torch.bfloat16).view(torch.int16)), ratio
    for same, ratio in make_cluster(2, 1).run(work, store_type="dist_device_sync"):
        assert same and all(0.49 < r < 0.52 for r in ratio), ratio
