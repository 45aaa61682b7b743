"""A toy transport's server side (the worker's is tests/toy_link.py), registered by
tests/transport/test_links.py with one line: ZeroMQ frames on a tcp port of its own, which
it advertises as ``toy.url=tcp://...``, and a handshake of its own (``toy_hello``:
it echoes the worker's token and names its port). It counts what it saw."""

from __future__ import annotations

from kvstore.protocol import ops
from kvstore.transport.endpoints import Endpoint, bind_tcp

HELLO = "toy_hello"


class ToyEndpoint(Endpoint):
    kind = "toy"
    answers = frozenset({HELLO})

    def __init__(self, config):
        super().__init__(config)
        self.port: int | None = None
        self.hellos = 0        # handshakes it answered
        self.noted = 0         # requests it saw (every request to the server)

    def bind(self, sock) -> dict[str, str] | None:
        url = bind_tcp(sock, self.config.node_host)
        self.port = int(url.rsplit(":", 1)[1])
        return {"url": url}

    def note(self, peer: bytes, header: dict) -> None:
        self.noted += 1

    def answer(self, peer: bytes, header: dict, arrays: list) -> tuple[dict, list]:
        self.hellos += 1
        return {"op": ops.OK, "id": header["id"], "echo": header.get("token"), "port": self.port}, []
