"""What the node wrapper (:mod:`tracker.wrapper`) sends back from a process started
elsewhere: its output lines, prefixed ``[role:rank@host]``, which a :class:`Sink`
prints and logs per process, and its ``@kvstore-node {json}`` status lines
(:func:`parse_status`); and the wrapper's own source, sent with ``python -c``."""

from __future__ import annotations

import itertools
import json
import os
import re
import sys
import threading
from typing import IO

from . import wrapper
from .process import write_out

STATUS = wrapper.STATUS
PREFIXED = re.compile(r"^\[(worker|server):(\d+)@[^\]]*\] ?")
exit_counter = itertools.count(1)


def wrapper_source() -> str:
    """The source of :mod:`tracker.wrapper`, for ``python -c``."""
    with open(wrapper.__file__, encoding="utf-8") as f:
        return f.read()


class Sink:
    """Where output lines go: this process's stdout (as they come, already
    prefixed) and optionally one log file per process (without the prefix)."""

    _lock = threading.Lock()

    def __init__(self, out: IO[str] | None = None, log_dir: str | None = None):
        self.out = out if out is not None else sys.stdout
        self.log_dir = log_dir
        self._logs: dict[tuple[str, int], IO[str]] = {}
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)

    def write(self, line: str) -> None:
        """Never raises: output that cannot be written (``| head -1`` closed the
        pipe, a full disk) is dropped, and the callers keep draining their
        processes' output, so no process blocks on a full pipe."""
        with self._lock:
            write_out(self.out, line + "\n")
            if self.log_dir and (m := PREFIXED.match(line)):
                key = (m[1], int(m[2]))
                try:
                    f = self._logs.get(key)
                    if f is None:
                        f = self._logs[key] = open(
                            os.path.join(self.log_dir, f"{key[0]}-{key[1]}.log"), "a",
                            encoding="utf-8")
                    f.write(line[m.end():] + "\n")
                    f.flush()
                except (OSError, ValueError):
                    pass

    def close(self) -> None:
        with self._lock:
            for f in self._logs.values():
                try:
                    f.close()
                except OSError:
                    pass
            self._logs.clear()


def parse_status(line: str) -> dict | None:
    """The wrapper's ``@kvstore-node {json}`` line as a dict, else None."""
    if not line.startswith(STATUS):
        return None
    try:
        msg = json.loads(line[len(STATUS):])
    except ValueError:
        return None
    return msg if isinstance(msg, dict) else None
