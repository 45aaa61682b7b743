"""kvstore.transport.endpoints.advert on its own: what a server advertises. Pinned
from its docstring: one word per transport (its URL when its only field is a url of
its own scheme, its bare name without fields, else NAME.FIELD=VALUE), tcp first;
unknown words ignored and a bare URL an advert of that one transport; the host
identity differs with the label; ``bind`` binds tcp (random port) and an abstract
ipc endpoint on one real socket."""

from __future__ import annotations

import os
import sys

import pytest
import zmq

from kvstore.transport.endpoints.advert import Advert, bind, host_identity

pytestmark = pytest.mark.timeout(30)


def test_each_transport_is_one_word_tcp_first_and_parse_reads_format_back():
    advert = Advert({"shm": {}, "cuda_ipc": {"device": "GPU-1234"}, "tcp": {"url": "tcp://10.0.0.1:5000"},
                     "ipc": {"url": "ipc://@kvstore-ab"}}, host="9c1e44d0a1b2c3d4", pid=1234)
    text = advert.format()
    assert text == ("tcp://10.0.0.1:5000 shm cuda_ipc.device=GPU-1234 ipc://@kvstore-ab "
                    "host=9c1e44d0a1b2c3d4 pid=1234")
    back = Advert.parse(text)
    assert back == advert and list(back.transports) == ["tcp", "shm", "cuda_ipc", "ipc"]
    assert back.offers("shm") and not back.offers("toy")
    assert back.url("tcp") == "tcp://10.0.0.1:5000" and back.url("shm") is None


def test_a_bare_url_is_an_advert_of_one_transport_and_unknown_words_are_ignored():
    assert Advert.parse("tcp://h:1") == Advert({"tcp": {"url": "tcp://h:1"}})
    later = Advert.parse("tcp://h:1 Future-Word x.y.z pid=abc host=h1 toy.port=7")
    assert later.transports == {"tcp": {"url": "tcp://h:1"}, "toy": {"port": "7"}}
    assert (later.host, later.pid) == ("h1", None)
    with pytest.raises(ValueError, match="empty server address"):
        Advert.parse("  ")


def test_names_and_fields_that_would_not_read_back_are_refused():
    for transports in ({"Bad": {}}, {"toy": {"port": ""}}, {"toy": {"port": "a b"}}, {"toy": {"Port": "1"}}):
        with pytest.raises(ValueError):
            Advert(transports).format()


def test_the_host_identity_is_the_same_in_one_process_and_differs_with_the_label():
    mine = host_identity("")
    assert len(mine) == 16 and int(mine, 16) >= 0 and host_identity("") == mine
    assert host_identity("host-a") != mine and host_identity("host-a") != host_identity("host-b")


def test_bind_puts_tcp_and_ipc_on_one_socket_and_each_address_reaches_it():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    dealers = []
    try:
        advert = bind(router, "127.0.0.1", label="lab")
        assert advert.url("tcp").startswith("tcp://127.0.0.1:")
        assert (advert.host, advert.pid) == (host_identity("lab"), os.getpid())
        if sys.platform.startswith("linux"):
            assert advert.url("ipc").startswith("ipc://@kvstore-")
        for url in filter(None, (advert.url("tcp"), advert.url("ipc"))):
            dealer = ctx.socket(zmq.DEALER)
            dealers.append(dealer)
            dealer.connect(url)
            dealer.send(url.encode())
            assert router.poll(10_000)
            assert router.recv_multipart()[1] == url.encode()
        assert bind(router, "127.0.0.1", ipc=False).url("ipc") is None
    finally:
        for sock in dealers + [router]:
            sock.close(linger=0)
        ctx.term()
