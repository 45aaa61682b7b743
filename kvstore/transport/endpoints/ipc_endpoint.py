"""The server's side of ipc (:mod:`kvstore.transport.links.ipc_link`): its ROUTER
socket bound (Linux) to an abstract ipc endpoint, reachable only from its own
network namespace, with no file to clean up; plain ZeroMQ frames."""

from __future__ import annotations

from .advert import bind_ipc
from .base import Endpoint


class IpcEndpoint(Endpoint):
    kind = "ipc"

    def bind(self, sock) -> dict[str, str] | None:
        url = bind_ipc(sock)
        return None if url is None else {"url": url}
