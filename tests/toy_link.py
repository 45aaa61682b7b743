"""A toy transport's worker side (the server's is tests/toy_endpoint.py): connects
to the URL the server's toy endpoint advertises (the base class's ``reach``), and
is used only when the ``toy_hello`` handshake shows that the toy endpoint answered
on the port this link connected to."""

from __future__ import annotations

import os

from kvstore.transport.links import Link, LinkUnavailable, RequestOptions
from toy_endpoint import HELLO


class ToyLink(Link):
    kind = "toy"

    def hello(self) -> list[int]:
        self._token = os.urandom(8)
        self._answer: dict = {}

        def keep(header, values):
            self._answer = header
        return [self.client.request(self.server, HELLO, f"toy handshake with server {self.server}", (),
                                    RequestOptions(on_reply=keep, sequenced=False, on_error=self.refused),
                                    token=self._token)[0]]

    def ready(self) -> None:
        port = self._answer.get("port")
        if self._answer.get("echo") != self._token or not self.url.endswith(f":{port}"):
            raise LinkUnavailable(f"server {self.server} did not answer the toy handshake on {self.url}")
