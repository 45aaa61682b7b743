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
    """Compress a flat gradient; updates ``residual`` (same shape, float) in place."""
    kind, t = config["type"], config["threshold"]
    if kind == "fp16":
        return grad.astype(np.float16)
    residual += grad
    if kind == "2bit":
        pos, neg = residual >= t, residual <= -t
        residual[pos] -= t
        residual[neg] += t
        codes = pos.astype(np.uint8) | (neg.astype(np.uint8) << 1)   # 1: +t, 2: -t, 0: 0
        padded = np.zeros(payload_size(kind, grad.size) * 4, np.uint8)
        padded[:grad.size] = codes
        quads = padded.reshape(-1, 4)
        return quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)
    bits = residual > t
    residual -= np.where(bits, 1, -1).astype(residual.dtype)
    return np.packbits(bits)


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
        codes = np.stack([(flat >> s) & 3 for s in (0, 2, 4, 6)], axis=1).reshape(-1)[:size]
        table = np.array([0, t, -t, 0], dtype=dtype)
        return table[codes]
    return np.where(np.unpackbits(flat, count=size).astype(bool), 1, -1).astype(dtype)


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
