"""Checks and copies on every host before an ssh job starts: can ssh reach it,
does the remote interpreter run, is the working directory there and can it
import kvstore (:func:`check_host`); copy this directory there (:func:`sync_dir`).
Each returns None or an error message that names the host and the option that
fixes it; :func:`on_each` runs one on every host at once.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import threading

from .hostfile import Host
from .remote import SshOptions

_CHECK = r"""
import importlib.util, json, os, socket, sys
out = {"python": sys.version.split()[0], "hostname": socket.gethostname()}
try:
    os.chdir(sys.argv[1]); out["dir"] = True
except OSError as e:
    out["dir"] = False; out["dir_error"] = str(e)
if out["dir"] and sys.argv[2]:
    sys.path.insert(0, "")
    try:
        out["module"] = importlib.util.find_spec(sys.argv[2]) is not None
    except Exception:
        out["module"] = False
print(json.dumps(out))
"""


def check_host(ssh: SshOptions, host: Host, python: str, directory: str, module: str | None,
               timeout: float) -> str | None:
    """Run a tiny check on ``host``; return an error message or None."""
    command = " ".join(shlex.quote(w) for w in ["exec", python, "-c", _CHECK, directory, module or ""])
    try:
        r = subprocess.run(ssh.argv(host, command), stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"{host.name}: no answer within {timeout:g}s"
    except OSError as e:
        return f"cannot run {ssh.program}: {e}"
    err = r.stderr.strip().splitlines()
    if r.returncode == 255:
        return f"cannot reach {host.name} over ssh: {err[-1] if err else 'ssh exited with 255'}"
    try:
        found = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        why = err[-1] if err else f"exit status {r.returncode}"
        return f"{host.name}: cannot run the remote interpreter {python!r}: {why} (set --remote-python)"
    if not found.get("dir"):
        return (f"{host.name}: working directory {directory!r} is not usable: "
                f"{found.get('dir_error')} (set --remote-dir, or copy it with --sync-dst-dir)")
    if module and not found.get("module"):
        return (f"{host.name}: {python} cannot import {module} in {directory} "
                "(install kvstore there, or copy this directory with --sync-dst-dir)")
    return None


def sync_dir(ssh: SshOptions, host: Host, source: str, destination: str, timeout: float) -> str | None:
    """rsync ``source``/ to ``destination`` on ``host`` (created if needed).
    Returns an error message or None."""
    dest = f"[{host.host}]" if ":" in host.host else host.host
    dest = f"{host.user}@{dest}" if host.user else dest
    argv = ["rsync", "-a", "--exclude=.git/", "--exclude=__pycache__/",
            "-e", shlex.join(ssh.base(host)),
            f"--rsync-path=mkdir -p {shlex.quote(destination)} && rsync",
            "--", source.rstrip("/") + "/", f"{dest}:{destination}"]
    try:
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"rsync to {host.name} did not finish within {timeout:g}s"
    except OSError as e:
        return f"cannot run rsync (install it here and on every host): {e}"
    if r.returncode != 0:
        err = r.stderr.strip().splitlines()
        return f"rsync to {host.name}:{destination} failed: {err[-1] if err else r.returncode}"
    return None


def on_each(hosts: list[Host], check) -> list[str]:
    """Run ``check(host)`` for every host in parallel; the error messages."""
    results: dict[int, str | None] = {}
    threads = [threading.Thread(target=lambda i=i, h=h: results.__setitem__(i, check(h)), daemon=True)
               for i, h in enumerate(hosts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [error for i in range(len(hosts)) if (error := results.get(i))]
