"""kvstore.server.dataplane on its own: :class:`DataPlane`, the server's endpoints
composed, with the real endpoints of the registry bound to a real ZeroMQ ROUTER on
127.0.0.1 (random ports) and a worker's DEALER on the other end.

Pinned from its docstring: ``bind`` binds every served transport on the one socket
and makes the advert; ``alloc`` hands out memory the shm endpoint shares;
``decode`` reads a request (references resolved, each into its sender's memory
only: tests/transport/test_memory_owners.py has the owner rules); ``intercept``
answers each transport's handshake op by its endpoint and passes the rest on;
``reply``/``encode`` send a reply the first way an endpoint takes it, else plain
frames; within ``batch`` a reply value left on the device is downloaded once.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import zmq

from kvstore.config import Config
from kvstore.devices import HostDevice
from kvstore.errors import ProtocolError
from kvstore.protocol import decode, encode, ops
from kvstore.server.backend import DeviceBackend
from kvstore.server.dataplane import DataPlane
from kvstore.transport import Advert, channel, shm
from kvstore.transport.endpoints import host_identity

pytestmark = pytest.mark.timeout(30)
needs_memfd = pytest.mark.skipif(not shm.available(), reason="no memfd_create on this platform")

WAIT_MS = 10_000       # a message sent on loopback arrives long before this


class Plane:
    """A DataPlane bound to a ROUTER, and DEALERs (the workers' ends) connected to it."""

    def __init__(self, transport: str, **settings):
        # no data-channel listener unless a test is about it (its thread stops at its next poll)
        settings.setdefault("data_channel", False)
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.data = DataPlane(Config(transport=transport, node_host="127.0.0.1", rank=0, **settings))
        self.advert = Advert.parse(self.data.bind(self.router))
        self.dealers: list = []

    def dealer(self, url: str):
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(url)
        self.dealers.append(sock)
        return sock

    def received(self):
        """The next request at the server: (peer identity, body frames)."""
        assert self.router.poll(WAIT_MS), "no request reached the server"
        frames = self.router.recv_multipart(copy=False)
        return frames[0].bytes, frames[1:]

    def request(self, sock, header: dict, arrays=(), shared=None):
        """Send from ``sock``; the server's decode of it: (peer, header, arrays)."""
        sock.send_multipart(encode(header, list(arrays), shared))
        peer, body = self.received()
        return (peer, *self.data.decode(peer, body))

    def reply(self, peer, header: dict, arrays: list, sock, resolve=None):
        """Send a reply through the data plane; the worker's decode of it (and its frames)."""
        self.data.reply(peer, header, arrays, lambda frames: self.router.send_multipart([peer, *frames]))
        assert sock.poll(WAIT_MS), "no reply reached the worker"
        frames = sock.recv_multipart()
        return decode(frames, resolve=resolve), frames

    def close(self):
        for sock in self.dealers:
            sock.close(linger=0)
        self.router.close(linger=0)
        self.data.close()
        self.ctx.term()


@pytest.fixture
def plane():
    made = []

    def make(transport: str = "tcp", **settings) -> Plane:
        made.append(Plane(transport, **settings))
        return made[-1]
    yield make
    for p in made:
        p.close()


@pytest.fixture
def mapper():
    """A worker's view of the server's shared memory (this process's)."""
    m = shm.Mapper()
    m.allow([os.getpid()])
    yield m
    m.close()


def test_bind_advertises_the_served_transports_and_every_address_reaches_the_one_socket(plane):
    p = plane("shm" if shm.available() else "ipc")
    names = list(p.advert.transports)
    assert names[0] == "tcp" and set(names) <= {"tcp", "shm", "ipc"}
    assert p.advert.url("tcp").startswith("tcp://127.0.0.1:")
    assert (p.advert.host, p.advert.pid) == (host_identity(""), os.getpid())
    urls = [p.advert.url(name) for name in names if p.advert.url(name)]     # (shm: control on tcp)
    for i, url in enumerate(urls):
        sock = p.dealer(url)
        peer, header, arrays = p.request(sock, {"op": ops.PUSH, "id": i, "src": 0, "chunks": [[3, 0]]},
                                         [np.arange(5, dtype=np.float32)])
        assert (header["op"], header["id"]) == (ops.PUSH, i)
        np.testing.assert_array_equal(arrays[0], np.arange(5))
        assert p.data.intercept(peer, header, arrays) is None          # for the state machine


def test_a_tcp_only_server_shares_no_memory_and_takes_no_writes(plane):
    p = plane("tcp")
    assert list(p.advert.transports) == ["tcp"]
    assert p.data.memory is None and p.data.write_in is False
    a = p.data.alloc(8, np.float32)
    assert a.shape == (8,) and a.dtype == np.float32 and not p.data.in_shared_memory(a)


@needs_memfd
def test_values_allocated_by_a_shm_server_lie_in_its_shared_memory(plane):
    p = plane("shm")
    assert p.advert.offers("shm") and p.data.write_in is True
    a = p.data.alloc(1000, np.float64)
    assert p.data.in_shared_memory(a) and not p.data.in_shared_memory(np.empty(1000))


def test_decode_refuses_what_the_codec_refuses_naming_the_problem(plane):
    p = plane("tcp", max_message_bytes=1024)
    sock = p.dealer(p.advert.url("tcp"))
    sock.send_multipart(encode({"op": ops.PUSH, "id": 1, "src": 0, "chunks": [[3, 0]]},
                               [np.zeros(1024, np.float32)]))
    peer, body = p.received()
    with pytest.raises(ProtocolError, match="1024"):              # 4096 bytes > the limit
        p.data.decode(peer, body)
    sock.send_multipart([b"\xc1 not msgpack"])
    peer, body = p.received()
    with pytest.raises(ProtocolError):
        p.data.decode(peer, body)


@pytest.mark.parametrize("channel", [True, False])
def test_the_tcp_endpoint_answers_the_channel_handshake(plane, channel):
    p = plane("tcp", data_channel=channel)
    sock = p.dealer(p.advert.url("tcp"))
    peer, header, arrays = p.request(sock, {"op": ops.CHANNEL, "id": 7, "src": 0})
    answer, extra = p.data.intercept(peer, header, arrays)
    assert (answer["op"], answer["id"], extra) == (ops.OK, 7, [])
    if channel:                      # a listener's port and a one-time token for this peer
        assert isinstance(answer["port"], int) and answer["port"] > 0 and answer["token"]
    else:
        assert answer["port"] is None
    (reply, _), _ = p.reply(peer, answer, extra, sock)
    assert reply["id"] == 7 and reply["port"] == answer["port"]


def test_a_reply_asked_for_on_the_data_channel_goes_there_and_the_others_through_zeromq(plane):
    p = plane("tcp", data_channel=True)
    sock = p.dealer(p.advert.url("tcp"))
    peer, header, arrays = p.request(sock, {"op": ops.CHANNEL, "id": 1, "src": 0})
    answer, _ = p.data.intercept(peer, header, arrays)
    ch = channel.connect("127.0.0.1", answer["port"], answer["token"], WAIT_MS / 1000)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(ch.fileno(), zmq.POLLIN)
    value = np.arange(1000, dtype=np.float32)

    def round_trip(rid: int, asks: bool) -> str:
        """One pull and its reply: where the reply arrived ("channel" or "zmq")."""
        request = {"op": ops.PULL, "id": rid, "src": 0, "chunks": [[3, 0]]}
        if asks:
            request["channel"] = True
        peer, header, arrays = p.request(sock, request)
        assert p.data.intercept(peer, header, arrays) is None
        p.data.reply(peer, {"op": ops.OK, "id": rid}, [value],
                     lambda frames: p.router.send_multipart([peer, *frames]))
        ready = dict(poller.poll(WAIT_MS))
        assert ready, "the reply arrived nowhere"
        if ch.fileno() in ready:
            got_header, got, _ = channel.read_message(ch, 1 << 20)
            where = "channel"
        else:
            got_header, got = decode(sock.recv_multipart())
            where = "zmq"
        assert got_header["id"] == rid
        np.testing.assert_array_equal(got[0], value)
        return where
    try:
        # the server registers the channel just after acknowledging it: until then a
        # reply that asked for the channel comes through ZeroMQ (each try is one round trip)
        rid = 2
        while round_trip(rid, asks=True) != "channel":
            rid += 1
            assert rid < 1000, "the data channel never took a reply"
        assert round_trip(rid + 1, asks=False) == "zmq"       # not asked for: ZeroMQ
        assert round_trip(rid + 2, asks=True) == "channel"
    finally:
        ch.close()


@needs_memfd
def test_the_shm_endpoint_answers_hello_and_its_probe_goes_by_reference(plane, mapper):
    p = plane("shm")
    p.data.joined([f"127.0.0.1:{os.getpid()}"])                  # worker 0 is this process
    sock = p.dealer(p.advert.url("tcp"))
    arena = shm.Arena("dataplane-test", segment_bytes=1 << 16)
    try:
        nonce = arena.alloc(16, np.uint8)
        nonce[:] = np.frombuffer(os.urandom(16), np.uint8)
        place = arena.locate(nonce)
        # as the shm link sends it: the probe by reference, its reply asked for by reference
        hello = {"op": ops.HELLO, "id": 1, "src": 0, "nonce": nonce.tobytes(), "shm_reply": True}
        peer, header, arrays = p.request(sock, hello, [nonce], [place])
        assert arrays[0].tobytes() == nonce.tobytes()             # read from our memory by reference
        answer, probe = p.data.intercept(peer, header, arrays)
        assert answer["shm_ok"] is True and answer["sums_writable"] is True
        (reply, got), frames = p.reply(peer, answer, probe, sock, resolve={"shm": mapper.view})
        assert len(frames) == 1 and "shm" in reply                 # no data frame: a reference
        assert got[0].tobytes() == reply["nonce"] == probe[0].tobytes()
        wrong = dict(hello, id=2, nonce=b"\0" * 16)               # a probe that does not read back
        peer, header, arrays = p.request(sock, wrong, [nonce], [place])
        assert p.data.intercept(peer, header, arrays)[0]["shm_ok"] is False
    finally:
        arena.close()


@needs_memfd
def test_a_requests_layout_is_decoded_once_per_connection_until_the_members_change(plane, monkeypatch):
    """kvstore/protocol/layouts.py at the server: a push repeated with the same layout
    (the client's layout frame) is decoded from the connection's memo, its references
    checked against their owner and opened once; another connection decodes its own;
    once the job's workers change, or keys are initialised, the same layout is checked
    again, and refused when its memory is no longer the sending worker's."""
    p = plane("shm")
    p.data.joined([f"127.0.0.1:{os.getpid()}"])                  # worker 0 is this process
    checks = []
    check = p.data.owners.check
    monkeypatch.setattr(p.data.owners, "check", lambda *a: checks.append(a[3]) or check(*a))
    arena = shm.Arena("layout-test", segment_bytes=1 << 16)
    try:
        grads = [arena.alloc(8, np.float32) for _ in range(3)]
        places = [arena.locate(g) for g in grads]
        hello = {"op": ops.HELLO, "id": 1, "src": 0, "nonce": b"x" * 16}
        socks = [p.dealer(p.advert.url("tcp")) for _ in range(2)]
        for sock in socks:        # each connection is bound to worker 0 by its handshake
            p.request(sock, hello, [grads[0]], [places[0]])

        def push(sock, rid, fill):
            for g in grads:
                g[:] = fill
            sock.send_multipart(encode({"op": ops.PUSH, "id": rid, "src": 0, "chunks": [[k, 0] for k in range(3)]},
                                       grads, places, layout=True))
            peer, body = p.received()
            return p.data.decode(peer, body)
        checks.clear()
        header, arrays = push(socks[0], 2, 1.0)
        assert header["layout"] is True and header["chunks"] == [[0, 0], [1, 0], [2, 0]] and len(checks) == 1
        again, arrays2 = push(socks[0], 3, 2.0)
        assert again["id"] == 3 and len(checks) == 1               # from the memo: not checked again
        assert all(a is b for a, b in zip(arrays, arrays2)) and all((a == 2).all() for a in arrays2)
        push(socks[1], 4, 3.0)                                     # another connection: its own memo
        assert len(checks) == 2
        p.data.joined([f"127.0.0.1:{os.getpid()}"])                # the members changed: checked anew
        push(socks[0], 5, 4.0)
        assert len(checks) == 3
        socks[1].send_multipart(encode({"op": ops.INIT, "id": 50, "src": 0, "chunks": [[9, 0]]},
                                       [np.zeros(2, np.float32)], layout=True))
        p.data.decode(*p.received())                               # keys made: every connection's anew
        push(socks[0], 7, 4.5)
        assert len(checks) == 4
        p.data.joined(["127.0.0.1:1"])                             # worker 0 is another process now
        with pytest.raises(ProtocolError, match="made no handshake"):     # its binding was dropped
            push(socks[0], 6, 5.0)
    finally:
        arena.close()


@needs_memfd
def test_a_reply_is_sent_by_reference_only_when_its_request_asked_and_only_large_values(plane, mapper):
    p = plane("shm", zero_copy_bytes=4096)
    sock = p.dealer(p.advert.url("tcp"))
    big, small = p.data.alloc(2048, np.float32), p.data.alloc(4, np.float32)
    big[:], small[:] = np.arange(2048), 7
    for rid, asks in ((1, False), (2, True)):
        request = {"op": ops.PULL, "id": rid, "src": 0, "chunks": [[3, 0], [4, 0]]}
        if asks:
            request["shm_reply"] = True
        peer, header, arrays = p.request(sock, request)
        assert p.data.intercept(peer, header, arrays) is None      # noted, left to the state
        (reply, got), frames = p.reply(peer, {"op": ops.OK, "id": rid}, [big, small], sock,
                                       resolve={"shm": mapper.view})
        np.testing.assert_array_equal(got[0], np.arange(2048))
        np.testing.assert_array_equal(got[1], 7)
        if asks:           # the large value by reference into our memory, the small one inline
            # (the header, the buffers' fields in a layout frame, the small value)
            assert reply["layout"] is True and len(frames) == 3
            assert reply["shm"]["refs"][0] is not None and reply["shm"]["refs"][1] is None
        else:              # plain frames
            assert len(frames) == 3 and "shm" not in reply


@needs_memfd
def test_a_write_grant_points_into_shared_memory_or_becomes_an_error(plane, mapper):
    p = plane("shm")
    sum_ = p.data.alloc(16, np.float32)
    frames = p.data.encode(b"w0", {"op": ops.OK, "id": 3, "write_in": True, "modes": ["copy"]}, [sum_])
    header, arrays = decode(frames, resolve={"shm": mapper.view})
    assert header["shm"]["refs"][0] is not None and len(frames) == 1
    frames = p.data.encode(b"w0", {"op": ops.OK, "id": 4, "write_in": True, "modes": ["copy"]},
                           [np.zeros(16, np.float32)])                  # private memory: no grant
    header, _ = decode(frames)
    assert header["op"] == ops.ERROR and header["kind"] == "InternalError"
    assert "not in shared memory" in header["message"]


def test_within_a_batch_a_value_left_on_the_device_is_downloaded_once_for_every_reply(plane):
    p = plane("tcp")
    backend = DeviceBackend(HostDevice())
    p.data.serving(backend)
    value = backend.upload(np.arange(6, dtype=np.float32))
    assert backend.on_device([value])
    with p.data.batch():                  # one event's replies (a round's W replies)
        first = p.data.encode(b"w0", {"op": ops.OK, "id": 1}, [value])
        second = p.data.encode(b"w1", {"op": ops.OK, "id": 2}, [value])
    assert first[1] is second[1]          # one host copy serves both
    assert not backend.on_device([first[1]])
    np.testing.assert_array_equal(first[1], np.arange(6))
    third = p.data.encode(b"w0", {"op": ops.OK, "id": 3}, [value])
    assert third[1] is not first[1]       # outside a batch, each reply downloads its own
    np.testing.assert_array_equal(third[1], np.arange(6))
