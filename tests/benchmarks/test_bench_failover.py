"""benchmarks.failover at tiny size: a replicated job whose server is killed at a
random moment of a step ends with exit 0 and the reference run's weights, and its
pause is measured from the worker's own times; the table and JSON are written
where asked. Never asserts on speed."""

from __future__ import annotations

import os
import sys

import pytest

from experiments import run_experiment

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from benchmarks.failover import run  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_a_killed_server_is_measured_from_the_signal_to_the_next_round(tmp_path):
    [row], text = run_experiment(run.main, ["--runs", "1", "--steps", "9", "--keys", "2", "--size", "1024",
                                            "--variant", "SIGKILL"], tmp_path, "failover")
    assert (row["variant"], row["exit"], row["steps"]) == ("SIGKILL", 0, 9), row
    assert 3 <= row["at_step"] < 6 and 0 < row["pause_s"] < 60 and row["median_step_ms"] > 0
    assert row["same_weights"], "a failover with deterministic sums must leave the uninterrupted weights"
    assert "| SIGKILL | 1 | 1 | 1 |" in text
