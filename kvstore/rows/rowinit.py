"""Seeded initial values for row-sparse tables, computed where the rows live.

A table of millions of rows is initialised on its servers, never on a worker:
``kv.init(key, RowInit("normal", 0.01, (R, D), seed=1))``. Each value is a pure
function of (seed, row, column), so a row has the same initial value whichever
server holds it, however many servers there are, and after a restore.

The generator is SplitMix64 (Steele et al., 2014) over the element's index:
fast in numpy, well mixed, and the same on every platform.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgumentError

__all__ = ["RowInit"]

KINDS = ("zeros", "normal", "uniform")
_BLOCK = 1 << 20                 # elements generated at a time (bounds temporary memory)
_TWO_53 = float(1 << 53)


@dataclass(frozen=True)
class RowInit:
    """``kind`` "zeros", "normal" (mean 0, standard deviation ``scale``, MXNet's
    ``Normal(sigma)``) or "uniform" (in [-scale, scale), MXNet's ``Uniform(scale)``)
    for a ``shape`` table of ``dtype``; ``seed`` picks the stream."""
    kind: str
    scale: float
    shape: tuple
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        if self.kind not in KINDS:
            raise InvalidArgumentError(f"RowInit: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not (np.isfinite(self.scale) and self.scale >= 0):
            raise InvalidArgumentError(f"RowInit: scale must be finite and >= 0, got {self.scale}")
        if len(self.shape) < 1 or min(self.shape) < 0:
            raise InvalidArgumentError(f"RowInit: shape must be (rows, ...) of sizes >= 0, got {self.shape}")
        if np.dtype(self.dtype).kind != "f":
            raise InvalidArgumentError(f"RowInit: dtype must be a float type, got {self.dtype}")
        if not 0 <= int(self.seed) < 1 << 63:
            raise InvalidArgumentError(f"RowInit: seed must be in [0, 2**63), got {self.seed}")

    def to_wire(self) -> dict:
        return {"kind": self.kind, "scale": float(self.scale), "shape": list(self.shape),
                "dtype": np.dtype(self.dtype).name, "seed": int(self.seed)}

    @classmethod
    def from_wire(cls, spec: dict) -> "RowInit":
        if not isinstance(spec, dict) or set(spec) != {"kind", "scale", "shape", "dtype", "seed"}:
            raise InvalidArgumentError(f"bad row initializer {spec!r}")
        return cls(spec["kind"], float(spec["scale"]), tuple(spec["shape"]), spec["dtype"], int(spec["seed"]))

    def fill(self, out: np.ndarray, rows) -> None:
        """Write the initial values of global ``rows`` (int64 ids, or a ``range`` of
        them) into ``out`` (shape ``(len(rows),) + shape[1:]``), a block of at most
        :data:`_BLOCK` elements at a time: temporary memory is bounded whatever the
        table's width. Raises InvalidArgumentError when ``out`` is not that shape."""
        width = math.prod(self.shape[1:])
        if out.size != len(rows) * width:
            raise InvalidArgumentError(f"RowInit of rows {self.shape[1:]}: cannot fill {out.size} values "
                                       f"for {len(rows)} rows")
        if self.kind == "zeros" or self.scale == 0:
            out[...] = 0
            return
        flat = out.reshape(len(rows), width)
        step_rows = max(1, _BLOCK // max(width, 1))
        step_cols = min(width, _BLOCK)
        for start in range(0, len(rows), step_rows):
            block = np.asarray(rows[start:start + step_rows], dtype=np.int64).astype(np.uint64)
            for col in range(0, width, step_cols):
                cols = np.arange(col, min(width, col + step_cols), dtype=np.uint64)
                index = (block[:, None] * np.uint64(width) + cols[None, :]) * np.uint64(2)
                flat[start:start + step_rows, col:col + step_cols] = self._values(index)

    def _values(self, index: np.ndarray) -> np.ndarray:
        u1 = _uniform(index, self.seed)
        if self.kind == "uniform":
            return (2.0 * u1 - 1.0) * self.scale
        u2 = _uniform(index + np.uint64(1), self.seed)
        return np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2) * self.scale   # Box-Muller


def _uniform(index: np.ndarray, seed: int) -> np.ndarray:
    """Uniform floats in [0, 1), one per element of ``index`` (uint64)."""
    return (_splitmix64(index ^ _splitmix64(np.uint64(seed))) >> np.uint64(11)).astype(np.float64) / _TWO_53


def _splitmix64(x):
    with np.errstate(over="ignore"):
        z = np.asarray(x, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))
