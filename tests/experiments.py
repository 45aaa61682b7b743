"""Running an experiment of benchmarks/ (a click command) in the test's process, as
its command line would, and reading the result files it wrote."""

from __future__ import annotations

import json
import os
from typing import Any

import click
from click.testing import CliRunner


def run_experiment(main: click.Command, args: list[str], out_dir: str | os.PathLike[str],
                   name: str) -> tuple[Any, str]:
    """Invoke ``main`` with ``args`` and ``--out-dir out_dir`` (its exceptions raised
    as they are); fails the test unless it exits 0, its output in the message.
    Returns ``<name>.json`` (parsed) and ``<name>.md`` (the text) from ``out_dir``."""
    result = CliRunner().invoke(main, [*args, "--out-dir", str(out_dir)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    with open(os.path.join(out_dir, f"{name}.json")) as f:
        data = json.load(f)
    with open(os.path.join(out_dir, f"{name}.md")) as f:
        return data, f.read()
