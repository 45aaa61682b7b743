"""Every command-line entry point accepts -h and --help (exit 0, usage text)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = ["kvstore.server", "tracker.scheduler", "tracker.local", "tracker.ssh", "tracker.mpi",
           "tracker.slurm", "kvstore.tools.parse_log", "benchmarks.chaos", "benchmarks.gpu_check",
           "benchmarks.host_reduce"]


@pytest.mark.parametrize("flag", ["-h", "--help"])
@pytest.mark.parametrize("module", MODULES)
def test_help(module, flag):
    p = subprocess.run([sys.executable, "-m", module, flag], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert "usage" in p.stdout.lower() or "python -m" in p.stdout, p.stdout


def test_env_configured_entry_points_refuse_arguments():
    for module in ("kvstore.server", "tracker.scheduler"):
        p = subprocess.run([sys.executable, "-m", module, "--port", "1"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 2 and "takes no arguments" in p.stderr, (module, p.stderr)
