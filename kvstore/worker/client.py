"""Worker side of the data plane: request ids, fan-out to servers, replies, deadlines.

A :class:`Client` belongs to the thread that uses its store (like MXNet's
KVStore, a store is not thread-safe). Requests are sent at once; replies are
collected whenever a call waits. A push does not wait for its acknowledgement,
but an error in it is raised by the next call that waits.

Each server is reached through a link (:mod:`kvstore.transport.links`: shared
memory, ipc or tcp), which decides what a request's buffers become and how its
reply arrives; the client owns a ZeroMQ DEALER per server and all else about requests.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import msgpack
import numpy as np
import zmq

from tracker.control.membership import Membership

from ..config import Config
from ..errors import DeadlineError, InvalidArgumentError, NodeFailedError, ProtocolError, RemoteError
from ..protocol import encode, ops
from ..protocol.codec import MAX_HEADER_BYTES
from ..protocol.layouts import Described, LayoutMemo
from ..timeline import Timeline
from ..transport import Advert, memory
from ..transport.links import PLAIN, RequestOptions
from ..transport.links.opening import open_links
from ..transport.pace import Pace
from ..transport.traffic import Traffic
from ..transport.sockets import Sockets
from .failover import RESENT, Failover

if TYPE_CHECKING:
    from ..devices.base import Accelerators

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
    options: RequestOptions    # into, on_reply, on_error, urgent (Client.request's)
    aside: bool = False        # its reply comes by the link's aside path (a data channel)
    reads: frozenset | None = None   # the chunks whose values its reply carries


# the names of RequestOptions' fields: refused as header fields
_OPTIONS = frozenset(RequestOptions.__dataclass_fields__)

# requests that may complete a round, changing a chunk's value on a sync server
CHANGES_VALUES = frozenset({ops.PUSH, ops.PUSHPULL, ops.WRITE})


def _chunk_set(chunks) -> frozenset | None:
    """A request's ``chunks`` field ([key, index] lists) as a set of tuples."""
    if not chunks:
        return None
    return frozenset(tuple(c) if isinstance(c, list) else c for c in chunks)


class Client:
    """Connections from one worker to every server."""

    def __init__(self, config: Config, membership: Membership, servers: list[str], rank: int,
                 accelerators: Accelerators | None = None):
        self.config = config
        self.membership = membership
        self.rank = rank
        # the process's GPUs, when its store works on them: links that move device
        # memory (cuda_ipc) use them; None: every link moves host memory
        self.accelerators = accelerators
        self._socks = Sockets(config, len(servers))   # the DEALER of each server
        self.links: list = [None] * len(servers)    # by server rank (replacements join later: replicas)
        self.num_shares = len(servers)              # the job's servers: each holds a share of the chunks
        self._shared: dict = {}                     # what links of one kind share (shared())
        self._ids = itertools.count(1)
        self._seq = [0] * len(servers)   # per-connection order: the server handles each once, in order
        self._sent: LayoutMemo[Described] = LayoutMemo()      # its requests' layouts, packed once per content (kvstore/protocol/layouts.py)
        self._pending: dict[int, _Request] = {}
        # the ids of those whose replies read chunks' values (a push waits for them: see
        # _read_before_changing); a superset of the pending ones, pruned as it is read
        self._readers: set[int] = set()
        self._progressing = False   # inside progress (a grant's handler sends `written`)
        self._orphan_errors: list[Exception] = []  # failed requests nobody waited for yet
        # requests of calls that raised before their replies came: those replies must
        # not reach the call's outputs any more (grants to write are still honoured,
        # or the other workers' rounds would wait for us forever)
        self._abandoned: set[int] = set()
        self.failure: str | None = None   # set once a wait gave up: the connection state is unknown
        self.traffic = Traffic()  # headers + array bytes, by transport (shared memory too)
        self.pace = Pace(self.links)   # message size for network links (KVSTORE_PIPELINE_BYTES=auto)
        self.timeline: Timeline | None = None   # KVSTORE_TIMELINE: the store's, closed with us
        # KVSTORE_REPLICAS=1: which server serves each share now, push numbers, requests
        # kept until answered (kvstore.worker.failover); None: each share is its server
        self.failover = Failover(len(servers)) if config.replicas else None
        try:
            open_links(self, self._socks, [Advert.parse(a) for a in servers])
        except BaseException:   # e.g. the job aborted meanwhile: leave no sockets behind
            self.close()
            raise
        for server, link in enumerate(self.links):
            if link.fd is not None:                 # its own reader has replies: wake us
                self._socks.watch(link.fd, server)
        if config.malloc_tuning and any(link.frames for link in self.links):
            memory.tune()          # replies arrive as large frames: keep their memory warm

    @property
    def servers(self) -> list[str]:   # the URL each server's socket is connected to
        return [link.url for link in self.links]

    @property
    def reads_device(self) -> bool:
        """Whether every server's link moves device arrays itself (pushes by reference,
        replies into device outputs): then a call's device values need not cross to
        the host (kvstore.worker.exchange)."""
        return bool(self.links) and all(link.reads_device for link in self.links)

    @property
    def transports(self) -> list[str]:   # each server's: "tcp", "ipc", "shm" or "cuda_ipc"
        return [link.kind for link in self.links]

    def shared(self, name: str, make: Callable):
        """What the links of one transport share (e.g. the shared-memory arena): made on first use, closed with us."""
        if name not in self._shared:
            self._shared[name] = make()
        return self._shared[name]

    def pushed_by_host(self, chunks) -> None:
        """This worker's push of ``chunks`` goes in its host's sum, which the group's
        leader pushes (kvstore.hostgroup): with replicated servers it counts among this
        worker's pushes of each chunk too (a server numbers a chunk's rounds per worker),
        so that its own later pushes carry the numbers the servers expect."""
        if self.failover is not None:
            self.failover.number(ops.PUSHPULL, chunks)

    def request(self, server: int, op: str, what: str, arrays=(), options: RequestOptions = PLAIN,
                **fields) -> tuple[int, zmq.MessageTracker | None]:
        """Send one request ``op`` to ``server`` with ``arrays`` and the header
        ``fields``; returns (request id, ZeroMQ MessageTracker with ``options.track``,
        else None). ``what`` names the call in errors. ``options``
        (:class:`~kvstore.transport.links.RequestOptions`): what the arrays may become,
        where the reply goes (``into``, ``on_reply``, ``on_error``), its order.
        Raises InvalidArgumentError, before anything is sent, when it cannot be encoded."""
        if not _OPTIONS.isdisjoint(fields):     # e.g. a caller written for keyword options
            raise TypeError(f"Client.request: {sorted(_OPTIONS.intersection(fields))} are RequestOptions "
                            "fields, not header fields")
        if len(self._pending) >= MAX_IN_FLIGHT and not self._progressing:
            self.progress(what)   # take in what arrived; never wait (see MAX_IN_FLIGHT)
        share = server
        if self.failover is not None:       # replicated servers: where the share is served now
            self._fail_over()
            server = self.failover.route(share)
            arrays = self.failover.owned(arrays)
            rounds = self.failover.number(op, fields.get("chunks") or
                                          ([fields["chunk"]] if op in (ops.PUSH_ROWS, ops.PUSH_DYN) else None))
            if rounds is not None:
                fields["rounds"] = rounds
            if self.failover.epoch:       # a server that has not heard of this book yet waits for it
                fields["book"] = self.failover.epoch
            if op in (ops.INIT, ops.INIT_ROWS, ops.INIT_DYN) and server != share:   # a dead server's chunks: saved as its part
                fields["share"] = share
        into = options.into
        # (only requests that change values or read them need their chunks as a set)
        chunks = _chunk_set(fields.get("chunks")) if op in CHANGES_VALUES or into is not None else None
        if op in CHANGES_VALUES and chunks:
            self._read_before_changing(server, chunks, what)
        req_id = next(self._ids)
        link = self.links[server]
        payload = _nbytes(arrays)         # counted as sent whichever way the link moves them
        try:
            arrays, shared, aside = link.prepare(req_id, arrays, fields, options)
            if options.sequenced:
                fields["seq"] = self._seq[server]
            track = options.track and shared is None
            frames = self._encode(server, what, {"op": op, "id": req_id, "src": self.rank, **fields},
                                  arrays, shared)
            tracker = self._send_frames(server, frames, track, what)
        except BaseException:
            link.release(req_id)
            raise
        if options.sequenced:
            # taken only now that the request is on its way: one that could not be
            # encoded or sent leaves no gap that would hold back the later ones
            self._seq[server] += 1
        self.traffic.sent(link.kind, memoryview(frames[0]).nbytes + memoryview(frames[1]).nbytes + payload)
        reads = _chunk_set(options.reads) if options.reads is not None else (chunks if into is not None else None)
        self._pending[req_id] = _Request(server, what, options, aside, reads)
        if reads is not None:
            self._readers.add(req_id)
        if self.failover is not None:
            self.failover.keep(req_id, share, op, fields, arrays)
        if self.timeline is not None:
            self.timeline.request(req_id, server, op, fields.get("chunks"), payload)
        if options.follows in self._abandoned:
            self._abandoned.add(req_id)
        return req_id, (tracker if track else None)

    def _read_before_changing(self, server: int, chunks: frozenset, what: str) -> None:
        """Before a request that may complete a round of ``chunks`` (a push): take in the
        replies of this worker's earlier requests that read those chunks' values from
        ``server``. A sync reply may point at the server's value itself (shared or
        device memory, not a copy): it must be read before this worker's next round
        can change it. (Replies already produced are sent; other workers' pushes
        never wait on this worker's later ones, so this cannot deadlock.)"""
        while True:     # a write's grant sends its `written`, which reads them in turn
            # (asynchronous pushes keep up to MAX_IN_FLIGHT requests pending: only readers are looked at)
            self._readers = {rid for rid in self._readers if rid in self._pending}
            earlier = [rid for rid in self._readers if (req := self._pending[rid]).server == server
                       and req.reads is not None and not req.reads.isdisjoint(chunks)]
            if not earlier:
                return
            self.wait(earlier, what, raising=False)   # their errors stay for their own calls

    def request_all(self, op: str, what: str, on_reply=None, **fields) -> list[dict]:
        """The same request to every server; waits for all. Returns their reply
        headers, by server rank (an error reply raises, naming its server);
        ``on_reply(header, arrays)`` also sees each reply as it comes."""
        replies: dict[int, dict] = {}

        def keeper(server: int):
            def keep(header, arrays):
                replies[server] = header
                if on_reply is not None:
                    on_reply(header, arrays)
            return keep
        # (replicated servers: each live server once, by the first share it serves; a dead
        # one's share answers as its new server, a replacement's as the shares it took over.
        # A server can start serving a share while this call waits (a death: _fail_over drops
        # the dead one's request): it is asked then, if it was not already)
        route = self.failover.route if self.failover is not None else (lambda s: s)
        sent: dict[int, int] = {}      # server -> the id of its request
        while True:
            first: dict[int, int] = {}
            for share in range(self.num_shares):
                first.setdefault(route(share), share)
            for server, share in sorted(first.items()):
                if server not in sent:
                    sent[server] = self.request(share, op, what, (), RequestOptions(on_reply=keeper(server)),
                                                **fields)[0]
            if all(server in replies for server in first):
                return [replies[route(s)] for s in range(self.num_shares)]
            self.wait([sent[server] for server in first if server not in replies], what)

    def _encode(self, server: int, what: str, header: dict, arrays, shared) -> list:
        """The frames of one request, or InvalidArgumentError (before anything is
        sent) when it cannot be encoded or a frame exceeds what the server accepts."""
        try:
            # small buffers in one frame; the buffers' fields in a frame of their own, which the
            # server decodes once per content (kvstore/protocol/layouts.py)
            frames = encode(dict(header, pack=True), arrays, shared, layout=True, sent=self._sent)
        except (TypeError, ValueError, OverflowError) as e:
            raise InvalidArgumentError(
                f"{what}: the request to server {server} cannot be encoded ({type(e).__name__}: {e}); "
                "fields may hold only str, int, float, bool, None, bytes, lists and dicts") from None
        for part, frame in (("header", frames[0]), ("layout", frames[1])):
            if len(frame) > MAX_HEADER_BYTES:
                raise InvalidArgumentError(f"{what}: the request's {part} has {len(frame)} bytes, more "
                                           f"than the {MAX_HEADER_BYTES} a server accepts")
        largest = max((memoryview(f).nbytes for f in frames[2:]), default=0)
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

    def shared_empty(self, size: int, dtype):
        """A 1-D array that co-located servers can read in place (ordinary memory
        when no link has such memory)."""
        for link in self.links:
            array = link.empty(size, dtype)
            if array is not None:
                return array
        return np.empty(size, dtype)

    def shared_device_empty(self, index: int, size: int, dtype):
        """A 1-D array on device ``index`` that co-located servers can read in place,
        or None when no link reads device memory (kvstore/devices/arena.py)."""
        for link in self.links:
            array = link.device_empty(index, size, dtype)
            if array is not None:
                return array
        return None

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

    def wait(self, ids, what: str, raising: bool = True) -> None:
        """Wait for replies to ``ids``; raise the first error among them or an earlier
        push's (``raising=False``: at the next wait), a DeadlineError, or NodeFailedError."""
        ids = list(ids)
        deadline = time.monotonic() + self.config.timeout
        try:
            while any(i in self._pending for i in ids):
                self.progress(what, SLICE)
                if raising:
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
            self.abandon(ids)
            raise
        if raising:
            self.raise_errors()

    def abandon(self, ids) -> None:
        """The call that sent ``ids`` raises: their replies no longer reach its outputs.
        Those still due on a link's aside path (a data channel) are dropped and the path
        closed (other requests due on it fail with NodeFailedError at their next wait;
        later replies come through ZeroMQ)."""
        servers = {self._pending[i].server for i in ids if i in self._pending and self._pending[i].aside}
        for server in sorted(servers):
            link = self.links[server]
            link.abandon()
            self._drop_aside(server, f"abandoned when an earlier call to server {server} failed "
                             f"and closed its {link.aside}", spare=ids)
        self._abandoned.update(i for i in ids if i in self._pending)

    def _drop_aside(self, server: int, why: str, spare=()) -> None:
        """Forget every request whose reply is due on ``server``'s aside path; each
        not in ``spare`` fails with NodeFailedError(why) at the next wait."""
        for req_id, req in list(self._pending.items()):
            if req.server == server and req.aside:
                del self._pending[req_id]
                self.links[server].release(req_id)
                if req_id not in spare:
                    self._orphan_errors.append(NodeFailedError(f"{req.what}: {why}"))

    def _fail_over(self) -> None:
        """Replicated servers: when the scheduler's book says a server died, send
        every request it had not answered again, in order, to the server that serves
        its share now (kvstore.worker.failover); the numbers of pushes let that server
        apply no round twice."""
        assert self.failover is not None
        dead = self.failover.moved(self.membership.servers)
        if not dead:
            return
        for server in self.failover.live():      # a replacement serves a share now: connect to it
            if server >= len(self.links):
                self._add_server(server, self.failover.advert(server))
        # the pushes it answered before its backup had them, and those it had not
        # answered, in the order they were first sent (request ids); the former's
        # replies go nowhere (their calls have returned)
        for req_id, what in self.failover.unconfirmed(dead):
            self._pending[req_id] = _Request(RESENT, what, PLAIN)
        again = sorted(req_id for req_id, req in self._pending.items() if req.server in dead or req.server == RESENT)
        for req_id in again:
            req = self._pending[req_id]
            kept = self.failover.kept(req_id)
            if kept is None:
                if req.server == RESENT:
                    del self._pending[req_id]
                continue
            share, op, fields, arrays = kept
            if not fields.get("chunks") and "chunk" not in fields and op != ops.SET_STATES:
                # a request to every server (set_optimizer, configure, get_states, ...): the
                # server that serves the dead one's share got its own copy; request_all
                # takes that one's reply for both (sent again, it would apply it twice).
                # (set_states carries its share's states: sent again, setting them twice
                # sets the same values)
                del self._pending[req_id]
                self.failover.answered(req_id)
                continue
            server = self.failover.route(share)
            log.warning("[worker:%d] a server died: sending request %d (%s) again to server %d",
                        self.rank, req_id, req.what, server)
            if op in (ops.INIT, ops.INIT_ROWS, ops.INIT_DYN):
                fields = {**fields, "share": share}
            frames = self._encode(server, req.what, {"op": op, "id": req_id, "src": self.rank, **fields,
                                                     "book": self.failover.epoch, "seq": self._seq[server]},
                                  arrays, None)
            self._send_frames(server, frames, False, req.what)
            self._seq[server] += 1
            req.server = server

    def _add_server(self, server: int, advert: str) -> None:
        """(Replicated servers) a link to replacement server ``server`` (``--restart-servers``),
        which a death made the server of a share: plain tcp, like every link of a
        replicated job (kvstore.worker.failover.replicated_config)."""
        assert self.failover is not None
        new = range(len(self.links), server + 1)     # (replacements before it too: no gaps)
        self.links += [None] * len(new)
        self._seq += [0] * len(new)
        self._socks.grow(server + 1)
        open_links(self, self._socks, {s: Advert.parse(advert if s == server else self.failover.advert(s))
                                             for s in new})
        log.warning("[worker:%d] server %d (a replacement) serves a share now: connected to %s",
                    self.rank, server, self.links[server].url)

    def settle(self, what: str) -> None:
        """(Replicated servers) wait until every push a server answered before its
        backups had it is on them: a ``durable`` request to each such server, whose
        reply leaves its gate once they acknowledged all it applied; pushes a death
        made this worker send again are awaited first (and then settled in turn).
        So a worker that leaves, or waits on the others through the scheduler (a
        barrier), holds no push that only it could send again."""
        while self.failover is not None:
            again = self.failover.resent()
            if again:
                self.wait(again, what)
                continue
            shares = self.failover.unsettled()
            if not shares:
                return
            self.wait([self.request(share, ops.DURABLE, what)[0] for share in shares], what)

    def replied(self, ids) -> bool:   # every reply (or error) of ``ids`` is in
        return not any(i in self._pending for i in ids)

    def flush(self, what: str) -> None:
        """Wait for every request in flight (e.g. pushes) and raise their errors; a host
        group's calls are the exchange's (kvstore.worker.exchange.Exchange.flush)."""
        self.wait(list(self._pending), what)

    def raise_errors(self) -> None:
        if self._orphan_errors:
            error, self._orphan_errors = self._orphan_errors[0], []
            raise error

    def _check_abort(self) -> None:
        if self.membership.aborted.is_set():
            raise NodeFailedError(f"the job was aborted: {self.membership.abort_reason}")

    def progress(self, what: str, timeout: float = 0) -> None:
        """Handle the replies that have arrived (e.g. grants to write, which other workers
        wait on, between the sends of one call), waiting up to ``timeout`` for the first."""
        self._progressing = True      # a grant's handler sends `written`: no progress inside
        try:
            self._check_abort()
            if self.failover is not None:
                self._fail_over()
            received = []
            for server, sock in self._socks.poll(timeout):
                if sock is None:                 # a link's own reader has something
                    self._from_aside(server)
                    continue
                while True:
                    try:
                        received.append((server, sock.recv_multipart(zmq.NOBLOCK, copy=False)))
                    except zmq.Again:
                        break
            # grants to write first: other workers wait for our turn in those rounds, while
            # copying results out (the other replies) keeps only ourselves waiting
            if len(received) > 1 and any(r.options.urgent for r in self._pending.values()):
                received.sort(key=lambda item: not self._urgent(item[1]))
            for server, frames in received:
                self._on_reply(server, frames)
        finally:
            self._progressing = False

    def _urgent(self, frames) -> bool:
        try:
            req = self._pending.get(msgpack.unpackb(frames[0].bytes).get("id"))
        except Exception:          # malformed: _on_reply reports it
            return False
        return req is not None and req.options.urgent

    def _from_aside(self, server: int) -> None:
        """Handle what ``server``'s link received on its aside path."""
        def complete(header, arrays, nbytes):
            self.traffic.received("channel", nbytes)
            self._complete(server, header, arrays)

        def failed(why):   # every request in flight there fails (its server is most likely gone)
            self._drop_aside(server, why)
        self.links[server].drain(complete, failed)

    def _on_reply(self, server: int, frames) -> None:
        link = self.links[server]
        try:
            header, arrays = link.decode(frames)
        except ProtocolError as e:
            req = self._pending.pop(e.request_id, None) if e.request_id is not None else None
            if req is None:
                raise ProtocolError(f"malformed reply from server {server}: {e}") from e
            link.release(e.request_id)      # that request failed; what it held is free
            (req.options.on_error or self._orphan_errors.append)(
                ProtocolError(f"{req.what}: malformed reply from server {server}: {e}"))
            return
        # a write grant's buffers are where to write in the server's memory, not data
        data = 0 if header.get("write_in") else _nbytes(arrays)
        self.traffic.received(link.kind, frames[0].buffer.nbytes + data)
        self._complete(server, header, arrays)

    def _complete(self, server: int, header: dict, arrays: list) -> None:
        if self.failover is not None:     # pushes it answered ahead of its backups may be on them now
            self.failover.durable(server, header.get("durable"))
        req = self._pending.get(header["id"])
        if req is None or req.server != server:
            # (replicated servers: a dead server's late reply to a request sent again elsewhere)
            (log.debug if req is not None and self.failover is not None else log.warning)(
                "reply from server %d to unknown request %s", server, header["id"])
            return
        del self._pending[header["id"]]
        if self.failover is not None:
            self.failover.answered(header["id"], server, header, req.what)
        if self.timeline is not None:
            self.timeline.reply(header["id"], header["op"] == ops.ERROR)
        link = self.links[server]
        link.release(header["id"])   # e.g. the server has finished with our slots
        abandoned = header["id"] in self._abandoned
        options = req.options
        try:
            if header["op"] == ops.ERROR:
                error = RemoteError(f"server {server}", str(header.get("kind")), str(header.get("message")))
                error.args = (f"{req.what}: {error}",)
                if abandoned:        # its call has raised already
                    log.warning("[worker:%d] late error for a call that had failed: %s", self.rank, error)
                else:
                    (options.on_error or self._orphan_errors.append)(error)
            elif options.urgent or not abandoned:
                if options.into is not None:
                    link.deliver(arrays, options.into)
                if options.on_reply is not None:
                    options.on_reply(header, arrays)
        finally:
            self._abandoned.discard(header["id"])

    def forget(self) -> None:
        """Forget what the links kept of repeated calls, and the requests' layouts (the
        store forgot its call plans)."""
        self._sent.clear()
        for link in self.links:
            link.forget()

    def close(self) -> None:
        if self.timeline is not None:
            self.timeline.close({"comm_stats": self.traffic.by_transport()})
        for link in self.links:
            if link is not None:
                link.close()
        self._socks.close()
        for thing in self._shared.values():
            thing.close()


def _nbytes(arrays) -> int:
    try:
        return sum(a.nbytes for a in arrays)
    except AttributeError:        # (bytes-like buffers)
        return sum(a.nbytes if hasattr(a, "nbytes") else memoryview(a).nbytes for a in arrays)


def _listing(whats: list) -> str:
    """'push of key 3', or 'push of key 3, pull of key 4 and 7 more requests'."""
    distinct = list(dict.fromkeys(whats))
    more = len(distinct) - 3
    return ", ".join(distinct[:3]) + (f" and {more} more request{'s' if more > 1 else ''}" if more > 0 else "")
