"""benchmarks.mixed_precision at tiny size: both variants run as real jobs, every sum
verified by the workers; the bfloat16 exchange sends and receives half the gradient
bytes; the table and JSON are written where asked; ``--tree`` runs each checkout's own
benchmark. Never asserts on speed."""

from __future__ import annotations

import os
import sys

import pytest

from experiments import run_experiment

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from benchmarks.mixed_precision import run  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_both_variants_run_and_bfloat16_sends_half_the_bytes(tmp_path):
    data, text = run_experiment(run.main, ["--model", "tiny", "--launches", "2", "--iters", "2", "--warmup", "1",
                                           "--transports", "tcp"], tmp_path, "mixed_precision")
    assert [(x["transport"], x["variant"]) for x in data["summary"]] == [("tcp", "float32"), ("tcp", "bfloat16")]
    assert {(r["variant"], r["launch"]) for r in data["rows"]} == {
        (v, n) for v in ("float32", "bfloat16") for n in (0, 1)}
    wide, low = data["summary"]
    assert wide["vs_float32"] == 1.0
    assert 0.45 < low["sent_mb"] / wide["sent_mb"] < 0.55, (low, wide)   # (headers stay)
    assert 0.45 < low["received_mb"] / wide["received_mb"] < 0.55, (low, wide)   # replies rounded by the servers
    assert "| tcp | bfloat16 |" in text


def test_trees_run_each_checkouts_benchmark_and_name_it(tmp_path):
    data, text = run_experiment(run.main, ["--model", "tiny", "--launches", "1", "--iters", "1", "--warmup", "0",
                                           "--transports", "tcp", "--tree", f"this={REPO}"], tmp_path, "mixed_precision")
    assert [(x["transport"], x["variant"]) for x in data["summary"]] == [("tcp this", "float32"),
                                                                         ("tcp this", "bfloat16")]
    assert data["config"]["trees"] == {"this": REPO} and "| tcp this | bfloat16 |" in text
