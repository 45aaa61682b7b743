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


def compress(config: dict, grad: np.ndarray, residual: np.ndarray | None) -> np.ndarray:
    """Compress a flat gradient; updates ``residual`` (same shape, float) in place.

    Vectorised without temporaries of the gradient's size beyond one bit per
    element per mask (masked in-place arithmetic, ``packbits``)."""
    kind, t = config["type"], config["threshold"]
    if kind == "fp16":
        return _to_fp16(grad)
    residual += grad
    if kind == "2bit":
        # bit 2j of the stream: element j sends +t; bit 2j+1: it sends -t. Packed
        # little-endian, a byte holds 4 codes (1: +t, 2: -t, 0: 0), element 0 lowest.
        bits = np.empty((grad.size, 2), bool)
        pos, neg = bits[:, 0], bits[:, 1]
        np.greater_equal(residual, t, out=pos)
        np.less_equal(residual, -t, out=neg)
        np.subtract(residual, t, out=residual, where=pos)
        np.add(residual, t, out=residual, where=neg)
        return np.packbits(bits.reshape(-1), bitorder="little")
    bits = residual > t
    np.subtract(residual, 1, out=residual, where=bits)
    np.add(residual, 1, out=residual, where=~bits)
    return np.packbits(bits)


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
    if kind == "2bit":
        bits = np.unpackbits(flat, count=2 * size, bitorder="little").view(np.int8).reshape(size, 2)
        codes = bits[:, 0] - bits[:, 1]     # +1, -1 or 0 (the unused code 3 reads as 0)
        return np.multiply(codes, np.asarray(t, dtype), dtype=dtype)
    out = np.empty(size, dtype)
    out.fill(-1)
    out[np.unpackbits(flat, count=size).view(bool)] = 1
    return out


class Compressor:
    """A sender's compression state: the config and one residual per (key, slot)."""

    def __init__(self, params):
        self.config = validate(params)
        self._residuals: dict = {}

    @property
    def active(self) -> bool:
        return self.config["type"] != "none"

    def compress(self, slot, grad: np.ndarray) -> np.ndarray:
        if grad.dtype.kind != "f":
            raise InvalidArgumentError(f"gradient compression needs floating-point values, got {grad.dtype.name}")
        residual = None
        if self.config["type"] != "fp16":
            residual = self._residuals.get(slot)
            if residual is None:
                residual = self._residuals[slot] = np.zeros(grad.size, grad.dtype)
        return compress(self.config, grad.reshape(-1), residual)

    def roundtrip(self, slot, grad: np.ndarray) -> np.ndarray:
        """What the receiver sees for ``grad`` (used by the local store)."""
        return decompress(self.config, self.compress(slot, grad), grad.size, grad.dtype).reshape(grad.shape)
