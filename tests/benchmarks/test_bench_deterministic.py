"""benchmarks.deterministic at tiny size: both variants run as real jobs, every sum
verified by the workers; the table and JSON are written where asked. Never asserts
on speed."""

from __future__ import annotations

import os
import sys

import pytest
from click.testing import CliRunner

from experiments import run_experiment

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from benchmarks.deterministic import run  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_both_variants_run_and_are_reported_side_by_side(tmp_path):
    data, text = run_experiment(run.main, ["--model", "tiny", "--launches", "2", "--iters", "2", "--warmup", "1",
                                           "-w", "3", "-s", "2", "--transports", "tcp"], tmp_path, "deterministic")
    assert [(x["transport"], x["variant"]) for x in data["summary"]] == [("tcp", "arrival order"),
                                                                         ("tcp", "rank order")]
    assert {(r["variant"], r["launch"]) for r in data["rows"]} == {
        (v, n) for v in ("arrival order", "rank order") for n in (0, 1)}
    assert all(len(r["samples_s"]) == 2 and r["server_peak_rss_mb"] > 0 for r in data["rows"])
    assert data["summary"][0]["vs_arrival"] == 1.0
    assert "| tcp | rank order |" in text


def test_an_unknown_transport_is_refused():
    result = CliRunner().invoke(run.main, ["--transports", "carrier-pigeon"])
    assert result.exit_code == 2 and "unknown transport(s) carrier-pigeon" in result.output
