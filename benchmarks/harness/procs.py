"""Start a group of processes (argv lists, never shell strings), wait for all of
them, and stop all of them when one fails or the deadline passes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time


class GroupFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(procs, log_path: str, timeout: float, wait_for=None) -> None:
    """Run ``procs`` [(label, argv, env)] with output appended to ``log_path``.
    Waits for the processes in ``wait_for`` (labels; default: all) to exit 0; the
    others (e.g. servers of a foreign framework) are stopped afterwards.
    Raises :class:`GroupFailed` (with the log's tail) on a failure or timeout."""
    started = []
    with open(log_path, "ab") as log:
        try:
            for label, argv, env in procs:
                log.write(f"--- start {label}: {' '.join(argv)}\n".encode())
                log.flush()
                started.append((label, subprocess.Popen(
                    list(argv), env={**os.environ, **env}, stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True)))
            waited = [(label, p) for label, p in started if wait_for is None or label in wait_for]
            deadline = time.monotonic() + timeout
            while True:
                codes = {label: p.poll() for label, p in started}
                bad = [(label, c) for label, c in codes.items() if c not in (None, 0)]
                if bad:
                    raise GroupFailed(f"{bad[0][0]} exited with status {bad[0][1]}\n{tail(log_path)}")
                if all(codes[label] == 0 for label, _ in waited):
                    return
                if time.monotonic() > deadline:
                    raise GroupFailed(f"timed out after {timeout:.0f}s\n{tail(log_path)}")
                time.sleep(0.05)  # polling child exits, not synchronisation
        finally:
            stop([p for _, p in started])


def stop(popens, grace: float = 3.0) -> None:
    for p in popens:
        if p.poll() is None:
            _killpg(p, signal.SIGTERM)
    end = time.monotonic() + grace
    for p in popens:
        try:
            p.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in popens:
        _killpg(p, signal.SIGKILL)
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            pass


def _killpg(p, sig) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, "rb") as f:
            text = f.read()[-20000:].decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])
