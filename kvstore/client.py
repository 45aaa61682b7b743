"""Worker side of the data plane: request ids, fan-out to servers, replies, deadlines.

A :class:`Client` belongs to the thread that uses its store (like MXNet's
KVStore, a store is not thread-safe). Requests are sent at once; replies are
collected whenever a call waits. A push does not wait for its acknowledgement,
but an error in it is raised by the next call that waits.

Each server is reached over the transport that ``KVSTORE_TRANSPORT`` and the
server's advert select (:mod:`kvstore.transport.endpoints`). With ``shm`` (a
co-located server, after a handshake proved it works) a request's buffers
are copied into this worker's shared-memory slots and the message carries only
references; replies point into the server's shared memory and are copied from
there straight into the caller's arrays. From a server reached over tcp, large
replies come through a data channel (:mod:`kvstore.transport.channel`): a plain
TCP connection whose reader thread receives them straight into the caller's arrays.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import time
from dataclasses import dataclass
from typing import Callable

import msgpack
import numpy as np
import zmq

from tracker.control.membership import Membership

from .config import Config
from .errors import DeadlineError, InvalidArgumentError, NodeFailedError, ProtocolError, RemoteError
from .protocol import decode, encode, ops
from .protocol.codec import MAX_HEADER_BYTES
from .transport import Advert, channel, choose, host_identity, memory, shm

log = logging.getLogger(__name__)

SLICE = 0.1          # seconds between checks of the abort flag while waiting
# Requests without a reply beyond which each new request first takes in the replies
# that have arrived. It never waits for one: in dist_sync a round may need pushes that
# this worker has still to send (workers pushing keys in different orders), so
# waiting here could deadlock. What bounds the queues is the servers reading their
# sockets (a send waits for room, with a deadline; they never wait on workers), and
# our sockets take every reply in (no receive limit: a reply is never dropped).
MAX_IN_FLIGHT = 512


@dataclass
class _Request:
    server: int
    what: str
    on_reply: Callable | None
    error: Exception | None = None
    done: bool = False
    staged: bool = False   # holds shared-memory slots until its reply
    urgent: bool = False   # its reply is handled before others that arrived with it
    channel: bool = False  # its reply comes through the server's data channel


class Client:
    """Connections from one worker to every server."""

    def __init__(self, config: Config, membership: Membership, servers: list[str], rank: int):
        self.config = config
        self.membership = membership
        self.rank = rank
        adverts = [Advert.parse(a) for a in servers]
        local = host_identity(config.host_label)
        chosen = [choose(a, config.transport, local) for a in adverts]
        self.servers = [url for url, _ in chosen]            # what each socket connects to
        self.transports = [kind for _, kind in chosen]       # "tcp", "ipc" or "shm", by server
        self._no_write_in: set = set()   # shm servers whose sums workers cannot write (GPU)
        self._arena = self._slots = self._probe = None
        self._mapper = shm.Mapper(writable=config.write_in)   # servers grant sums to write into
        self._ctx = zmq.Context()
        self._socks = []
        self._poller = zmq.Poller()
        for addr in self.servers:
            self._socks.append(self._connect(addr))
        self._index = {sock: i for i, sock in enumerate(self._socks)}
        self._ids = itertools.count(1)
        self._seq = [0] * len(servers)   # per-connection order: the server handles each once, in order
        self._pending: dict[int, _Request] = {}
        self._progressing = False   # inside _progress (a grant's handler sends `written`)
        self._orphan_errors: list[Exception] = []  # failed requests nobody waited for yet
        # requests of calls that raised before their replies came: those replies must
        # not reach the call's outputs any more (grants to write are still honoured,
        # or the other workers' rounds would wait for us forever)
        self._abandoned: set[int] = set()
        self.failure: str | None = None   # set once a wait gave up: the connection state is unknown
        self.bytes_sent = 0       # bytes of the messages sent (not what shared memory carried)
        self.bytes_received = 0
        self._channels: list[channel.Receiver | None] = [None] * len(servers)
        self._into: dict[int, tuple] = {}     # request id -> (server, arrays its channel reply fills)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()   # from the channels' readers
        self._wakeup = None
        try:
            if "shm" in self.transports:
                self._start_shm(adverts)
            if config.data_channel and not config.secure and "tcp" in self.transports:
                self._start_channels()
        except BaseException:   # e.g. the job aborted meanwhile: leave no sockets behind
            self.close()
            raise
        if config.malloc_tuning and any(t != "shm" for t in self.transports):
            memory.tune()          # replies arrive as large frames: keep their memory warm

    def _connect(self, addr: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        # replies (mostly acknowledgements of pushes) are never dropped for want of
        # room, however many requests are in flight: the server's sends never block
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.copy_threshold = self.config.zero_copy_bytes
        self.config.security().connect(sock)
        sock.connect(addr)
        self._poller.register(sock, zmq.POLLIN)
        return sock

    def _start_shm(self, adverts) -> None:
        """Prove to each co-located server that it can read our shared memory and we
        its (a probe both ways); servers where that fails are reached over their ipc
        endpoint (the same host), or tcp when they have none."""
        targets = [s for s, t in enumerate(self.transports) if t == "shm"]
        why = {}
        if shm.available():
            self._arena = shm.Arena(f"w{self.rank}")
            self._slots = shm.Slots(self._arena)
            self._probe = self._arena.alloc(16, np.uint8)
            self._probe[:] = np.frombuffer(os.urandom(16), np.uint8)
            place = self._arena.locate(self._probe)
        else:
            place = None
        ok = {}
        if place is None:
            why = dict.fromkeys(targets, "no shared memory in this process")
        else:
            self._mapper.allow(adverts[s].pid for s in targets if adverts[s].pid is not None)

            def answer(server):
                def check(header, values):
                    ok[server] = (header.get("shm_ok") is True and isinstance(header.get("shm"), dict)
                                  and len(values) == 1 and values[0].tobytes() == header.get("nonce"))
                    if header.get("sums_writable") is False:   # e.g. a GPU server: its sums are not here
                        self._no_write_in.add(server)
                return check
            # unsequenced: if the server cannot map our probe, the error must not hold
            # back the requests that follow on this connection
            ids = [self.request(s, ops.HELLO, f"shared-memory handshake with server {s}", [self._probe],
                                answer(s), shared=[place], sequenced=False, nonce=self._probe.tobytes())[0]
                   for s in targets]
            while True:
                try:
                    self.wait(ids, "the shared-memory handshake with the servers")
                    break
                except (RemoteError, ProtocolError) as e:   # that server falls back to tcp
                    log.info("[worker:%d] %s", self.rank, e)
        for s in targets:
            if ok.get(s):
                continue
            url, self.transports[s] = choose(adverts[s], "ipc", host_identity(self.config.host_label))
            if url != self.servers[s]:
                # only the unsequenced hello went out on this connection: a fresh one
                # (to the ipc endpoint) starts its sequence at 0 like any other
                old = self._socks[s]
                self._poller.unregister(old)
                old.close(linger=0)
                del self._index[old]
                self._socks[s] = self._connect(url)
                self._index[self._socks[s]] = s
                self.servers[s] = url
            log.warning("[worker:%d] server %d is on this host but shared memory with it failed "
                        "(%s); using %s", self.rank, s, why.get(s, "the probe did not read back"),
                        self.transports[s])

    def _start_channels(self) -> None:
        """Open a data channel to each server reached over tcp (a ``channel``
        request for a port and token, then a plain TCP connection) for its large
        replies. A server that offers none, or a connection that fails, leaves that
        server on ZeroMQ."""
        self._wakeup = channel.Wakeup()
        self._poller.register(self._wakeup.fd, zmq.POLLIN)
        offers = {}

        def keep(server):
            def offer(header, values):
                offers[server] = header
            return offer
        ids = [self.request(s, ops.CHANNEL, f"opening a data channel to server {s}",
                            on_reply=keep(s), sequenced=False)[0]
               for s, kind in enumerate(self.transports) if kind == "tcp"]
        while True:
            try:
                self.wait(ids, "opening data channels to the servers")
                break
            except (RemoteError, ProtocolError) as e:   # that server stays on ZeroMQ
                log.warning("[worker:%d] %s", self.rank, e)
        for s, offer in sorted(offers.items()):
            port, token = offer.get("port"), offer.get("token")
            if port is None:
                continue
            host = self.servers[s].removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
            try:
                if not (isinstance(port, int) and isinstance(token, bytes)
                        and len(token) == channel.TOKEN_BYTES):
                    raise ProtocolError(f"invalid channel offer {sorted(offer)}")
                sock = channel.connect(host, port, token, min(self.config.timeout, 30.0))
            except (OSError, ProtocolError) as e:
                log.warning("[worker:%d] no data channel to server %d (%s:%s): %s; its large "
                            "replies come through ZeroMQ", self.rank, s, host, port, e)
                continue
            self._channels[s] = channel.Receiver(
                sock, f"w{self.rank}-channel{s}", self.config.max_message_bytes,
                deliver=lambda header, arrays, nbytes, s=s: self._post((s, header, arrays, nbytes)),
                failed=lambda error, s=s: self._post((s, None, error, 0)),
                destinations=self._destinations(s))

    def _destinations(self, server: int):
        """(A channel's reader thread) where a reply's buffers go: the arrays
        registered for its request id, if that request went to this server."""
        def destinations(header):
            entry = self._into.pop(header.get("id"), None)
            if entry is None or entry[0] != server:
                return None
            return entry[1]
        return destinations

    def _post(self, item: tuple) -> None:
        """(A channel's reader thread) hand (server, header, arrays, nbytes), or
        (server, None, error, 0) when the channel ended, to the thread that waits
        (:meth:`_from_channels`)."""
        self._inbox.put(item)
        self._wakeup.set()

    def request(self, server: int, op: str, what: str, arrays=(), on_reply=None,
                track: bool = False, stage=None, shared=None, sequenced: bool = True,
                in_place: bool = False, into=None, **fields):
        """Send one request; returns (request id, zmq MessageTracker or None).

        ``stage``: keys (e.g. chunk ids) naming ``arrays``; over shared memory the
        arrays are copied into this worker's slots for those keys and sent as
        references (unless a slot is still busy with an earlier request). ``shared``:
        where ``arrays`` already lie in our shared memory (see protocol.encode).
        ``sequenced=False``: no per-connection sequence number (a request that may
        fail before the server's sequencer sees it, answered before anything else).
        ``in_place``: arrays that already lie in our shared memory (see
        :meth:`shared_empty`) are sent by reference without staging; the caller must
        leave them unchanged until the reply. ``into``: where the reply's arrays go
        (one contiguous array each); a large reply over a data channel is received
        straight into them, and ``on_reply`` then gets these same objects."""
        if len(self._pending) >= MAX_IN_FLIGHT and not self._progressing:
            self._progress(0, what)   # take in what arrived; never wait (see MAX_IN_FLIGHT)
        req_id = next(self._ids)
        staged = None
        if self.transports[server] == "shm":
            if on_reply is not None:
                fields["shm_reply"] = True     # values may come back as references
            if stage is not None and arrays:
                big = [a.nbytes >= self.config.zero_copy_bytes for a in arrays]
                located = [self._arena.locate(a) if b else None for a, b in zip(arrays, big)] \
                    if in_place else None
                if located is not None and all(p is not None for p, b in zip(located, big) if b):
                    shared = located         # the caller's own shared memory: no copy
                else:
                    arrays, shared, staged = self._stage(server, stage, arrays, big)
        via = self._channels[server]
        channel = via is not None and via.broken is None and into is not None and \
            sum(a.nbytes for a in into) >= self.config.channel_bytes
        if channel:
            fields["channel"] = True
            self._into[req_id] = (server, list(into))
        if sequenced:
            fields["seq"] = self._seq[server]
        track = track and shared is None
        try:
            frames = self._encode(server, what, {"op": op, "id": req_id, "src": self.rank, **fields},
                                  arrays, shared)
            tracker = self._send_frames(server, frames, track, what)
        except BaseException:
            self._into.pop(req_id, None)
            raise
        if sequenced:
            # taken only now that the request is on its way: one that could not be
            # encoded or sent leaves no gap that would hold back the later ones
            self._seq[server] += 1
        self.bytes_sent += sum(memoryview(f).nbytes for f in frames)
        self._pending[req_id] = _Request(server, what, on_reply, staged=staged is not None,
                                         urgent=op == ops.WRITE, channel=channel)
        if staged is not None:
            self._slots.hold(staged, req_id)
        return req_id, (tracker if track else None)

    def _encode(self, server: int, what: str, header: dict, arrays, shared) -> list:
        """The frames of one request, or InvalidArgumentError (before anything is
        sent) when it cannot be encoded or a frame exceeds what the server accepts."""
        try:
            frames = encode(header, arrays, shared)
        except (TypeError, ValueError, OverflowError) as e:
            raise InvalidArgumentError(
                f"{what}: the request to server {server} cannot be encoded ({type(e).__name__}: {e}); "
                "fields may hold only str, int, float, bool, None, bytes, lists and dicts") from None
        if len(frames[0]) > MAX_HEADER_BYTES:
            raise InvalidArgumentError(f"{what}: the request's header has {len(frames[0])} bytes, more "
                                       f"than the {MAX_HEADER_BYTES} a server accepts")
        largest = max((memoryview(f).nbytes for f in frames[1:]), default=0)
        if largest > self.config.max_message_bytes:
            raise InvalidArgumentError(f"{what}: a buffer of {largest} bytes exceeds "
                                       f"KVSTORE_MAX_MESSAGE_BYTES={self.config.max_message_bytes}")
        return frames

    def _send_frames(self, server: int, frames, track: bool, what: str):
        """Send one message without blocking for ever: when the socket has no room
        (the server reads more slowly than we send), wait for room until the deadline."""
        sock = self._socks[server]
        deadline = None
        while True:
            try:
                return sock.send_multipart(frames, zmq.NOBLOCK, copy=False, track=track)
            except zmq.Again:
                pass
            self._check_abort()
            now = time.monotonic()
            deadline = deadline or now + self.config.timeout
            if now > deadline:
                self.failure = f"{what}: server {server} took no request for {self.config.timeout:g}s"
                raise DeadlineError(
                    f"{what}: server {server} ({self.servers[server]}) took no request for "
                    f"{self.config.timeout:g}s (its queue stayed full: it is stuck or much slower "
                    "than this worker); raise KVSTORE_TIMEOUT if it is just slow")
            sock.poll(SLICE * 1000, zmq.POLLOUT)

    def writable(self, server: int, arrays) -> list[int]:
        """Indices of ``arrays`` worth writing into ``server``'s sums (see
        :meth:`write_in`): large ones, not already in our shared memory (which the
        server reads in place), for a server reached through shared memory."""
        if self.transports[server] != "shm" or server in self._no_write_in:
            return []
        return [i for i, a in enumerate(arrays)
                if a.nbytes >= self.config.zero_copy_bytes and self._arena.locate(a) is None]

    def write_in(self, server: int, what: str, keys, arrays, on_reply, later: list) -> int:
        """Contribute ``arrays`` (for the chunks ``keys``) to a shared-memory server's
        sync rounds by writing them into its sums: a ``write`` request, whose grant
        says per chunk whether to copy or add into which buffer of the server's
        memory; once that is done, a ``written`` request, whose reply (the values,
        as for a pushpull) goes to ``on_reply`` and whose id is appended to ``later``.
        The grant is handled whenever this worker next waits. Returns the write's id."""
        def granted(header, targets):
            modes = header.get("modes")
            refs = (header.get("shm") or {}).get("refs") or []
            if not (isinstance(modes, list) and len(modes) == len(targets) == len(arrays)
                    and len(refs) == len(targets) and all(r is not None for r in refs)):
                raise ProtocolError(f"{what}: server {server} granted a write that does not "
                                    "point into its shared memory chunk by chunk")
            for mode, target, a in zip(modes, targets, arrays):
                if target.dtype != a.dtype or target.size != a.size or mode not in ("copy", "add"):
                    raise ProtocolError(f"{what}: server {server} granted {mode!r} into "
                                        f"{target.size} x {target.dtype}, for {a.size} x {a.dtype}")
                if mode == "copy":
                    np.copyto(target, a.reshape(-1))
                else:
                    np.add(target, a.reshape(-1), out=target)
            written = self.request(server, ops.WRITTEN, what, on_reply=on_reply, grant=header["id"])[0]
            later.append(written)
            if header["id"] in self._abandoned:   # a late grant: its values go nowhere either
                self._abandoned.add(written)
        return self.request(server, ops.WRITE, what, on_reply=granted, chunks=keys, values=True)[0]

    def shared_empty(self, size: int, dtype) -> np.ndarray:
        """A 1-D array that co-located servers can read in place (ordinary memory
        when no server is reached through shared memory)."""
        if self._arena is not None and "shm" in self.transports:
            return self._arena.alloc(size, dtype)
        return np.empty(size, dtype)

    def _stage(self, server: int, keys, arrays, big):
        """Copy the ``big`` ones of ``arrays`` into our slots: (arrays with those
        replaced by their slots, the slots' places (None: sent inline), slot keys),
        or the arrays unchanged and (None, None) when nothing is big or a slot is
        still busy. Arrays under KVSTORE_ZERO_COPY_BYTES travel in the message: for
        a small key that is faster than a reference (less per-message work on both
        sides) and ZeroMQ copies them anyway."""
        index = [i for i, b in enumerate(big) if b]
        if not index:
            return arrays, None, None
        slot_keys = [(server, _hashable(keys[i])) for i in index]
        staged = self._slots.fill(slot_keys, [arrays[i] for i in index])
        if staged is None:
            return arrays, None, None
        arrays, shared = list(arrays), [None] * len(arrays)
        for i, slot in zip(index, staged):
            arrays[i], shared[i] = slot, self._arena.locate(slot)
        return arrays, shared, slot_keys

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
        try:
            while any(i in self._pending for i in ids):
                self._progress(SLICE, what)
                self.raise_errors()
                if time.monotonic() > deadline:
                    open_ids = [i for i in ids if i in self._pending]
                    late = sorted({self._pending[i].server for i in open_ids})
                    names = ", ".join(f"server {s} ({self.servers[s]})" for s in late)
                    awaited = _listing([self._pending[i].what for i in open_ids])
                    self.failure = f"{what}: no reply from {names} within {self.config.timeout:g}s"
                    raise DeadlineError(
                        f"{what}: no reply from {names} within {self.config.timeout:g}s to the "
                        f"{awaited}. In dist_sync a round completes only when every worker "
                        "pushed the key; raise KVSTORE_TIMEOUT if the job is just slow")
        except BaseException:
            self._abandon(ids)        # (drops those due on data channels)
            self._abandoned.update(i for i in ids if i in self._pending)
            raise
        self.raise_errors()

    def _abandon(self, ids) -> None:
        """The caller of a wait for ``ids`` gets an exception while some of them are
        still due on data channels: close those channels, so that no reply is
        written into the caller's arrays after the call has returned. Those
        requests are dropped; other requests due on the same channels fail with
        NodeFailedError at their next wait. Later replies from those servers come
        through ZeroMQ."""
        servers = {self._pending[i].server for i in ids if i in self._pending and self._pending[i].channel}
        for server in sorted(servers):
            self._channels[server].close()      # joins the reader: nothing is written after this
            self._channels[server] = None
            self._drop_channel_requests(server, "abandoned when an earlier call to server "
                                        f"{server} failed and closed its data channel", spare=ids)
            log.warning("[worker:%d] closed the data channel to server %d: a call waiting on "
                        "it failed", self.rank, server)

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

    def progress(self, what: str) -> None:
        """Handle the replies that have arrived, without waiting (e.g. grants to write,
        which other workers wait on, between the sends of one call)."""
        self._progress(0, what)

    def _progress(self, timeout: float, what: str) -> None:
        self._progressing = True
        try:
            self._take_replies(timeout, what)
        finally:
            self._progressing = False

    def _take_replies(self, timeout: float, what: str) -> None:
        self._check_abort()
        received = []
        for sock, _ in self._poller.poll(timeout * 1000):
            if self._wakeup is not None and sock == self._wakeup.fd:
                self._from_channels()
                continue
            while True:
                try:
                    received.append((self._index[sock], sock.recv_multipart(zmq.NOBLOCK, copy=False)))
                except zmq.Again:
                    break
        # grants to write first: other workers wait for our turn in those rounds, while
        # copying results out (the other replies) keeps only ourselves waiting
        if len(received) > 1 and any(r.urgent for r in self._pending.values()):
            received.sort(key=lambda item: not self._urgent(item[1]))
        for server, frames in received:
            self._on_reply(server, frames)

    def _urgent(self, frames) -> bool:
        try:
            req = self._pending.get(msgpack.unpackb(frames[0].bytes).get("id"))
        except Exception:          # malformed: _on_reply reports it
            return False
        return req is not None and req.urgent

    def _from_channels(self) -> None:
        """Handle what the data channels' readers delivered."""
        self._wakeup.clear()
        try:
            while True:
                try:
                    server, header, arrays, nbytes = self._inbox.get_nowait()
                except queue.Empty:
                    return
                if self._channels[server] is None:
                    continue                  # abandoned (see _abandon): drop what it left
                if header is None:
                    self._channel_failed(server, arrays)
                else:
                    self.bytes_received += nbytes
                    self._complete(server, header, arrays)
        finally:
            if not self._inbox.empty():       # a handler raised: the rest waits for the next call
                self._wakeup.set()

    def _channel_failed(self, server: int, error: Exception) -> None:
        """A data channel ended: every request in flight on it fails (its server
        is most likely gone); later requests to that server use ZeroMQ."""
        log.warning("[worker:%d] the data channel to server %d ended: %s", self.rank, server, error)
        self._drop_channel_requests(
            server, f"the data channel to server {server} ({self.servers[server]}) broke: {error}")

    def _drop_channel_requests(self, server: int, why: str, spare=()) -> None:
        """Forget every request whose reply is due on ``server``'s data channel; each
        not in ``spare`` fails with NodeFailedError(why) at the next wait."""
        for req_id, req in list(self._pending.items()):
            if req.server == server and req.channel:
                del self._pending[req_id]
                self._into.pop(req_id, None)
                if req_id not in spare:
                    self._orphan_errors.append(NodeFailedError(f"{req.what}: {why}"))

    def _on_reply(self, server: int, frames) -> None:
        try:
            header, arrays = decode(frames, self.config.max_message_bytes, resolve=self._mapper.view)
        except ProtocolError as e:
            req = self._pending.pop(getattr(e, "request_id", None), None)
            if req is None:
                raise ProtocolError(f"malformed reply from server {server}: {e}") from e
            if req.staged:                  # that request failed; its slots are free again
                self._slots.release(e.request_id)
            self._orphan_errors.append(ProtocolError(f"{req.what}: malformed reply from server "
                                                     f"{server}: {e}"))
            return
        self.bytes_received += sum(f.buffer.nbytes for f in frames)
        self._complete(server, header, arrays)

    def _complete(self, server: int, header: dict, arrays: list) -> None:
        req = self._pending.get(header["id"])
        if req is None or req.server != server:
            log.warning("reply from server %d to unknown request %s", server, header["id"])
            return
        del self._pending[header["id"]]
        self._into.pop(header["id"], None)
        if req.staged:   # the server has finished with our slots (the round is applied)
            self._slots.release(header["id"])
        abandoned = header["id"] in self._abandoned
        try:
            if header["op"] == ops.ERROR:
                error = RemoteError(f"server {server}", str(header.get("kind")), str(header.get("message")))
                error.args = (f"{req.what}: {error}",)
                if abandoned:        # its call has raised already
                    log.warning("[worker:%d] late error for a call that had failed: %s", self.rank, error)
                else:
                    self._orphan_errors.append(error)
            elif req.on_reply is not None and (req.urgent or not abandoned):
                req.on_reply(header, arrays)
        finally:
            self._abandoned.discard(header["id"])

    def close(self) -> None:
        for via in self._channels:
            if via is not None:
                via.close()
        for sock in self._socks:
            sock.close(linger=0)
        self._ctx.term()
        if self._wakeup is not None:
            self._wakeup.close()
        if self._arena is not None:
            self._arena.close()
        self._mapper.close()


def _listing(whats: list) -> str:
    """'push of key 3', or 'push of key 3, pull of key 4 and 7 more requests'."""
    distinct = list(dict.fromkeys(whats))
    shown = ", ".join(distinct[:3])
    more = len(distinct) - 3
    return shown + (f" and {more} more request{'s' if more > 1 else ''}" if more > 0 else "")


def _hashable(key):
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key
