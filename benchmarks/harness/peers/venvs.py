"""Create and probe the peers' virtual environments (benchmarks/.venv-<name>)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/


@dataclass(frozen=True)
class Peer:
    name: str
    packages: tuple[str, ...]
    probe: str  # python code that prints the version line and exits 0 when usable

    @property
    def venv(self) -> str:
        return os.path.join(HERE, f".venv-{self.name}")

    @property
    def python(self) -> str:
        return os.path.join(self.venv, "bin", "python")


PEERS = {
    # MXNet 1.9.1 imports on Python 3.11 only with numpy < 1.24
    "mxnet": Peer("mxnet", ("mxnet==1.9.1", "numpy==1.23.5"),
                  "import mxnet, numpy; print('mxnet', mxnet.__version__, 'numpy', numpy.__version__)"),
    "ray": Peer("ray", ("ray", "numpy"),
                "import ray, numpy; print('ray', ray.__version__, 'numpy', numpy.__version__)"),
}


def probe(peer: Peer) -> tuple[bool, str]:
    """(usable, version line or the reason it is not)."""
    if not os.path.exists(peer.python):
        return False, (f"{peer.venv} does not exist; run `python -m benchmarks.pushpull "
                       f"--setup-peers` to create it")
    try:
        done = subprocess.run([peer.python, "-c", peer.probe], capture_output=True, text=True,
                              timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"{peer.python} cannot run: {e}"
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        return False, f"importing {peer.name} in {peer.venv} failed: {tail[0]}"
    return True, done.stdout.strip()


def setup(peer: Peer, python: str = "python3.11", log=print) -> tuple[bool, str]:
    """Create the venv (if needed) and pip-install the peer's packages.
    Returns (usable, version line or why not); never raises for install failures."""
    if not os.path.exists(peer.python):
        log(f"[setup] creating {peer.venv} with {python}")
        try:
            subprocess.run([python, "-m", "venv", peer.venv], check=True, capture_output=True,
                           text=True, timeout=300)
        except FileNotFoundError:
            # fall back to the interpreter running us (it is 3.11 on these machines)
            try:
                subprocess.run([sys.executable, "-m", "venv", peer.venv], check=True,
                               capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.SubprocessError) as e:
                return False, f"could not create {peer.venv}: {e}"
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or ""
            return False, f"could not create {peer.venv}: {e} {detail.strip()}"
    log(f"[setup] pip install {' '.join(peer.packages)} into {peer.venv}")
    try:
        done = subprocess.run([peer.python, "-m", "pip", "install", "-q",
                               "--disable-pip-version-check", *peer.packages],
                              capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"pip install {' '.join(peer.packages)} failed: {e}"
    if done.returncode != 0:
        lines = [ln for ln in (done.stderr or done.stdout).strip().splitlines() if ln.strip()]
        why = " | ".join(lines[-3:]) if lines else f"exit status {done.returncode}"
        return False, f"pip install {' '.join(peer.packages)} failed (is PyPI reachable?): {why}"
    return probe(peer)
