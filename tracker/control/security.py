"""Authentication and encryption of every ZeroMQ connection of a job.

A job has one secret (random, created by the launcher, handed to its processes in
the environment as KVSTORE_SECRET; never on a command line). Everything else is
derived from it with HMAC-SHA256:

- default: ZeroMQ PLAIN with a derived token. Keeps out every process without the
  secret (stray jobs, scanners, other users). The token crosses the network in
  clear text, so an eavesdropper on the network could replay it: use ``encrypt``
  on networks you do not trust.
- ``encrypt`` (KVSTORE_SECURE=1): ZeroMQ CURVE. The servers' and the clients'
  key pairs are derived from the secret, so only holders of the secret can
  connect, and all traffic is encrypted and authenticated.

Binding sockets get a ZAP handler (one thread per ZeroMQ context) that checks the
credentials of every connection and logs each rejection with the peer's address;
the same thread watches the sockets for handshakes that fail before ZAP is asked
(a CURVE client with the wrong keys, a PLAIN client at a CURVE socket) and logs
those too, with the peer's address read from the connection when ZeroMQ reports
its accept (the failure event itself names only the local endpoint).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import queue
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable

import zmq
from zmq.utils import z85

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
DOMAIN = b"kvstore"
USER = b"kvstore"


def new_secret() -> str:
    """A fresh job secret (64 hex digits)."""
    return secrets.token_hex(32)


@dataclass(frozen=True)
class Security:
    """How a job's sockets authenticate. ``Security()`` (no secret) is open."""
    secret: str | None = None
    encrypt: bool = False

    def __post_init__(self):
        if self.encrypt and not self.secret:
            raise ValueError("encryption (KVSTORE_SECURE) needs a job secret (KVSTORE_SECRET)")

    @property
    def enabled(self) -> bool:
        return bool(self.secret)

    def _derive(self, purpose: str) -> bytes:
        assert self.secret is not None, "an open Security derives no keys"
        return hmac.new(self.secret.encode(), purpose.encode(), hashlib.sha256).digest()

    def _keypair(self, role: str) -> tuple[bytes, bytes]:
        secret_key = z85.encode(self._derive(f"curve-{role}"))
        return zmq.curve_public(secret_key), secret_key

    @property
    def token(self) -> bytes:
        return self._derive("plain-token").hex().encode()

    def serve(self, sock: zmq.Socket) -> None:
        """Configure a binding socket (call before bind)."""
        if not self.enabled:
            return
        sock.zap_domain = DOMAIN
        if self.encrypt:
            public, secret_key = self._keypair("server")
            sock.curve_server = True
            sock.curve_publickey, sock.curve_secretkey = public, secret_key
        else:
            sock.plain_server = True

    def connect(self, sock: zmq.Socket) -> None:
        """Configure a connecting socket (call before connect)."""
        if not self.enabled:
            return
        if self.encrypt:
            sock.curve_serverkey = self._keypair("server")[0]
            sock.curve_publickey, sock.curve_secretkey = self._keypair("client")
        else:
            sock.plain_username, sock.plain_password = USER, self.token

    def authenticator(self, ctx: zmq.Context, name: str) -> "Authenticator | None":
        """Start the ZAP handler for ``ctx`` (None when the job is open)."""
        return Authenticator(ctx, self, name).start() if self.enabled else None

    def accepts(self, mechanism: bytes, credentials: list) -> bool:
        if self.encrypt:
            expected = z85.decode(self._keypair("client")[0])
            return mechanism == b"CURVE" and len(credentials) == 1 and \
                hmac.compare_digest(credentials[0], expected)
        return mechanism == b"PLAIN" and len(credentials) == 2 and credentials[0] == USER and \
            hmac.compare_digest(credentials[1], self.token)


class Handshakes:
    """Who is at the other end of each connection one watched socket accepted, so
    that a handshake that fails before ZAP is asked is logged with the peer's
    address: ZeroMQ's failure event names only the local endpoint.

    The address is read from the connection's file descriptor when its accept is
    reported (tcp: the peer's IP address; ipc: the peer's pid and uid). libzmq
    emits a failed handshake's event and then the ``DISCONNECTED`` event of the
    same connection (with its descriptor) from one I/O thread, so the two are
    paired. Best effort: a peer that fails fast may be gone (its descriptor
    closed) before the accept is handled; its rejection then says so."""

    EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
              | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)

    def __init__(self, peer_of: Callable[[int, str], str | None] | None = None):
        self._peer_of = peer_of or peer_address   # tests pass their own
        self._peers: dict[int, str | None] = {}   # descriptor -> peer, while connected
        self._failed: str | None = None           # a failure waiting for its DISCONNECTED

    def on_event(self, event: int, value: int, endpoint: str) -> tuple[str, str | None] | None:
        """Take one monitor event; returns (why, peer address or None) when it
        completes a failed handshake, else None."""
        if event == zmq.EVENT_ACCEPTED:
            self._peers[value] = self._peer_of(value, endpoint)
        elif event in (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
            self._failed = zmq.Event(event).name
        elif event == zmq.EVENT_DISCONNECTED:
            peer = self._peers.pop(value, None)
            failed, self._failed = self._failed, None
            if failed is not None:
                return failed, peer
        return None


def peer_address(fd: int, endpoint: str) -> str | None:
    """The address of the peer of connection ``fd``, accepted on ``endpoint``:
    its IP address (tcp), ``pid P uid U`` (ipc); None if ``fd`` is no longer
    that connection (closed, or reused by a socket on another local address)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as conn:
            if conn.family == socket.AF_UNIX:
                pid, uid, _ = struct.unpack("3i", conn.getsockopt(
                    socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
                return f"pid {pid} uid {uid}"
            local, peer = conn.getsockname(), conn.getpeername()
    except (OSError, ValueError, AttributeError):   # AttributeError: no SO_PEERCRED here
        return None
    # a descriptor closed and reused since the accept: not on the endpoint's port
    if not endpoint.endswith(f":{local[1]}"):
        return None
    return str(peer[0])


class Authenticator:
    """ZAP handler thread: answers ZeroMQ's authentication requests for one context."""

    def __init__(self, ctx: zmq.Context, security: Security, name: str):
        self._ctx, self._security, self._name = ctx, security, name
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"kvstore-zap-{name}")
        self._watch: queue.Queue = queue.Queue()
        self._last_logged: dict = {}   # what -> (time, suppressed count)
        self.rejected = 0

    def _log_handshake(self, endpoint: str, reason: str, peer: str | None) -> None:
        if peer is None:   # the connection was gone before its address could be read
            return self._log_rejection(("handshake", endpoint), "%s rejected a connection on %s "
                                       "from an address it could not read (the connection closed "
                                       "first): the handshake failed (%s); the peer does not hold "
                                       "this job's secret or does not use its security mode",
                                       endpoint, reason)
        self._log_rejection(("handshake", peer), "%s rejected a connection from %s on %s: the "
                            "handshake failed (%s); the peer does not hold this job's secret or "
                            "does not use its security mode", peer, endpoint, reason)

    def _log_rejection(self, what: tuple, message: str, *args) -> None:
        """Log a rejection; a peer that keeps retrying is logged at most every 10 s."""
        self.rejected += 1
        now = time.monotonic()
        last, suppressed = self._last_logged.get(what, (None, 0))
        if last is not None and now - last < 10.0:
            self._last_logged[what] = (last, suppressed + 1)
            return
        more = f" ({suppressed} more since the last report)" if suppressed else ""
        log.warning(message + more, self._name, *args)
        self._last_logged[what] = (now, 0)

    def watch(self, sock: zmq.Socket) -> None:
        """Also log failed handshakes on ``sock`` (a socket configured by serve()),
        naming the peer's address."""
        self._watch.put(sock.get_monitor_socket(Handshakes.EVENTS))

    def start(self) -> "Authenticator":
        self._thread.start()
        self._ready.wait(5)
        return self

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.REP)
        sock.linger = 0
        sock.bind(ZAP_ENDPOINT)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        monitors: dict = {}   # monitor socket -> its Handshakes
        self._ready.set()
        try:
            while not self._stop.is_set():
                while not self._watch.empty():
                    monitor = self._watch.get()
                    monitors[monitor] = Handshakes()
                    poller.register(monitor, zmq.POLLIN)
                ready = dict(poller.poll(100))
                for monitor, handshakes in monitors.items():
                    if monitor in ready:
                        event, value, endpoint = monitor_event(monitor.recv_multipart())
                        failed = handshakes.on_event(event, value, endpoint)
                        if failed is not None:
                            self._log_handshake(endpoint, *failed)
                if sock not in ready:
                    continue
                frames = sock.recv_multipart()
                version, request_id, _domain, address, _identity, mechanism = frames[:6]
                ok = self._security.accepts(mechanism, frames[6:])
                if not ok:
                    peer = address.decode(errors="replace")
                    self._log_rejection(("zap", peer), "%s rejected a connection from %s: %s credentials "
                                        "do not match this job's secret", peer,
                                        mechanism.decode(errors="replace"))
                sock.send_multipart([version, request_id, b"200" if ok else b"400",
                                     b"OK" if ok else b"authentication failed",
                                     USER if ok else b"", b""])
        except zmq.ZMQError as e:
            if not self._stop.is_set():
                log.error("%s: authentication handler failed: %s", self._name, e)
        finally:
            sock.close(linger=0)
            while not self._watch.empty():   # handed over but never picked up
                monitors[self._watch.get()] = None
            for monitor in monitors:
                monitor.close(linger=0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)


def monitor_event(frames: list) -> tuple[int, int, str]:
    """A ZeroMQ socket monitor's message (libzmq's zmq_socket_monitor): a frame of a
    16-bit event id and a 32-bit value (native byte order, no padding), then the
    endpoint; as ``(event, value, endpoint)``. (pyzmq's ``recv_monitor_message`` does
    the same, but its module imports asyncio: ~25 ms more in every process's start.)"""
    if len(frames) != 2 or len(frames[0]) != 6:
        raise RuntimeError(f"not a ZeroMQ monitor event: {frames!r:.200}")
    event, value = struct.unpack("=hi", frames[0])
    return event, value, bytes(frames[1]).decode(errors="replace")
