"""Commands a worker sends to every server (MXNet's ``kv._send_command_to_servers(head,
body)``): the server-side profiler, so far.

Commands (``head``; ``body`` is a str):

| head | body | effect |
|---|---|---|
| ``profile_start`` | ignored | start profiling this server's request loop (cProfile) |
| ``profile_stop`` | ignored | stop it; what was recorded is kept for ``profile_dump`` |
| ``profile_dump`` | a label: ``""`` or up to 64 of ``A-Z a-z 0-9 _ -`` | write ``server-<rank>[-<label>].prof`` (pstats format: ``python -m pstats FILE``, snakeviz) in the server's profile directory, reply its path |

Nothing a command carries names a path: a dump goes to the directory the server
was configured with (``KVSTORE_PROFILE_DIR``, read on the server's host; default
``kvstore-profiles`` in its working directory), under a name the server makes
itself. The file is created new (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600):
it never follows a link or replaces what is there; a name that exists gets the
next free suffix (``server-0.1.prof``, ...).

A command travels on the data plane, authenticated like every request there
(CURVE when the job has a secret). An unknown head, a body of the wrong type or
content (a NUL, a path, anything but a label), a stop without a start or a dump
with nothing recorded is answered with an error and changes nothing.

Example (what ServerNode does)::

    commands = ServerCommands(rank=0, profile_dir="/var/log/job/profiles")
    reply = commands.handle(header)      # header["head"], header["body"]
"""

from __future__ import annotations

import cProfile
import errno
import logging
import marshal
import os
import re

from ..errors import InvalidArgumentError, KVStoreError
from ..protocol import error_header, ops

log = logging.getLogger(__name__)

COMMANDS = ("profile_start", "profile_stop", "profile_dump")
LABEL = re.compile(r"[A-Za-z0-9_-]{0,64}")   # what a body may be: part of a file name, never a path
MAX_SUFFIX = 1000                            # server-R.1.prof ... before giving up


class ServerCommands:
    """The commands of one server process; owns its profiler. ``profile_dir``:
    where dumps go (the server's setting, never the wire's)."""

    def __init__(self, rank: int, profile_dir: str):
        self.rank = rank
        self.profile_dir = os.path.abspath(profile_dir)
        self._profile: cProfile.Profile | None = None    # recorded so far (running or stopped)
        self._running = False
        self._handlers = {"profile_start": self._start, "profile_stop": self._stop,
                          "profile_dump": self._dump}

    def handle(self, header: dict) -> dict:
        """Run one ``command`` request; the reply header (ok with ``result``, or an error)."""
        req_id = header["id"]
        head, body = header.get("head"), header.get("body", "")
        try:
            if not isinstance(head, str) or head not in self._handlers:
                raise InvalidArgumentError(f"unknown server command {head!r}; known: {', '.join(COMMANDS)}")
            if not isinstance(body, str):
                raise InvalidArgumentError(f"server command {head}: the body must be a str, got "
                                           f"{type(body).__name__}")
            if not LABEL.fullmatch(body):
                raise InvalidArgumentError(
                    f"server command {head}: the body must be empty or a label of at most 64 letters, "
                    f"digits, '_' or '-' (a dump goes to the server's KVSTORE_PROFILE_DIR; no path "
                    f"comes from the wire), got {body[:80]!r}")
            result = self._handlers[head](body)
        except OSError as e:
            return error_header(req_id, "InvalidArgumentError", f"server {self.rank}: {head}: {e}")
        except KVStoreError as e:
            return error_header(req_id, type(e).__name__, f"server {self.rank}: {e}")
        log.info("server %d: command %s done%s", self.rank, head, f": {result}" if result else "")
        return {"op": ops.OK, "id": req_id, "result": result}

    def _start(self, body: str) -> str:
        if self._running:
            raise InvalidArgumentError("profile_start: the profiler already runs")
        self._profile = cProfile.Profile()
        self._profile.enable()
        self._running = True
        return ""

    def _stop(self, body: str) -> str:
        if not self._running or self._profile is None:
            raise InvalidArgumentError("profile_stop: the profiler does not run (send profile_start first)")
        self._profile.disable()
        self._running = False
        return ""

    def _dump(self, label: str) -> str:
        if self._profile is None:
            raise InvalidArgumentError("profile_dump: nothing recorded (send profile_start first)")
        os.makedirs(self.profile_dir, mode=0o700, exist_ok=True)
        fd, path = self._create(f"server-{self.rank}{'-' + label if label else ''}")
        running = self._running
        if running:               # a snapshot of what was recorded so far; recording goes on
            self._profile.disable()
        try:
            self._profile.create_stats()       # what dump_stats writes, to our own descriptor
            with os.fdopen(fd, "wb") as f:
                marshal.dump(self._profile.stats, f)   # type: ignore[attr-defined]  # set by create_stats
        finally:
            if running:
                self._profile.enable()
        return path

    def _create(self, stem: str) -> tuple[int, str]:
        """A new file ``<profile_dir>/<stem>[.N].prof``, opened for writing: never an
        existing file, never through a link."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        for n in range(MAX_SUFFIX):
            path = os.path.join(self.profile_dir, f"{stem}{f'.{n}' if n else ''}.prof")
            try:
                return os.open(path, flags, 0o600), path
            except FileExistsError:
                continue
        raise OSError(errno.EEXIST, f"{MAX_SUFFIX} profiles named {stem}*.prof exist already in "
                      f"{self.profile_dir}")

    def close(self) -> None:
        if self._running and self._profile is not None:
            self._profile.disable()
            self._running = False
