"""Child processes: spawn argv lists (never shell strings), prefix their output
per rank, and tear them down gracefully, then by force."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import IO


@dataclass(frozen=True)
class ProcSpec:
    """One process to start: its role and rank, argv and extra environment."""
    role: str
    rank: int
    argv: tuple[str, ...]
    env: dict = field(default_factory=dict)
    cwd: str | None = None

    @property
    def label(self) -> str:
        return f"{self.role} {self.rank}"


class Child:
    """A started process in its own session (so teardown reaches its children too)."""

    _out_lock = threading.Lock()

    def __init__(self, spec: ProcSpec, out: IO[str] | None = None):
        self.spec = spec
        self._out = out if out is not None else sys.stdout
        self.popen = subprocess.Popen(
            list(spec.argv), env={**os.environ, **spec.env}, cwd=spec.cwd,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True)
        self._pump = threading.Thread(target=self._copy_output, daemon=True,
                                      name=f"output-{spec.role}-{spec.rank}")
        self._pump.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def _copy_output(self) -> None:
        prefix = f"[{self.spec.role}:{self.spec.rank}] "
        for raw in iter(self.popen.stdout.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            with self._out_lock:
                self._out.write(prefix + line + "\n")
                self._out.flush()
        self.popen.stdout.close()

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child's whole process group, if it still exists."""
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def finish_output(self, timeout: float = 2.0) -> None:
        self._pump.join(timeout)


def terminate_all(children: list[Child], grace: float) -> None:
    """SIGTERM every live child's process group, wait up to ``grace`` seconds,
    then SIGKILL whatever remains (including grandchildren)."""
    for child in children:
        child.signal(signal.SIGTERM)
    for child in children:
        try:
            child.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    for child in children:
        # the group may outlive its leader (a grandchild): SIGKILL it regardless
        child.signal(signal.SIGKILL)
    for child in children:
        try:
            child.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        child.finish_output()
