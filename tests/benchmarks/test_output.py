"""benchmarks/harness/output.py: every experiment writes to a new scratch directory
unless given --out-dir, and to benchmarks/results only with --record; no experiment
declares --out-dir itself."""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys

import pytest
from click.testing import CliRunner

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from benchmarks.harness.common import RESULTS  # noqa: E402
from benchmarks.harness.output import BothGiven, ResultsDir  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_the_default_is_a_new_scratch_directory_never_the_results(tmp_path, capsys):
    out = ResultsDir("probe", "probe")
    first, second = out.choose(None, False), out.choose(None, False)
    try:
        assert first != second and os.path.isdir(first) and os.path.basename(first).startswith("kvstore-probe-")
        assert not os.path.abspath(first).startswith(RESULTS)
        assert first in capsys.readouterr().err
    finally:
        os.rmdir(first)
        os.rmdir(second)
    assert out.choose(str(tmp_path / "a" / "b"), False) == str(tmp_path / "a" / "b")
    assert os.path.isdir(tmp_path / "a" / "b")
    assert ResultsDir("x", "sparse").record_dir == os.path.join(RESULTS, "sparse")
    assert ResultsDir("x", "").record_dir == RESULTS
    with pytest.raises(BothGiven, match="--out-dir .* and --record"):
        out.choose(str(tmp_path), True)


def test_argparse_and_click_commands_take_the_same_options(tmp_path):
    out = ResultsDir("probe", "probe")
    p = argparse.ArgumentParser(prog="probe")
    out.add_arguments(p)
    assert out.chosen(p, p.parse_args(["--out-dir", str(tmp_path)])) == str(tmp_path)
    with pytest.raises(SystemExit) as e:
        out.chosen(p, p.parse_args(["--out-dir", str(tmp_path), "--record"]))
    assert e.value.code == 2
    from benchmarks.staleness.run import main   # a real experiment's command
    result = CliRunner().invoke(main, ["--out-dir", str(tmp_path), "--record"])
    assert result.exit_code == 2 and "name two destinations" in result.output, result.output
    assert "--record" in CliRunner().invoke(main, ["--help"]).output


def test_no_experiment_declares_its_own_out_dir():
    """--out-dir with a default comes from ResultsDir alone (a default there would be a
    copy); a worker's required --out-dir (where its launcher collects it) is no result."""
    declared = re.compile(r"""(click\.option|add_argument)\(\s*["']--out-dir["'](?![^)]*required=True)""")
    found = [os.path.relpath(path, REPO)
             for path in glob.glob(os.path.join(REPO, "benchmarks", "**", "*.py"), recursive=True)
             if ".venv-" not in path and declared.search(open(path).read())]
    assert found == [os.path.join("benchmarks", "harness", "output.py")]
