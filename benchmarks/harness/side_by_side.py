"""Variants of one measurement run side by side over several launches (benchmarks.
deterministic, benchmarks.mixed_precision): the order the variants run in, rotating
launch by launch so that none always runs first, and the summary of the launches'
rows per transport and variant.

A row is one variant's result in one launch: a dict with ``transport``, ``variant``
and ``samples_s`` (the launch's timed samples, seconds), plus what the experiment
measured besides.
"""

from __future__ import annotations

import statistics
from typing import Callable, Iterable


def rotated(variants: Iterable[str], launch: int) -> list[str]:
    """The variants in the order launch number ``launch`` runs them: the list rotated
    left by ``launch`` places."""
    names = list(variants)
    turn = launch % len(names)
    return names[turn:] + names[:turn]


def summary(rows: list[dict], variants: Iterable[str], extra: Callable[[list[dict]], dict],
            vs: str) -> list[dict]:
    """One line per transport (in the rows' order) and variant (in ``variants``' order):
    the median over launches of each launch's median (``median_ms``), the range of those
    medians (``min_ms``, ``max_ms``), ``launches``, then ``extra(the variant's rows)``'s
    fields, and last ``vs``: the median against the first variant's (1.0 for that one)."""
    out = []
    for name in dict.fromkeys(r["transport"] for r in rows):
        base = None
        for variant in variants:
            mine = [r for r in rows if r["transport"] == name and r["variant"] == variant]
            medians = [statistics.median(r["samples_s"]) * 1e3 for r in mine]
            line = {"transport": name, "variant": variant, "median_ms": statistics.median(medians),
                    "min_ms": min(medians), "max_ms": max(medians), "launches": len(mine), **extra(mine)}
            base = base or line
            line[vs] = line["median_ms"] / base["median_ms"]
            out.append(line)
    return out
