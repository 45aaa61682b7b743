"""Gradient compression: MXNet's exact 2bit/1bit semantics with error feedback,
fp16, the wire path to real servers, and the 'local' store as the oracle."""

import numpy as np
import pytest

import kvstore
from kvstore import compression, optimizer as opt
from kvstore.errors import ConfigError, InvalidArgumentError


def reference_2bit(grads, t):
    """Element by element, as MXNet's quantize_2bit kernel."""
    residual, sent = np.zeros_like(grads[0], dtype=np.float64), []
    for g in grads:
        out = np.zeros_like(residual)
        for i in range(len(g)):
            residual[i] += g[i]
            if residual[i] >= t:
                out[i], residual[i] = t, residual[i] - t
            elif residual[i] <= -t:
                out[i], residual[i] = -t, residual[i] + t
        sent.append(out)
    return sent


def reference_1bit(grads, t):
    residual, sent = np.zeros_like(grads[0], dtype=np.float64), []
    for g in grads:
        out = np.empty_like(residual)
        for i in range(len(g)):
            residual[i] += g[i]
            if residual[i] > t:
                out[i], residual[i] = 1, residual[i] - 1
            else:
                out[i], residual[i] = -1, residual[i] + 1
        sent.append(out)
    return sent


@pytest.mark.parametrize("kind, reference, t", [("2bit", reference_2bit, 0.5), ("2bit", reference_2bit, 0.05),
                                                ("1bit", reference_1bit, 0.0), ("1bit", reference_1bit, 0.3)])
@pytest.mark.parametrize("size", [1, 3, 8, 17, 1000])
def test_quantisation_matches_mxnet_element_by_element(kind, reference, t, size):
    rng = np.random.default_rng(size)
    grads = [rng.standard_normal(size).astype(np.float64) * 0.3 for _ in range(5)]
    c = compression.Compressor({"type": kind, "threshold": t})
    for g, want in zip(grads, reference(grads, t)):
        payload = c.compress("k", g)
        assert payload.dtype == np.uint8 and payload.size == compression.payload_size(kind, size)
        np.testing.assert_array_equal(compression.decompress(c.config, payload, size, np.float64), want)


def test_wire_layout_is_pinned():
    """The packed bytes (docs/protocol.md): 2bit codes little-endian in a byte
    (element 0 in bits 0-1; 1: +t, 2: -t, 0: nothing), 1bit bits big-endian
    (element 0 in bit 7; set: +1). A decoder must read both the same way."""
    c2 = compression.Compressor({"type": "2bit", "threshold": 0.5})
    payload = c2.compress("k", np.array([1.0, -1.0, 0.0, 0.7, -0.6], np.float32))
    assert payload.tolist() == [0b01_00_10_01, 0b10]
    assert compression.decompress(c2.config, np.array([0b11_10_01_00], np.uint8), 4,
                                  np.dtype(np.float32)).tolist() == [0, 0.5, -0.5, 0]   # 3 reads as 0
    c1 = compression.Compressor({"type": "1bit", "threshold": 0.0})
    payload = c1.compress("k", np.array([1, -1, 1, 1, -1, -1, -1, -1, 2], np.float32))
    assert payload.tolist() == [0b1011_0000, 0b1000_0000]


def masked_oracle(kind, grad, residual, t):
    """The obvious vectorised form (masked arithmetic, one full pass each): what the
    blocked kernels must reproduce bit for bit, residual included."""
    residual += grad
    if kind == "2bit":
        pos, neg = residual >= t, residual <= -t
        np.subtract(residual, t, out=residual, where=pos)
        np.add(residual, t, out=residual, where=neg)
        return np.packbits(np.stack([pos, neg], axis=1).reshape(-1), bitorder="little")
    bits = residual > t
    np.subtract(residual, 1, out=residual, where=bits)
    np.add(residual, 1, out=residual, where=~bits)
    return np.packbits(bits)


def decoded_oracle(kind, payload, size, t, dtype):
    if kind == "2bit":
        bits = np.unpackbits(payload, count=2 * size, bitorder="little").reshape(size, 2)
        code = bits[:, 0] + 2 * bits[:, 1]
        return np.where(code == 1, t, np.where(code == 2, -t, 0)).astype(dtype)
    return np.where(np.unpackbits(payload, count=size), 1, -1).astype(dtype)


@pytest.mark.parametrize("kind, t", [("2bit", 0.5), ("2bit", 0.03), ("1bit", 0.0), ("1bit", 0.25)])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_blocked_kernels_match_the_masked_form_across_block_edges(monkeypatch, kind, t, dtype):
    """Small blocks, so every size below crosses several block edges and ends in a
    partial block and a partial byte; specials (nan, +-inf, -0, +-t exactly) included."""
    monkeypatch.setattr(compression, "_BLOCK", 24)
    rng = np.random.default_rng(7)
    specials = np.array([np.nan, np.inf, -np.inf, -0.0, t, -t, 0.0], dtype)
    config = compression.validate({"type": kind, "threshold": t})
    for size in (0, 1, 5, 23, 24, 25, 99, 1000):
        with np.errstate(invalid="ignore"):
            grads = [rng.standard_normal(size).astype(dtype) * 0.4 for _ in range(4)]
            grads[1][:len(specials)] = specials[:size]
            residual, oracle_residual = np.zeros(size, dtype), np.zeros(size, dtype)
            for g in grads:
                got = compression.compress(config, g, residual)
                want = masked_oracle(kind, g, oracle_residual, np.asarray(t, dtype))
                np.testing.assert_array_equal(got, want)
                np.testing.assert_array_equal(residual, oracle_residual)     # nan == nan here
                decoded = compression.decompress(config, got, size, np.dtype(dtype))
                assert decoded.dtype == dtype
                np.testing.assert_array_equal(decoded, decoded_oracle(kind, got, size, t, dtype))
        # arbitrary bytes decode too (the unused 2bit code 3 reads as 0)
        noise = rng.integers(0, 256, compression.payload_size(kind, size), dtype=np.uint8)
        np.testing.assert_array_equal(compression.decompress(config, noise, size, np.dtype(dtype)),
                                      decoded_oracle(kind, noise, size, t, dtype))


@pytest.mark.parametrize("kind", ["2bit", "1bit"])
def test_a_threshold_the_dtype_cannot_hold_is_rejected(kind):
    config = compression.validate({"type": kind, "threshold": 1e5})   # float16 max: 65504
    with pytest.raises(InvalidArgumentError, match="threshold 100000.0 does not fit float16"):
        compression.Compressor(config).compress("k", np.ones(4, np.float16))
    with pytest.raises(InvalidArgumentError, match="does not fit float16"):
        compression.decompress(config, np.zeros(1, np.uint8), 4, np.dtype(np.float16))
    compression.Compressor(config).compress("k", np.ones(4, np.float32))   # float32 holds it


def test_fp16_cast_through_torch_rounds_exactly_like_numpy():
    pytest.importorskip("torch")   # imported: compression's fp16 cast then goes through it
    rng = np.random.default_rng(3)
    g = np.concatenate([rng.standard_normal(50_000) * 1e4, rng.standard_normal(50_000) * 1e-6,
                        [np.nan, np.inf, -np.inf, 65504, 65519.99, 65520, -0.0, 2.0 ** -25,
                         2.0 ** -24 * 1.5, 1 + 2.0 ** -11]]).astype(np.float32)
    with np.errstate(over="ignore"):
        want = g.astype(np.float16)
        got = compression.compress({"type": "fp16", "threshold": 0.0}, g, None)
    assert got.dtype == np.float16 and np.array_equal(got.view(np.uint16), want.view(np.uint16))


def test_fp16_is_a_cast_without_residual():
    c = compression.Compressor({"type": "fp16"})
    g = np.array([1.0, 1e-4, 65504.0, -3.14159], np.float32)
    payload = c.compress("k", g)
    assert payload.dtype == np.float16
    np.testing.assert_array_equal(compression.decompress(c.config, payload, 4, np.float32),
                                  g.astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("params, match", [
    ({"type": "3bit"}, "valid types"), ({"type": "2bit", "threshold": 0}, "> 0"),
    ({"type": "2bit", "threshold": "x"}, "number"), ({"type": "2bit", "thresh": 1}, "unknown"),
    ("2bit", "dict"),
])
def test_bad_parameters(params, match):
    with pytest.raises(ConfigError, match=match):
        compression.validate(params)
    with kvstore.create("local") as kv, pytest.raises(ConfigError, match=match):
        kv.set_gradient_compression(params)


def test_malformed_payload_is_rejected():
    config = compression.validate({"type": "2bit", "threshold": 0.5})
    with pytest.raises(InvalidArgumentError, match="expected 3 x uint8"):
        compression.decompress(config, np.zeros(2, np.uint8), 10, np.float32)
    with pytest.raises(InvalidArgumentError):
        compression.decompress(config, np.zeros(3, np.float32), 10, np.float32)


def residual_sequence(kv, workers):
    """Every worker pushes 0.4, 0.1, 0.2, 0.3 under SGD(lr=1): returns the moves."""
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    kv.init("w", np.zeros(6, np.float32))
    kv.set_optimizer(opt.SGD(learning_rate=1.0))
    out, moves, last = np.empty(6, np.float32), [], 0.0
    for g in (0.4, 0.1, 0.2, 0.3):
        kv.push("w", [np.full(6, g, np.float32)] * (workers if kv.type == "local" else 1))
        kv.pull("w", out=out)
        assert np.all(out == out[0])
        moves.append(float(last - out[0]))
        last = out[0]
    return moves


def test_exact_residual_sequence_in_dist_sync(make_cluster):
    workers, t = 3, 0.5
    moves = make_cluster(workers, 2, chunk_bytes=8).run(lambda kv: residual_sequence(kv, workers))
    assert moves == [[0.0, workers * t, 0.0, workers * t]] * workers


def test_exact_residual_sequence_in_local_store():
    with kvstore.create("local") as kv:
        assert residual_sequence(kv, 3) == [0.0, 1.5, 0.0, 1.5]


@pytest.mark.parametrize("kind", ["2bit", "1bit", "fp16"])
def test_dist_sync_with_compression_equals_the_local_store(make_cluster, kind):
    workers, steps, shape = 2, 3, (3, 700)
    params = {"type": kind, "threshold": 0.1 if kind == "2bit" else 0.0}
    grads = [[np.random.default_rng(10 * r + s).standard_normal(shape).astype(np.float32)
              for s in range(steps)] for r in range(workers)]

    def job(kv):
        kv.set_gradient_compression(params)
        kv.init(0, np.zeros(shape, np.float32))
        before = kv.comm_stats()["bytes_sent"]
        for s in range(steps):
            kv.push(0, grads[kv.rank][s])
        sent = kv.comm_stats()["bytes_sent"] - before
        out = np.empty(shape, np.float32)
        kv.pull(0, out=out)
        return out, sent

    results = make_cluster(workers, 2, chunk_bytes=1024).run(job)
    with kvstore.create("local") as oracle:
        oracle.set_gradient_compression(params)
        oracle.init(0, np.zeros(shape, np.float32))
        for s in range(steps):
            oracle.push(0, [grads[r][s] for r in range(workers)])
        want = np.empty(shape, np.float32)
        oracle.pull(0, out=want)
    raw = steps * 4 * np.prod(shape)
    for got, sent in results:
        np.testing.assert_array_equal(got, want)
        assert sent < raw * {"2bit": 0.25, "1bit": 0.2, "fp16": 0.6}[kind]   # fewer bytes on the wire
