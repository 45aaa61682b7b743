"""Pulls in low precision (issue 45 item 3, kvstore.server.reply_precision): with
``kv.set_multi_precision(True)`` a float16/bfloat16 output of a float32 key asks the
servers for its reply in that precision (``reply_precision``); they round their
float32 values once, as torch's ``.to()`` rounds, and half the bytes come back,
received straight into the outputs. Checked bit for bit against torch's conversion:
the rounding alone, the server state on the host and the device layer's backend, and
real clusters over every transport the precision path takes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvstore
from kvstore import precision
from kvstore.devices import HostDevice
from kvstore.errors import InvalidArgumentError
from kvstore.protocol import ops
from kvstore.server.backend import DeviceBackend, HostBackend
from kvstore.server.budget import MemoryBudget
from state_driver import A, C, Server, by_id, expect_error, expect_ok, only, peer, vec

TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def float32_patterns() -> np.ndarray:
    """Every upper half of a float32 with lower halves at and around bfloat16's ties
    (0x8000), and around float16's rounding points, plus random patterns: 600k values."""
    upper = np.arange(1 << 16, dtype=np.uint32) << 16
    lows = np.array([0, 1, 0x0FFF, 0x1000, 0x1001, 0x2000, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    grid = (upper[:, None] | lows[None, :]).reshape(-1)
    rng = np.random.default_rng(45)
    return np.concatenate([grid, rng.integers(0, 1 << 32, 1 << 17, dtype=np.uint64).astype(np.uint32)]).view(np.float32)


def torch_bits(values: np.ndarray, name: str) -> np.ndarray:
    return torch.from_numpy(values).to(TORCH[name]).view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_narrow_rounds_every_float32_pattern_as_torch(name):
    values = float32_patterns()
    got = precision.narrow(name, values).view(np.uint16)
    want = torch_bits(values, name)
    nan = np.isnan(values)
    assert (got[~nan] == want[~nan]).all(), np.flatnonzero(got[~nan] != want[~nan])[:5]
    back = torch.from_numpy(got.view(np.int16)).view(TORCH[name]).float().numpy()
    assert np.isnan(back[nan]).all()                 # a NaN stays one (its payload is not kept)
    # into a given buffer (the servers' kept one), and on the device layer's host device
    out = np.empty(values.size, precision.WIRE_DTYPES[name])
    assert precision.narrow(name, values, out) is out and (out.view(np.uint16)[~nan] == want[~nan]).all()
    # numpy's own rounding (in blocks), where torch is not installed; and cupy's code on numpy
    by_numpy = np.empty(values.size, precision.WIRE_DTYPES[name])
    precision._narrow_arrays(name, values, by_numpy)
    assert (by_numpy.view(np.uint16)[~nan] == want[~nan]).all()
    assert np.isnan(torch.from_numpy(by_numpy.view(np.int16)).view(TORCH[name]).float().numpy()[nan]).all()
    dev = HostDevice()
    on_device = dev.empty(values.size, np.float32)
    on_device[...] = values
    assert dev.is_device_array(narrowed := precision.narrow(name, on_device))
    assert (np.asarray(narrowed).view(np.uint16)[~nan] == want[~nan]).all()


def test_narrow_refuses_what_it_cannot_round():
    with pytest.raises(InvalidArgumentError, match="narrowed from float32, got float64"):
        precision.narrow("bfloat16", np.zeros(3))
    with pytest.raises(InvalidArgumentError, match="expected 3 x uint16"):
        precision.narrow("bfloat16", np.zeros(3, np.float32), np.zeros(3, np.float16))


def bf16_of(values: np.ndarray) -> np.ndarray:
    return torch_bits(np.asarray(values, np.float32), "bfloat16")


@pytest.mark.parametrize("backend", [HostBackend, lambda: DeviceBackend(HostDevice())], ids=["host", "device"])
def test_sync_replies_come_rounded_as_each_read_asked(backend, monkeypatch):
    """A sync round's pushpull replies, one per worker: bfloat16 patterns, float16, and
    float32 for one that did not ask; a later pull asks for a mix of chunks."""
    s = Server(num_workers=3, init={A: vec(0, 0, 0), C: vec(0, 0)}, backend=backend())
    grads = [vec(1.00390625, -3.3, 1e-9), vec(2.0, 1.7, 65536), vec(0.5, 0.001, -70000)]
    r0 = s.send(0, ops.PUSHPULL, [A], [grads[0]], reply_precision=["bfloat16"])[1]
    r1 = s.send(1, ops.PUSHPULL, [A], [grads[1]], reply_precision=["float16"])[1]
    assert r0 == [] and r1 == []
    rid2, replies = s.send(2, ops.PUSHPULL, [A], [grads[2]])
    total = grads[0] + grads[1] + grads[2]
    got = {r.peer: s.state.backend.download(r.arrays, copy=True)[0] for r in replies}
    assert got[peer(0)].dtype == np.uint16 and got[peer(0)].tobytes() == bf16_of(total).tobytes()
    assert got[peer(1)].dtype == np.float16 and got[peer(1)].tobytes() == torch_bits(total, "float16").tobytes()
    assert got[peer(2)].tobytes() == total.tobytes()
    both = [r for r in replies if r.peer in (peer(0), peer(1))]
    s3 = Server(num_workers=2, init={A: vec(0, 0, 0)}, backend=backend())
    s3.send(0, ops.PUSHPULL, [A], [grads[0]], reply_precision=["bfloat16"])
    rounded, narrow = [], precision.narrow
    monkeypatch.setattr(precision, "narrow", lambda *a: rounded.append(a[0]) or narrow(*a))   # (counted, then run)
    _, pair = s3.send(1, ops.PUSHPULL, [A], [grads[1]], reply_precision=["bfloat16"])
    assert len(pair) == 2 and pair[0].arrays[0] is pair[1].arrays[0] and rounded == ["bfloat16"]   # rounded once
    assert both and pair[0].arrays[0].tobytes() == bf16_of(grads[0] + grads[1]).tobytes()
    rid, r = s.send(0, ops.PULL, [A, C], reply_precision=[None, "bfloat16"])
    rep = expect_ok(only(r), peer(0), rid, nvalues=2)
    values = s.state.backend.download(rep.arrays, copy=True)
    assert values[0].tobytes() == total.tobytes() and values[1].tobytes() == bf16_of(vec(0, 0)).tobytes()
    assert not s.state.reply_precision.waiting


def test_async_replies_are_rounded_copies_and_sync_ones_reuse_one_buffer():
    """A sync reply of the chunk itself is rounded into the chunk's kept buffer (read in
    place over shared memory, as float32 values are); an async reply (a copy made for
    it) into fresh memory, which the next push cannot change."""
    s = Server(mode="async", num_workers=1, opt=kvstore.optimizer.SGD(learning_rate=1.0), init={A: vec(1, 2, 3)})
    _, r1 = s.send(0, ops.PUSHPULL, [A], [vec(1, 1, 1)], reply_precision=["bfloat16"])
    _, r2 = s.send(0, ops.PUSHPULL, [A], [vec(1, 1, 1)], reply_precision=["bfloat16"])
    first, second = only(r1).arrays[0], only(r2).arrays[0]
    assert first.tobytes() == bf16_of(vec(0, 1, 2)).tobytes() and second.tobytes() == bf16_of(vec(-1, 0, 1)).tobytes()
    sync = Server(num_workers=1, init={A: vec(1, 2, 3)})
    held = MemoryBudget(None)
    sync.state.reply_precision._budget = held      # (counted: the kept buffer is the server's memory)
    a = only(sync.send(0, ops.PULL, [A], reply_precision=["bfloat16"])[1]).arrays[0]
    b = only(sync.send(0, ops.PULL, [A], reply_precision=["bfloat16"])[1]).arrays[0]
    assert a is b and held.held == 3 * 2


def test_the_server_refuses_a_reply_precision_it_cannot_honour_before_anything_changes():
    s = Server(num_workers=1, init={A: vec(0, 0), ("d", 0): np.zeros(2, np.float64)})
    cases = [
        (ops.PULL, [A], [], {"reply_precision": ["int8"]}, "ProtocolError", "not one of"),
        (ops.PULL, [A], [], {"reply_precision": "bfloat16"}, "ProtocolError", "one entry"),
        (ops.PUSHPULL, [A], [vec(1, 1)], {"reply_precision": ["bfloat16", None]}, "ProtocolError", "one entry"),
        (ops.PUSH, [A], [vec(1, 1)], {"reply_precision": ["bfloat16"]}, "ProtocolError", "for pull and pushpull"),
        (ops.PUSHPULL, [("d", 0)], [np.ones(2)], {"reply_precision": ["float16"]}, "InvalidArgumentError",
         "key 'd' (chunk 0) holds float64: float16 replies are of float32 keys only"),
    ]
    for op, chunks, arrays, fields, kind, fragment in cases:
        rid, r = s.send(0, op, chunks, arrays, **fields)
        expect_error(only(r), peer(0), rid, kind, fragment)
    assert s.value(A).tolist() == [0, 0] and s.value(("d", 0)).tolist() == [0, 0]   # no refused push applied
    assert not s.state.reply_precision.waiting
    small = Server(num_workers=1, init={A: vec(0, 0)}, budget=MemoryBudget(8 + 3))   # the init's 8 bytes, 3 more
    rid, r = small.send(0, ops.PULL, [A], reply_precision=["bfloat16"])
    expect_error(only(r), peer(0), rid, "InvalidArgumentError", "bfloat16 replies of 1 chunk(s)", "budget")


def test_replies_to_reads_parked_on_a_round_are_rounded_when_another_push_answers_them():
    s = Server(num_workers=2, init={A: vec(0, 0)})
    rid0, r = s.send(0, ops.PUSHPULL, [A], [vec(1.00390625, 0)], reply_precision=["bfloat16"])
    assert r == []
    _, r = s.send(0, ops.PULL, [A], reply_precision=["float16"])      # waits for worker 0's round
    assert r == [] and s.state.reply_precision.waiting
    rid1, r = s.send(1, ops.PUSHPULL, [A], [vec(1.00390625, 70000)])
    replies = by_id(r)
    assert len(replies) == 3
    assert replies[rid0].arrays[0].tobytes() == bf16_of(vec(2.0078125, 70000)).tobytes()
    assert replies[rid1].arrays[0].dtype == np.float32
    pulled = [x for i, x in replies.items() if i not in (rid0, rid1)][0].arrays[0]
    assert pulled.dtype == np.float16 and pulled.tolist() == [2.0078125, float("inf")]
    assert not s.state.reply_precision.waiting


# -- real clusters: every transport the precision path takes --------------------------------
SIZES = {"small": 37, "mid": 3000, "big": 300_000}     # packed in one frame, own frames, a data channel / by reference


def exchange(kv):
    """pushpull and pull into bfloat16, float16 and float32 outputs of the same keys:
    the rounded replies must be torch's rounding of the float32 ones, bit for bit, and
    a read of bfloat16 outputs must receive about half a float32 read's bytes."""
    keys = list(SIZES)
    kv.init(keys, [np.linspace(-2, 2, n, dtype=np.float32) for n in SIZES.values()])
    if kv.type == "dist_async":
        kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.5))
    kv.set_multi_precision(True)
    g = torch.Generator().manual_seed(kv.rank)
    grads = [torch.randn(n, generator=g).to(torch.bfloat16) for n in SIZES.values()]
    results = []
    for name in ("bfloat16", "float16"):
        low = [torch.empty(n, dtype=TORCH[name]) for n in SIZES.values()]
        kv.pushpull(keys, grads, out=low)
        kv.barrier()                     # (async: every push applied before the float32 read)
        wide = [torch.empty(n) for n in SIZES.values()]
        before = kv.comm_stats()["bytes_received"]
        kv.pull(keys, out=wide)
        middle = kv.comm_stats()["bytes_received"]
        again = [torch.empty(n, dtype=TORCH[name]) for n in SIZES.values()]
        kv.pull(keys, out=again)
        after = kv.comm_stats()["bytes_received"]
        rounded = [w.to(TORCH[name]).view(torch.int16) for w in wide]
        results.append((name, all(torch.equal(a.view(torch.int16), r) for a, r in zip(again, rounded)),
                        (after - middle) / (middle - before)))
        if kv.type == "dist_sync":       # a pushpull's reply: this round's sum, rounded once
            results.append((name + "-pushpull", all(torch.equal(a.view(torch.int16), r)
                                                    for a, r in zip(low, rounded)), None))
        kv.barrier()
    return results


@pytest.mark.parametrize("transport, data_channel", [("tcp", False), ("tcp", True), ("ipc", False), ("shm", False)])
def test_every_transport_receives_torchs_rounding_in_half_the_bytes(make_cluster, transport, data_channel):
    for results in make_cluster(2, 2, transport=transport, data_channel=data_channel, chunk_bytes=1 << 18,
                                channel_bytes=1 << 16).run(exchange):
        assert [r[1] for r in results] == [True] * len(results), results
        for name, _, ratio in results:
            if ratio is not None:        # the arrays' bytes halve; each message's header stays
                assert 0.49 < ratio < 0.52, (name, ratio)


def test_async_servers_round_their_copies(make_cluster):
    for results in make_cluster(2, 1, transport="shm").run(exchange, store_type="dist_async"):
        assert [r[1] for r in results] == [True] * len(results), results


def test_outputs_it_cannot_receive_in_place_and_mixed_outputs_are_filled_exactly(make_cluster):
    """A non-contiguous bfloat16 output (a host buffer of patterns, copied as patterns),
    a key with bfloat16 and float32 outputs at once (float32 on the wire: one reply fills
    both), and a row-sparse key, refused by name for a bfloat16 output."""
    def work(kv):
        kv.init(["w", "e"], [np.linspace(-1, 1, 64, dtype=np.float32), kvstore.RowSparse.from_dense(np.ones((4, 2), np.float32))])
        kv.set_multi_precision(True)
        wide = torch.empty(64)
        kv.pull("w", out=wide)
        strided = torch.empty(64, 3, dtype=torch.bfloat16)[:, 1]
        mixed = [torch.empty(64, dtype=torch.bfloat16), torch.empty(64)]
        kv.pull("w", out=strided)
        kv.pull("w", out=mixed)
        sent = kv.comm_stats()["bytes_sent"]
        try:
            kv.row_sparse_pull("e", out=torch.empty(4, 2, dtype=torch.bfloat16), row_ids=[1])
            refusal = None
        except InvalidArgumentError as e:
            refusal = str(e)
        return (torch.equal(strided, wide.to(torch.bfloat16)), torch.equal(mixed[0], wide.to(torch.bfloat16)),
                torch.equal(mixed[1], wide), refusal, kv.comm_stats()["bytes_sent"] == sent)
    for strided, mixed_low, mixed_wide, refusal, nothing_sent in make_cluster(1, 1).run(work):
        assert strided and mixed_low and mixed_wide and nothing_sent
        assert refusal is not None and "row-sparse keys are pulled in their dtype" in refusal, refusal
