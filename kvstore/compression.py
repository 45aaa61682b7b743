"""Gradient compression with error feedback, as MXNet's set_gradient_compression.

- ``2bit`` (threshold t > 0): ``r += g``; an element with ``r >= t`` sends ``+t``
  (``r -= t``), one with ``r <= -t`` sends ``-t`` (``r += t``), others send 0.
  Four elements per byte.
- ``1bit`` (threshold t, default 0): ``r += g``; ``r > t`` sends ``+1`` (``r -= 1``),
  otherwise ``-1`` (``r += 1``). Eight elements per byte. (MXNet 1.x's 1-bit scheme.)
- ``fp16``: values travel as float16 (no residual).

The residual ``r`` stays on the sender and carries what was not sent to the next
push. Only worker -> server traffic is compressed; pulls are exact. The receiver
needs no state: each message names its compression. Pure numpy, no I/O.
"""

from __future__ import annotations

import sys

import numpy as np

from .errors import ConfigError, InvalidArgumentError

TYPES = ("none", "2bit", "1bit", "fp16")


def validate(params) -> dict:
    """Normalise ``{'type': ..., 'threshold': ...}``; raise ConfigError if invalid."""
    if not isinstance(params, dict):
        raise ConfigError(f"gradient compression takes a dict like {{'type': '2bit', 'threshold': 0.5}}, "
                          f"got {type(params).__name__}")
    unknown = set(params) - {"type", "threshold"}
    if unknown:
        raise ConfigError(f"unknown gradient compression parameter(s) {sorted(unknown)}; "
                          "valid: type, threshold")
    kind = params.get("type")
    if kind not in TYPES:
        raise ConfigError(f"unknown gradient compression type {kind!r}; valid types: {', '.join(TYPES)}")
    threshold = params.get("threshold", 0.5 if kind == "2bit" else 0.0)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not np.isfinite(threshold):
        raise ConfigError(f"gradient compression threshold must be a number, got {threshold!r}")
    if kind == "2bit" and threshold <= 0:
        raise ConfigError(f"2bit compression needs a threshold > 0, got {threshold}")
    return {"type": kind, "threshold": float(threshold)}


def payload_size(kind: str, size: int) -> int:
    """Bytes (2bit/1bit) or float16 elements (fp16) of a compressed chunk of ``size``."""
    return {"2bit": -(-size // 4), "1bit": -(-size // 8), "fp16": size}[kind]


# Elements per pass of the blocked kernels below: a block's arrays (the residual,
# the gradient and a few byte-per-element scratch arrays) stay in the L2 cache, so a
# chain of numpy passes costs about one trip through memory instead of one per pass.
# A multiple of 8, so that every block but the last fills whole payload bytes.
_BLOCK = 1 << 15


def _block_size(n: int) -> int:
    return min(_BLOCK, n) or 1


def _spans(n: int, block: int):
    """(start, length) of each block of ``n`` elements."""
    for lo in range(0, n, block):
        yield lo, min(block, n - lo)


def compress(config: dict, grad: np.ndarray, residual: np.ndarray | None) -> np.ndarray:
    """Compress a flat gradient; updates ``residual`` (same shape, float) in place.

    Branch-free numpy passes over cache-sized blocks (``_BLOCK``): masked arithmetic
    (``where=``) is ~25x slower per element on real, random-signed gradients."""
    kind, t = config["type"], config["threshold"]
    if kind == "fp16":
        return _to_fp16(grad)
    assert residual is not None, "2bit and 1bit compression keep a residual"
    t = _threshold(t, residual.dtype)
    if kind == "2bit":
        return _compress_2bit(grad, residual, t)
    return _compress_1bit(grad, residual, t)


def _compress_2bit(grad, residual, t):
    # Per element: d = (r >= t) - (r <= -t), r -= d t; the code is 1 (d = 1, sends +t),
    # 2 (d = -1, sends -t) or 0; four codes a byte, element 0 in the lowest two bits.
    n, block = grad.size, _block_size(grad.size)
    out = np.empty(payload_size("2bit", n), np.uint8)
    pos, neg, d = np.empty(block, bool), np.empty(block, bool), np.empty(block, np.int8)
    code, delta = np.zeros(block + 3, np.uint8), np.empty(block, residual.dtype)
    words = np.empty((block + 3) // 4, np.uint32)
    for lo, m in _spans(n, block):
        r, p, q, c = residual[lo:lo + m], pos[:m], neg[:m], code[:m]
        np.add(r, grad[lo:lo + m], out=r)
        np.greater_equal(r, t, out=p)
        np.less_equal(r, -t, out=q)
        np.subtract(p.view(np.int8), q.view(np.int8), out=d[:m])
        np.subtract(r, _times(d[:m], t, delta[:m]), out=r)
        np.add(p.view(np.uint8), q.view(np.uint8), out=c)
        np.add(c, q.view(np.uint8), out=c)
        nb = -(-m // 4)
        code[m:nb * 4] = 0
        # byte b of word w holds the code of element 4w+b: fold them into one byte
        x, w = code[:nb * 4].view(np.uint32), words[:nb]
        np.right_shift(x, 6, out=w)
        np.bitwise_or(w, x, out=w)
        np.bitwise_or(w, w >> 12, out=w)
        np.copyto(out[lo // 4:lo // 4 + nb], w, casting="unsafe")    # the low byte
    return out


def _compress_1bit(grad, residual, t):
    # Per element: bit = r > t, r += 1 - 2 bit; bits big-endian in a byte.
    n, block = grad.size, _block_size(grad.size)
    out = np.empty(payload_size("1bit", n), np.uint8)
    bits, d, delta = np.empty(block, bool), np.empty(block, np.int8), np.empty(block, residual.dtype)
    for lo, m in _spans(n, block):
        r, b = residual[lo:lo + m], bits[:m]
        np.add(r, grad[lo:lo + m], out=r)
        np.greater(r, t, out=b)
        _one_minus_twice(b, d[:m])
        np.copyto(delta[:m], d[:m])
        np.add(r, delta[:m], out=r)
        out[lo // 8:lo // 8 + -(-m // 8)] = np.packbits(b)
    return out


def _one_minus_twice(bits, out):
    """``1 - 2 bits`` as int8 (+1 for a clear bit, -1 for a set one)."""
    np.multiply(bits.view(np.int8), -2, out=out)
    return np.add(out, 1, out=out)


def _times(d: np.ndarray, scale, out: np.ndarray) -> np.ndarray:
    """``d * scale`` for int8 ``d`` in {-1, 0, 1}, in ``out``'s dtype (exact)."""
    np.copyto(out, d)
    return np.multiply(out, scale, out=out)


def _threshold(t: float, dtype) -> np.ndarray:
    """``t`` in the values' dtype; InvalidArgumentError if it does not fit (float16
    tops out at 65504): every element would compare against inf."""
    with np.errstate(over="ignore"):
        scale = np.asarray(t, dtype)
    if not np.isfinite(scale):
        raise InvalidArgumentError(f"gradient compression threshold {t} does not fit "
                                   f"{np.dtype(dtype).name} values")
    return scale


def _to_fp16(a: np.ndarray) -> np.ndarray:
    """``a.astype(float16)``. numpy's cast has no vector path on many x86 CPUs
    (about 1 GB/s here); torch's is ~10x faster and rounds identically (IEEE
    round-to-nearest-even), so use it when the process has already imported torch
    (training scripts do; we never import it ourselves)."""
    torch = sys.modules.get("torch")
    if torch is None or not a.flags.c_contiguous or a.dtype != np.float32:   # (f64: one rounding)
        return a.astype(np.float16)
    out = np.empty(a.shape, np.float16)
    torch.from_numpy(out).copy_(torch.from_numpy(a))
    return out


def decompress(config: dict, payload: np.ndarray, size: int, dtype: np.dtype) -> np.ndarray:
    """The values a compressed chunk stands for. Raises InvalidArgumentError when the
    payload does not have the expected dtype and length."""
    kind, t = config["type"], config["threshold"]
    expected = (np.float16 if kind == "fp16" else np.uint8, payload_size(kind, size))
    if payload.dtype != expected[0] or payload.size != expected[1]:
        raise InvalidArgumentError(f"{kind} payload of {payload.size} x {payload.dtype.name} for a chunk "
                                   f"of {size}: expected {expected[1]} x {np.dtype(expected[0]).name}")
    flat = payload.reshape(-1)
    if kind == "fp16":
        return flat.astype(dtype)
    t = _threshold(t, dtype)
    return (_decode_2bit if kind == "2bit" else _decode_1bit)(flat, t, np.empty(size, dtype))


def _decode_2bit(flat, t, out):
    size = out.size
    block = _block_size(size)
    d, words = np.empty(block, np.int8), np.empty(-(-block // 4), np.uint32)
    for lo, m in _spans(size, block):
        nb = -(-m // 4)
        # spread each byte's four 2-bit codes over the four bytes of a word
        w = words[:nb]
        np.copyto(w, flat[lo // 4:lo // 4 + nb])
        np.bitwise_or(w, w << 6, out=w)
        np.bitwise_or(w, w << 12, out=w)
        np.bitwise_and(w, 0x03030303, out=w)
        c = w.view(np.uint8)[:m]
        np.bitwise_and(c, 1, out=d[:m].view(np.uint8))           # 1: +t
        np.subtract(d[:m], (c >> 1).view(np.int8), out=d[:m])   # 2: -t, 3: nothing (unused)
        _times(d[:m], t, out[lo:lo + m])
    return out


def _decode_1bit(flat, t, out):
    size = out.size
    block = _block_size(size)
    d = np.empty(block, np.int8)
    for lo, m in _spans(size, block):
        bits = np.unpackbits(flat[lo // 8:lo // 8 + -(-m // 8)], count=m).view(bool)
        _one_minus_twice(bits, d[:m])
        np.negative(d[:m], out=d[:m])                            # set: +1, clear: -1
        np.copyto(out[lo:lo + m], d[:m])
    return out


class Compressor:
    """A sender's compression state: the config and one residual per chunk (its wire id: key, index)."""

    def __init__(self, params):
        self.config = validate(params)
        self._residuals: dict = {}

    @property
    def active(self) -> bool:
        return self.config["type"] != "none"

    def compress(self, chunk_id, grad: np.ndarray) -> np.ndarray:
        if grad.dtype.kind != "f":
            raise InvalidArgumentError(f"gradient compression needs floating-point values, got {grad.dtype.name}")
        residual = None
        if self.config["type"] != "fp16":
            residual = self._residuals.get(chunk_id)
            if residual is None:
                residual = self._residuals[chunk_id] = np.zeros(grad.size, grad.dtype)
        return compress(self.config, grad.reshape(-1), residual)

    def check(self, infos, what: str) -> None:
        """Before the first message of a call is sent: every key (a KeyInfo) can be
        compressed (else one server would get its part of the call and another not)."""
        for info in infos:
            if info.dtype.kind != "f":
                raise InvalidArgumentError(
                    f"{what}: key {info.key!r} holds {info.dtype.name}: gradient compression "
                    f"({self.config['type']}) applies to floating-point values only; nothing was sent")
            if self.config["type"] != "fp16":
                try:
                    _threshold(self.config["threshold"], info.dtype)
                except InvalidArgumentError as e:
                    raise InvalidArgumentError(f"{what}: key {info.key!r}: {e}; nothing was sent") from None

    def roundtrip(self, chunk_id, grad: np.ndarray) -> np.ndarray:
        """What the receiver sees for ``grad`` (used by the local store)."""
        return decompress(self.config, self.compress(chunk_id, grad), grad.size, grad.dtype).reshape(grad.shape)
