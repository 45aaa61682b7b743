"""benchmarks.timeline_overhead at tiny size: the timeline off and on, real jobs,
interleaved; the JSON holds every launch and the events the 'on' launches wrote.
Never asserts on speed."""

from __future__ import annotations

import json
import os
import sys

import pytest
from click.testing import CliRunner

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from benchmarks.timeline_overhead import run  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_off_and_on_are_timed_side_by_side(tmp_path):
    out = tmp_path / "timeline_overhead.json"
    result = CliRunner().invoke(run.main, ["--calls", "40", "--block", "10", "--launches", "2",
                                           "--out-dir", str(tmp_path)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert set(data["seconds_per_call_wall_cpu"]) == {"off", "on"}
    assert all(len(v) == 2 and all(wall > 0 and cpu > 0 for wall, cpu in v)
               for v in data["seconds_per_call_wall_cpu"].values())
    assert data["events_last_on_launch"] > 40        # the 'on' launch wrote its events
    assert data["off_check_ns"] >= 0
    assert "off-check" in result.output and str(out) in result.output


def test_the_default_output_is_not_the_committed_file():
    assert run.RECORD.endswith(os.path.join("benchmarks", "results", "timeline_overhead.json"))
    assert "--record" in CliRunner().invoke(run.main, ["--help"]).output
