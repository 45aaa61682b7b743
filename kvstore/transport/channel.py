"""Data channels: a plain TCP connection per (worker, server) pair that carries
a server's large replies, while ZeroMQ carries everything else.

Why: through ZeroMQ a reply lands in a frame that the worker's thread then
copies into the caller's array. Here a worker registers where each reply's
buffers go (the caller's output arrays) and the reader thread receives them
there with ``recv_into``: no frame, no copy. Measured (docs/performance.md §4,
item 14): over tcp a worker's main thread went from 18 to 4 ms of CPU per
ResNet-50 exchange, the receiving itself costs what ZeroMQ's I/O thread spent
on it, and the exchange got 8-16 % faster. Requests stay on ZeroMQ: a server
must keep what it receives anyway (a round's first push waits for the second),
and sending requests over the channel as well measured no faster.

Framing::

    [u32 little-endian: header length][header][buffer 0]...[buffer n-1]

The header is the codec's msgpack map (the first frame of the same message over
ZeroMQ); buffers follow in order, raw, as long as the header says.

Handshake: the worker asks over its (authenticated) ZeroMQ connection
(``channel``); the server answers with a port and a fresh one-time token; the
worker connects, sends the token, and the server answers :data:`ACK` once the
connection is registered as that worker's. A connection with any other token
is closed and logged. Jobs with ``KVSTORE_SECURE=1`` (CURVE encryption) never
open channels: their data must not travel in clear.
"""

from __future__ import annotations

import hmac
import logging
import os
import queue
import secrets
import socket
import struct
import threading
from typing import Callable

import numpy as np

from ..errors import ProtocolError
from ..protocol.codec import MAX_HEADER_BYTES, buffer_specs, parse_header

log = logging.getLogger(__name__)

LENGTH = struct.Struct("<I")
TOKEN_BYTES = 32
ACK = b"\x06"


def _tune(sock: socket.socket) -> None:
    # no SO_SNDBUF/SO_RCVBUF: setting them turns off the kernel's autotuning (which
    # grows them to tcp_rmem/tcp_wmem's maximum); 4 MiB buffers measured the same here
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _raw(a: np.ndarray) -> memoryview:
    return memoryview(a.reshape(-1).view(np.uint8))


def send_message(sock: socket.socket, frames) -> int:
    """Write one message (the codec's frames: header bytes, then C-contiguous
    arrays); returns the bytes written."""
    head = bytes(frames[0])
    sock.sendall(LENGTH.pack(len(head)) + head)
    sent = LENGTH.size + len(head)
    for a in frames[1:]:
        view = _raw(np.asarray(a))
        sock.sendall(view)
        sent += view.nbytes
    return sent


def _recv_exact(sock: socket.socket, view: memoryview, what: str) -> None:
    got, size = 0, view.nbytes
    while got < size:
        n = sock.recv_into(view[got:], size - got, socket.MSG_WAITALL)
        if n == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of the {size} "
                                  f"bytes of {what}")
        got += n


def read_message(sock: socket.socket, max_buffer_bytes: int,
                 destinations: Callable | None = None) -> tuple[dict, list, int]:
    """Read one message: (header, arrays, bytes read). Raises EOFError when the
    peer closed the connection between messages, ConnectionError inside one,
    ProtocolError on a malformed one (the stream is then out of step).

    ``destinations(header)`` may return arrays to receive the buffers into (one
    per buffer); a buffer whose destination does not match its dtype and size
    exactly (or is not contiguous and writable) is received into a new array."""
    prefix = bytearray(LENGTH.size)
    n = sock.recv_into(prefix, LENGTH.size, socket.MSG_WAITALL)
    if n == 0:
        raise EOFError("the peer closed the connection")
    if n < LENGTH.size:
        _recv_exact(sock, memoryview(prefix)[n:], "a message's length")
    (length,) = LENGTH.unpack(prefix)
    if length > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {length} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    head = bytearray(length)
    _recv_exact(sock, memoryview(head), "a header")
    header = parse_header(head)
    if header.get("shm") is not None:
        raise ProtocolError("a data-channel message may not point into shared memory")
    specs = buffer_specs(header, max_buffer_bytes)
    dests = destinations(header) if destinations is not None else None
    if dests is not None and len(dests) != len(specs):
        dests = None
    arrays, total = [], LENGTH.size + length
    for i, (dtype, shape, nbytes) in enumerate(specs):
        dest = dests[i] if dests is not None else None
        if dest is None or dest.dtype != dtype or dest.nbytes != nbytes \
                or not dest.flags.c_contiguous or not dest.flags.writeable:
            dest = np.empty(shape, dtype)
        _recv_exact(sock, _raw(dest), f"buffer {i} of request {header.get('id')}")
        arrays.append(dest)
        total += nbytes
    return header, arrays, total


class Channel:
    """One connected data channel: a writer thread (messages in the order given)
    and a reader thread that hands every message to ``deliver(header, arrays,
    nbytes)``, or the channel's end to ``failed(error)`` (not called after
    :meth:`close`). ``destinations``: see :func:`read_message`. With ``deliver``
    None (a server's end: it only writes) any message read breaks the channel."""

    def __init__(self, sock: socket.socket, name: str, max_buffer_bytes: int,
                 deliver: Callable | None, failed: Callable, destinations: Callable | None = None):
        self._sock = sock
        self.name = name
        self.broken: str | None = None
        self.bytes_sent = self.bytes_received = 0
        self._closing = False
        self._max = max_buffer_bytes
        self._deliver, self._failed, self._destinations = deliver, failed, destinations
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=run, name=f"kvstore-{name}-{role}", daemon=True)
                         for run, role in ((self._write, "out"), (self._read, "in"))]
        for t in self._threads:
            t.start()

    def send(self, frames) -> None:
        """Queue one message; its buffers must stay unchanged until it is written
        (a server's values do: see ServerState._finish)."""
        self._outbox.put(frames)

    def _write(self) -> None:
        while True:
            frames = self._outbox.get()
            if frames is None:
                return
            if self.broken is None:
                try:
                    self.bytes_sent += send_message(self._sock, frames)
                except OSError as e:
                    self._break(ConnectionError(f"writing failed: {e}"))

    def _read(self) -> None:
        while True:
            try:
                header, arrays, nbytes = read_message(self._sock, self._max, self._destinations)
                if self._deliver is None:
                    raise ProtocolError(f"a {header['op']!r} message on a channel that only "
                                        "carries replies")
            except (EOFError, OSError, ProtocolError) as e:
                self._break(e)
                return
            self.bytes_received += nbytes
            self._deliver(header, arrays, nbytes)

    def _break(self, error: Exception) -> None:
        if self.broken is not None:
            return
        self.broken = f"{type(error).__name__}: {error}"
        try:                      # the peer sees the end at once, our writer fails fast
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if not self._closing:
            self._failed(error)

    def close(self) -> None:
        self._closing = True
        self.broken = self.broken or "closed"
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._outbox.put(None)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(5)
        self._sock.close()


def connect(host: str, port: int, token: bytes, timeout: float) -> socket.socket:
    """The worker's end of the handshake: a connected, tuned, blocking socket."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        _tune(sock)
        sock.sendall(token)
        answer = bytearray(1)
        _recv_exact(sock, memoryview(answer), "the server's acknowledgement")
        if bytes(answer) != ACK:
            raise ConnectionError("the server did not acknowledge the data channel")
        sock.settimeout(None)
        return sock
    except BaseException:
        sock.close()
        raise


class Listener:
    """The server's end: a listening socket on ``host``, tokens handed out by
    :meth:`offer`, and a thread that accepts connections and passes each one
    whose token matches to ``accepted(peer, sock)`` before acknowledging it."""

    ACCEPT_POLL = 0.5        # seconds: how often the accept loop checks for close()
    TOKEN_TIMEOUT = 5.0      # a connection must send its token within this time

    def __init__(self, host: str, accepted: Callable, name: str):
        self._accepted = accepted
        self.name = name
        self._tokens: dict[bytes, object] = {}
        self._lock = threading.Lock()
        self._closing = False
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.bind((host, 0))
        self._sock.listen(64)
        self._sock.settimeout(self.ACCEPT_POLL)
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._run, name=f"kvstore-{name}-accept", daemon=True)
        self._thread.start()

    def offer(self, peer) -> bytes:
        """A one-time token for ``peer``'s data channel."""
        token = secrets.token_bytes(TOKEN_BYTES)
        with self._lock:
            self._tokens[token] = peer
        return token

    def _claim(self, token: bytes):
        with self._lock:
            for known in list(self._tokens):
                if hmac.compare_digest(known, token):
                    return self._tokens.pop(known)
        return None

    def _run(self) -> None:
        while not self._closing:
            try:
                conn, addr = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return               # closed
            try:
                conn.settimeout(self.TOKEN_TIMEOUT)
                token = bytearray(TOKEN_BYTES)
                _recv_exact(conn, memoryview(token), "a data-channel token")
                peer = self._claim(bytes(token))
                if peer is None:
                    raise ConnectionError("wrong token")
                conn.settimeout(None)
                _tune(conn)
                self._accepted(peer, conn)
                conn.sendall(ACK)
            except OSError as e:
                log.warning("%s: refused a data-channel connection from %s: %s", self.name,
                            addr[0], e)
                conn.close()

    def close(self) -> None:
        self._closing = True
        self._thread.join(self.ACCEPT_POLL * 4)
        self._sock.close()


class Wakeup:
    """A pipe that threads write to so that a ZeroMQ poller (which accepts file
    descriptors) wakes up for their messages."""

    def __init__(self):
        self.fd, self._write = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write, False)

    def set(self) -> None:
        try:
            os.write(self._write, b"!")
        except BlockingIOError:      # already full of wake-ups
            pass

    def clear(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.fd)
        os.close(self._write)
