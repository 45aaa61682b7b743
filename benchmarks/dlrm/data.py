"""The DLRM benchmark's data and initial values: numpy only, seeded, the same in
both contenders' environments (ours: the system's Python; TorchRec: its venv).

A step's global batch is the W workers' local batches; worker ``r`` at step ``i``
draws its own from ``default_rng((seed, r, i))``:

- ``dense``: (B, n_dense) float32, standard normal;
- ``ids``: (T, B, L) int64, table ``t``'s ids drawn from a Zipf law over its rows
  (the law and the spreading of ``benchmarks/harness/sparse_worker.py``: the hot rows
  land all over the table);
- ``labels``: (B,) float32, 1 where a fixed random teacher's logit is > 0. The
  teacher is ``dense @ a`` plus, per table, the mean over the bag of a value in
  [-1, 1) hashed from (table, id): a function of the ids the model can learn
  through its tables (hot ids quickly), so the loss falls.

Initial values: the tables are one id space (table ``t``'s row ``i`` is row
``offset[t] + i``) filled with exactly what ``kvstore.RowInit("uniform", scale,
(rows, dim), seed=seed)`` computes on our servers (SplitMix64 of (seed, row,
column); tests/benchmarks/test_bench_dlrm.py checks they agree), so TorchRec's shards get the
same numbers; the MLPs from ``default_rng(seed)`` (``model.init_dense``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from benchmarks.harness.zipf import zipf_ids

_TWO_53 = float(1 << 53)
TEACHER_SEED = 20261128


@dataclass(frozen=True)
class Config:
    tables: tuple[int, ...]          # rows of each table
    dim: int = 32
    batch: int = 512                 # per worker
    pooling: int = 8                 # ids per bag (every bag the same: L)
    n_dense: int = 13
    zipf: float = 1.05
    seed: int = 0
    init_scale: float = 0.05         # tables: uniform in [-scale, scale)

    @property
    def offsets(self) -> np.ndarray:
        """First row of each table in the one id space (and the total at the end)."""
        return np.concatenate([[0], np.cumsum(self.tables)]).astype(np.int64)

    @property
    def total_rows(self) -> int:
        return int(sum(self.tables))

    def to_dict(self) -> dict:
        return {"tables": list(self.tables), "dim": self.dim, "batch": self.batch, "pooling": self.pooling,
                "n_dense": self.n_dense, "zipf": self.zipf, "seed": self.seed, "init_scale": self.init_scale}


def parse_tables(text: str) -> tuple[int, ...]:
    """``"8x100000"`` (8 tables of 100,000 rows) or ``"100000,50000,..."``, or a
    comma list of either."""
    rows: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        count, sep, size = part.partition("x")
        rows += [int(size)] * int(count) if sep else [int(count)]
    if not rows or min(rows) < 1:
        raise ValueError(f"tables: expected e.g. 8x100000 or 1000,2000, got {text!r}")
    return tuple(rows)


def _splitmix64(x):
    with np.errstate(over="ignore"):
        z = np.asarray(x, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def uniform01(index: np.ndarray, seed: int) -> np.ndarray:
    """kvstore.rows.rowinit's stream: one float64 in [0, 1) per uint64 index."""
    return (_splitmix64(index ^ _splitmix64(np.uint64(seed))) >> np.uint64(11)).astype(np.float64) / _TWO_53


def init_rows(rows: np.ndarray, dim: int, scale: float, seed: int) -> np.ndarray:
    """Initial values of global ``rows`` (of the one id space), float32 (len(rows), dim):
    what RowInit("uniform", scale, (R, dim), "float32", seed).fill computes."""
    index = (np.asarray(rows, dtype=np.uint64)[:, None] * np.uint64(dim)
             + np.arange(dim, dtype=np.uint64)[None, :]) * np.uint64(2)
    return ((2.0 * uniform01(index, seed) - 1.0) * scale).astype(np.float32)


def teacher_value(table: int, ids: np.ndarray) -> np.ndarray:
    """The teacher's value of ``ids`` of ``table``: in [-1, 1)."""
    index = (np.asarray(ids, dtype=np.uint64) << np.uint64(8)) | np.uint64(table)
    return 2.0 * uniform01(index, TEACHER_SEED) - 1.0


@dataclass
class Batch:
    dense: np.ndarray     # (B, n_dense) float32
    ids: np.ndarray       # (T, B, L) int64, each table's own row ids
    labels: np.ndarray    # (B,) float32


def batch(cfg: Config, rank: int, step: int) -> Batch:
    rng = np.random.default_rng((cfg.seed, rank, step))
    dense = rng.standard_normal((cfg.batch, cfg.n_dense)).astype(np.float32)
    ids = np.stack([zipf_ids(rng, cfg.batch * cfg.pooling, cfg.zipf, rows).reshape(cfg.batch, cfg.pooling)
                    for rows in cfg.tables])
    a = np.random.default_rng(TEACHER_SEED).standard_normal(cfg.n_dense) / np.sqrt(cfg.n_dense)
    logit = dense.astype(np.float64) @ a
    for t in range(len(cfg.tables)):
        logit += teacher_value(t, ids[t]).mean(axis=1) / np.sqrt(len(cfg.tables))
    return Batch(dense, ids.astype(np.int64), (logit > 0).astype(np.float32))
