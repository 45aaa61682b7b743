"""Commands a worker sends to every server (MXNet's ``kv._send_command_to_servers(head,
body)``): the server-side profiler, so far.

Commands (``head``; ``body`` is a str):

| head | body | effect |
|---|---|---|
| ``profile_start`` | ignored | start profiling this server's request loop (cProfile) |
| ``profile_stop`` | ignored | stop it; what was recorded is kept for ``profile_dump`` |
| ``profile_dump`` | a directory on the server's host | write ``<dir>/server-<rank>.prof`` (pstats format: ``python -m pstats FILE``, snakeviz), reply its path |

A command travels on the data plane, authenticated like every request there
(CURVE when the job has a secret). An unknown head, a body of the wrong type, a
stop without a start or a dump with nothing recorded is answered with an error
and changes nothing.

Example (what ServerNode does)::

    commands = ServerCommands(rank=0)
    reply = commands.handle(header)      # header["head"], header["body"]
"""

from __future__ import annotations

import cProfile
import logging
import os

from ..errors import InvalidArgumentError, KVStoreError
from ..protocol import error_header, ops

log = logging.getLogger(__name__)

COMMANDS = ("profile_start", "profile_stop", "profile_dump")


class ServerCommands:
    """The commands of one server process; owns its profiler."""

    def __init__(self, rank: int):
        self.rank = rank
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

    def _dump(self, body: str) -> str:
        if self._profile is None:
            raise InvalidArgumentError("profile_dump: nothing recorded (send profile_start first)")
        if not body or not os.path.isabs(body):
            raise InvalidArgumentError(f"profile_dump: the body must be an absolute directory path on the "
                                       f"server's host, got {body!r}")
        os.makedirs(body, exist_ok=True)
        path = os.path.join(body, f"server-{self.rank}.prof")
        running = self._running
        if running:               # a snapshot of what was recorded so far; recording goes on
            self._profile.disable()
        try:
            self._profile.dump_stats(path)
        finally:
            if running:
                self._profile.enable()
        return path

    def close(self) -> None:
        if self._running and self._profile is not None:
            self._profile.disable()
            self._running = False
