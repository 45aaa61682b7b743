"""Worker side of the data plane: request ids, fan-out to servers, replies, deadlines.

A :class:`Client` belongs to the thread that uses its store (like MXNet's
KVStore, a store is not thread-safe). Requests are sent at once; replies are
collected whenever a call waits. A push does not wait for its acknowledgement,
but an error in it is raised by the next call that waits.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Callable

import zmq

from tracker.membership import Membership

from .config import Config
from .errors import DeadlineError, NodeFailedError, ProtocolError, RemoteError
from .protocol import decode, encode, ops

log = logging.getLogger(__name__)

SLICE = 0.1          # seconds between checks of the abort flag while waiting
MAX_IN_FLIGHT = 512  # requests without a reply before a push waits (back-pressure)


@dataclass
class _Request:
    server: int
    what: str
    on_reply: Callable | None
    error: Exception | None = None
    done: bool = False


class Client:
    """Connections from one worker to every server."""

    def __init__(self, config: Config, membership: Membership, servers: list[str], rank: int):
        self.config = config
        self.membership = membership
        self.servers = servers
        self.rank = rank
        self._ctx = zmq.Context()
        self._socks = []
        self._poller = zmq.Poller()
        for addr in servers:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
            sock.copy_threshold = config.zero_copy_bytes
            config.security().connect(sock)
            sock.connect(addr)
            self._poller.register(sock, zmq.POLLIN)
            self._socks.append(sock)
        self._index = {sock: i for i, sock in enumerate(self._socks)}
        self._ids = itertools.count(1)
        self._seq = [0] * len(servers)   # per-connection order: the server handles each once, in order
        self._pending: dict[int, _Request] = {}
        self._orphan_errors: list[Exception] = []  # failed requests nobody waited for yet
        self.failure: str | None = None   # set once a wait gave up: the connection state is unknown
        self.bytes_sent = 0       # payload + headers handed to ZeroMQ, for users' accounting
        self.bytes_received = 0

    def request(self, server: int, op: str, what: str, arrays=(), on_reply=None,
                track: bool = False, **fields):
        """Send one request; returns (request id, zmq MessageTracker or None)."""
        if len(self._pending) >= MAX_IN_FLIGHT:  # back-pressure: wait for the oldest
            self.wait([min(self._pending)], f"{what} (waiting for earlier requests to be answered)")
        req_id = next(self._ids)
        seq, self._seq[server] = self._seq[server], self._seq[server] + 1
        frames = encode({"op": op, "id": req_id, "src": self.rank, "seq": seq, **fields}, arrays)
        tracker = self._socks[server].send_multipart(frames, copy=False, track=track)
        self.bytes_sent += len(frames[0]) + sum(a.nbytes for a in arrays)
        self._pending[req_id] = _Request(server, what, on_reply)
        return req_id, (tracker if track else None)

    def wait_sent(self, trackers, what: str) -> None:
        """Wait until ZeroMQ no longer reads the caller's buffers."""
        deadline = time.monotonic() + self.config.timeout
        for tracker in trackers:
            while not tracker.done:
                self._check_abort()
                try:
                    tracker.wait(SLICE)
                except zmq.NotDone:
                    if time.monotonic() > deadline:
                        raise DeadlineError(f"{what}: could not hand the data to the servers in "
                                            f"{self.config.timeout:g}s; raise KVSTORE_TIMEOUT") from None

    def wait(self, ids, what: str) -> None:
        """Wait for replies to ``ids``; raise the first error among them (or an
        earlier push's), a DeadlineError, or NodeFailedError if the job aborted."""
        ids = list(ids)
        deadline = time.monotonic() + self.config.timeout
        while any(i in self._pending for i in ids):
            self._progress(SLICE, what)
            self.raise_errors()
            if time.monotonic() > deadline:
                late = sorted({self._pending[i].server for i in ids if i in self._pending})
                names = ", ".join(f"server {s} ({self.servers[s]})" for s in late)
                self.failure = f"{what}: no reply from {names} within {self.config.timeout:g}s"
                raise DeadlineError(
                    f"{what}: no reply from {names} within {self.config.timeout:g}s. In dist_sync "
                    "a round completes only when every worker pushed the key; raise "
                    "KVSTORE_TIMEOUT if the job is just slow")
        self.raise_errors()

    def flush(self, what: str) -> None:
        """Wait for every request in flight (e.g. pushes) and raise their errors."""
        self.wait(list(self._pending), what)

    def raise_errors(self) -> None:
        if self._orphan_errors:
            error, self._orphan_errors = self._orphan_errors[0], []
            raise error

    def _check_abort(self) -> None:
        if self.membership.aborted.is_set():
            raise NodeFailedError(f"the job was aborted: {self.membership.abort_reason}")

    def _progress(self, timeout: float, what: str) -> None:
        self._check_abort()
        for sock, _ in self._poller.poll(timeout * 1000):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._on_reply(self._index[sock], frames)

    def _on_reply(self, server: int, frames) -> None:
        self.bytes_received += sum(len(f) for f in frames)
        try:
            header, arrays = decode(frames, self.config.max_message_bytes)
        except ProtocolError as e:
            raise ProtocolError(f"malformed reply from server {server}: {e}") from e
        req = self._pending.pop(header["id"], None)
        if req is None:
            log.warning("reply from server %d to unknown request %s", server, header["id"])
            return
        if header["op"] == ops.ERROR:
            error = RemoteError(f"server {server}", str(header.get("kind")), str(header.get("message")))
            error.args = (f"{req.what}: {error}",)
            self._orphan_errors.append(error)
        elif req.on_reply is not None:
            req.on_reply(header, arrays)

    def close(self) -> None:
        for sock in self._socks:
            sock.close(linger=0)
        self._ctx.term()
