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
import selectors
import socket
import struct
import threading
from typing import cast
import time
from typing import Callable

import numpy as np

from ..errors import ProtocolError
from ..protocol.codec import MAX_HEADER_BYTES, REF_KINDS, buffer_specs, parse_header

log = logging.getLogger(__name__)

LENGTH = struct.Struct("<I")
TOKEN_BYTES = 32
ACK = b"\x06"


def _tune(sock: socket.socket) -> None:
    # no SO_SNDBUF/SO_RCVBUF: setting them turns off the kernel's autotuning (which
    # grows them to tcp_rmem/tcp_wmem's maximum); 4 MiB buffers measured the same here
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _raw(a: np.ndarray) -> memoryview:
    return a.reshape(-1).view(np.uint8).data


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
    if "layout" in header:
        raise ProtocolError("a data-channel message has its buffers' fields in its header, not in a layout frame")
    if any(header.get(kind) is not None for kind in REF_KINDS):
        raise ProtocolError("a data-channel message may not point into shared or device memory")
    specs = buffer_specs(header, max_buffer_bytes)
    if sum(nbytes for _, _, nbytes in specs) > max_buffer_bytes:
        raise ProtocolError(f"a message of more than {max_buffer_bytes} bytes (request "
                            f"{header.get('id')})")
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


class _End:
    """One end of a connected data channel and its threads. ``failed(error)`` is
    called once when the channel ends by itself (not after :meth:`close`)."""

    def __init__(self, sock: socket.socket, name: str, failed: Callable, runs):
        self._sock = sock
        self.name = name
        self.broken: str | None = None
        self._closing = False
        self._failed = failed
        self._threads = [threading.Thread(target=run, name=f"kvstore-{name}-{role}", daemon=True)
                         for run, role in runs]

    def _start(self) -> None:
        for t in self._threads:
            t.start()

    def _break(self, error: Exception) -> None:
        if self.broken is not None:
            return
        self.broken = f"{type(error).__name__}: {error}"
        try:                      # the peer sees the end at once, blocked calls return
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if not self._closing:
            self._failed(error)

    def _stop_threads(self) -> None:
        """(For close) wake threads that the socket's shutdown does not; close joins them."""

    def close(self) -> None:
        """End the channel and join its threads (bounded: the socket is shut down
        first, which returns every blocked call)."""
        self._closing = True
        self.broken = self.broken or "closed"
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._stop_threads()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(5)
        self._sock.close()


class Sender(_End):
    """The server's end: a writer thread sends the queued replies in order; a
    watcher thread notices the worker's end (EOF), or breaks the channel on any
    byte the worker writes (nothing travels that way)."""

    def __init__(self, sock: socket.socket, name: str, failed: Callable):
        super().__init__(sock, name, failed, ((self._write, "out"), (self._watch, "watch")))
        self.bytes_sent = 0
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._start()

    def send(self, frames) -> None:
        """Queue one message; its buffers must stay unchanged until it is written
        (a server's values do: see ServerState._finish)."""
        self._outbox.put(frames)

    def _write(self) -> None:
        while self.broken is None:
            frames = self._outbox.get()
            if frames is None:
                return
            try:
                self.bytes_sent += send_message(self._sock, frames)
            except OSError as e:
                self._break(ConnectionError(f"writing failed: {e}"))

    def _watch(self) -> None:
        try:
            data = self._sock.recv(1)
        except OSError as e:
            self._break(e)
            return
        self._break(ProtocolError("the worker wrote to a channel that only carries replies")
                    if data else EOFError("the worker closed the channel"))

    def _stop_threads(self) -> None:
        self._outbox.put(None)


class Receiver(_End):
    """The worker's end: a reader thread hands every message to ``deliver(header,
    arrays, nbytes)``; ``destinations``: see :func:`read_message`."""

    def __init__(self, sock: socket.socket, name: str, max_buffer_bytes: int,
                 deliver: Callable, failed: Callable, destinations: Callable | None = None):
        super().__init__(sock, name, failed, ((self._read, "in"),))
        self.bytes_received = 0
        self._max = max_buffer_bytes
        self._deliver, self._destinations = deliver, destinations
        self._start()

    def _read(self) -> None:
        while True:
            try:
                header, arrays, nbytes = read_message(self._sock, self._max, self._destinations)
            except (EOFError, OSError, ProtocolError) as e:
                self._break(e)
                return
            self.bytes_received += nbytes
            self._deliver(header, arrays, nbytes)


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
    """The server's end of the handshake: a listening socket on ``host``, one
    token per peer handed out by :meth:`offer` (valid once, for TOKEN_TTL), and a
    thread that reads the tokens of all connecting sockets at once (a connection
    that sends nothing holds up no other) and passes each connection whose token
    matches to ``accepted(peer, sock)`` after acknowledging it. Until then the
    peer's replies simply go through ZeroMQ."""

    POLL = 0.5               # seconds: how often the thread checks for close()
    TOKEN_TIMEOUT = 5.0      # a connection must send its token within this time
    TOKEN_TTL = 60.0         # an offered token must be used within this time

    def __init__(self, host: str, accepted: Callable, name: str):
        self._accepted = accepted
        self.name = name
        self._tokens: dict = {}              # peer -> (token, expiry)
        self._lock = threading.Lock()
        self._closing = False
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.bind((host, 0))
        self._sock.listen(64)
        self._sock.setblocking(False)
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._run, name=f"kvstore-{name}-accept", daemon=True)
        self._thread.start()

    def offer(self, peer) -> bytes:
        """A one-time token for ``peer``'s data channel (replacing any earlier one)."""
        token = secrets.token_bytes(TOKEN_BYTES)
        with self._lock:
            self._tokens[peer] = (token, time.monotonic() + self.TOKEN_TTL)
        return token

    def _claim(self, token: bytes):
        now = time.monotonic()
        with self._lock:
            for peer, (known, expiry) in list(self._tokens.items()):
                if hmac.compare_digest(known, token) and now <= expiry:
                    del self._tokens[peer]
                    return peer
        return None

    def _run(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._sock, selectors.EVENT_READ)
            pending: dict = {}               # connection -> (address, deadline, token so far)
            while not self._closing:
                for key, _ in sel.select(self.POLL):
                    if key.fileobj is self._sock:
                        try:
                            conn, addr = self._sock.accept()
                        except OSError:       # e.g. the peer gave up already
                            continue
                        conn.setblocking(False)
                        pending[conn] = (addr, time.monotonic() + self.TOKEN_TIMEOUT, b"")
                        sel.register(conn, selectors.EVENT_READ)
                        continue
                    conn = cast(socket.socket, key.fileobj)
                    addr, deadline, got = pending[conn]
                    try:
                        data = conn.recv(TOKEN_BYTES - len(got))
                    except OSError as e:
                        data, why = b"", str(e)
                    else:
                        why = "closed before sending a token"
                    if data and len(got + data) < TOKEN_BYTES:
                        pending[conn] = (addr, deadline, got + data)
                        continue
                    sel.unregister(conn)
                    del pending[conn]
                    if data:
                        self._handshake(conn, addr, got + data)
                    else:
                        self._refuse(conn, addr, why)
                now = time.monotonic()
                for conn, (addr, deadline, _) in list(pending.items()):
                    if now > deadline:
                        sel.unregister(conn)
                        del pending[conn]
                        self._refuse(conn, addr, f"no token within {self.TOKEN_TIMEOUT:g} s")
            for conn in pending:
                conn.close()

    def _handshake(self, conn, addr, token: bytes) -> None:
        peer = self._claim(token)
        if peer is None:
            self._refuse(conn, addr, "wrong token")
            return
        try:
            conn.setblocking(True)
            _tune(conn)
            conn.sendall(ACK)
        except OSError as e:
            self._refuse(conn, addr, str(e))
            return
        self._accepted(peer, conn)

    def _refuse(self, conn, addr, why: str) -> None:
        log.warning("%s: refused a data-channel connection from %s: %s", self.name, addr[0], why)
        conn.close()

    def close(self) -> None:
        """Stop accepting (bounded: the thread checks every POLL seconds); no
        ``accepted`` call happens after this returns."""
        self._closing = True
        self._thread.join(self.POLL * 4 + 5)
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
