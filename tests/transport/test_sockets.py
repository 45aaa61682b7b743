"""kvstore.transport.sockets on its own: :class:`Sockets`, a worker's DEALER per
server and one poller over them and the links' wake-up descriptors, against real
ROUTER sockets on 127.0.0.1 (random ports). Pinned from its docstring: ``poll``
reports each readable socket as its server's, and a watched descriptor as
``(server, None)``; ``connect`` again replaces a server's socket."""

from __future__ import annotations

import os

import pytest
import zmq

from kvstore.config import Config
from kvstore.transport.sockets import Sockets

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def routers():
    ctx = zmq.Context()
    socks = []

    def make():
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        socks.append(sock)
        return sock, f"tcp://127.0.0.1:{port}"
    yield make
    for sock in socks:
        sock.close(linger=0)
    ctx.term()


def answer(router, text: bytes) -> None:
    """Reply ``text`` to the next message the server gets."""
    assert router.poll(10_000)
    peer, _ = router.recv_multipart()
    router.send_multipart([peer, text])


def test_poll_reports_each_readable_socket_as_its_servers(routers):
    (_, u0), (r1, u1) = routers(), routers()
    socks = Sockets(Config(), 2)
    try:
        assert len(socks) == 2 and socks[0] is None
        socks.connect(0, u0)
        socks.connect(1, u1)
        assert socks.poll(0) == []
        socks[1].send(b"hello 1")
        answer(r1, b"from 1")
        ready = socks.poll(10)
        assert [(server, sock is socks[1]) for server, sock in ready] == [(1, True)]
        assert socks[1].recv() == b"from 1"
    finally:
        socks.close()


def test_a_watched_descriptor_is_reported_as_its_server_without_a_socket(routers):
    _, url = routers()
    socks = Sockets(Config(), 1)
    read, write = os.pipe()
    try:
        socks.connect(0, url)
        socks.watch(read, 0)
        assert socks.poll(0) == []
        os.write(write, b"x")                 # a link's reader thread wakes the client
        assert socks.poll(10) == [(0, None)]
    finally:
        socks.close()
        os.close(read)
        os.close(write)


def test_connecting_again_replaces_the_servers_socket(routers):
    (r0, u0), (r1, u1) = routers(), routers()
    socks = Sockets(Config(), 1)
    try:
        socks.connect(0, u0)
        old = socks[0]
        socks.connect(0, u1)
        assert old.closed and socks[0] is not old
        socks[0].send(b"to the new one")
        answer(r1, b"ok")
        assert [server for server, _ in socks.poll(10)] == [0] and socks[0].recv() == b"ok"
        assert r0.poll(0) == 0                # the old server got nothing
    finally:
        socks.close()
