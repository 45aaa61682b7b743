"""The ids of the sparse benchmarks: popularity ranks from a Zipf law, spread over
a table by a bijection (benchmarks/harness/sparse_worker.py, benchmarks/dlrm). numpy only:
the peers' virtual environments (TorchRec's) import it too."""

from __future__ import annotations

import numpy as np

SCATTER = 2_654_435_761        # odd multiplier of the rank -> row bijection (Knuth)


def scatter(ranks: np.ndarray, rows: int) -> np.ndarray:
    """Popularity rank -> row: ``(rank * m + 7) mod rows`` with m the first odd number
    from SCATTER coprime to ``rows``, a bijection (hot rows land all over the table,
    on every server). Exact in int64 for ``rows`` < 2**31."""
    mult = SCATTER
    while np.gcd(mult, rows) != 1:
        mult += 2
    return (ranks * mult + 7) % rows


def zipf_ids(rng: np.random.Generator, n: int, exponent: float, rows: int) -> np.ndarray:
    """``n`` row ids whose popularity ranks follow a power law with ``exponent`` (a
    continuous Zipf law cut at ``rows``, sampled by inverting its CDF: no table of
    ``rows`` probabilities), spread over the table by :func:`scatter`."""
    u = rng.random(n)
    if abs(exponent - 1.0) < 1e-9:
        ranks = np.power(rows + 1.0, u)
    else:
        a = 1.0 - exponent
        ranks = np.power((np.power(rows + 1.0, a) - 1.0) * u + 1.0, 1.0 / a)
    return scatter(np.minimum(ranks.astype(np.int64) - 1, rows - 1), rows)
