"""Every command-line entry point accepts -h and --help (exit 0, usage text)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


LAUNCHERS = ["tracker.local", "tracker.ssh", "tracker.mpi", "tracker.slurm"]


def documented_core_options() -> list[str]:
    """The options docs/launching.md says every launcher takes."""
    import re
    text = open(os.path.join(ROOT, "docs", "launching.md")).read()
    sentence = text[text.index("All of them take the same core options"):]
    sentence = sentence[:sentence.index(" and `-h/--help`")]
    return [name for item in re.findall(r"`([^`]+)`", sentence)
            for name in item.split()[0].split("/") if name.startswith("-")]


@pytest.mark.parametrize("module", LAUNCHERS)
def test_every_launcher_takes_the_core_options_the_docs_list(module):
    options = documented_core_options()
    assert {"--worker-env", "--log-dir", "--host-ip", "--dry-run"} <= set(options), options
    p = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    missing = [o for o in options if o not in p.stdout.split()
               and not any(w.startswith(o + ",") or w.startswith(o + "=") for w in p.stdout.split())]
    assert not missing, f"{module} --help lacks {missing}"


@pytest.mark.parametrize("module", LAUNCHERS)
@pytest.mark.parametrize("args, message", [
    (["--nproc-per-node", "2", "python", "x.py"], "no such option: --nproc-per-node; did you mean -n / --num-workers?"),
    (["--num-worker", "2", "python", "x.py"], "no such option: --num-worker; did you mean -n / --num-workers?"),
    (["-np", "2", "python", "x.py"], "no such option: -np; did you mean -n / --num-workers?"),
    (["--frobnicate", "-n", "2", "python", "x.py"], "no such option: --frobnicate (COMMAND cannot start with '-')"),
    (["-n", "2", "--dry-run", "--frobnicate", "python", "x.py"], "no such option: --frobnicate"),
])
def test_an_unknown_option_is_named_not_taken_for_a_missing_one(module, args, message):
    """An option the launcher does not know (torchrun's --nproc-per-node) is named,
    with the one meant where that is clear, before -n is found missing."""
    p = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2, p.stderr
    assert message in p.stderr and "Missing option" not in p.stderr, p.stderr
