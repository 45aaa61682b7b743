"""benchmarks.techniques at tiny size: the chosen ladder steps run as real
benchmarks.pushpull launches, interleaved, and their medians are written where
asked (a scratch directory by default, never the committed results). Never
asserts on speed."""

from __future__ import annotations

import json
import os
import sys

import pytest
from click.testing import CliRunner

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from benchmarks.techniques import run  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_two_steps_of_the_ladder_run_and_are_reported(tmp_path):
    result = CliRunner().invoke(run.main, ["--model", "tiny", "--steps", "3,4", "--rounds", "2", "--iters", "2",
                                           "--out-dir", str(tmp_path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "techniques.json").read_text())
    steps = {key.split(" | ")[0] for key in data["samples"]}
    assert steps == {run.LADDER[2][0], run.LADDER[3][0]}
    for key, s in data["samples"].items():
        assert len(s["times"]) == 2 * 2, key          # 2 rounds x 2 timed exchanges
    text = (tmp_path / "techniques.md").read_text()
    assert "| + pipelining = tcp today |" in text and "| ipc |" in text


def test_the_default_output_is_a_scratch_directory_and_bad_steps_are_refused():
    result = CliRunner().invoke(run.main, ["--steps", "0"])
    assert result.exit_code == 2 and "steps are 1-" in result.output
    result = CliRunner().invoke(run.main, ["--steps", "one"])
    assert result.exit_code == 2 and "not a list of step numbers" in result.output
    assert run.RECORD_DIR.endswith(os.path.join("benchmarks", "results", "techniques"))
