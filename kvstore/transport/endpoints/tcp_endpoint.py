"""The server's side of tcp (:mod:`kvstore.transport.links.tcp_link`): its ROUTER
socket bound to a random port on ``KVSTORE_NODE_HOST`` (control messages of every
transport that binds nothing of its own, shared memory's too), and data channels
(:mod:`..channel`): a listener whose one-time tokens the ``channel`` handshake
hands out (none under ``KVSTORE_SECURE=1`` or ``KVSTORE_DATA_CHANNEL=0``), and per
worker a writer thread that sends the large replies it asked for there (``channel``
in its request); a reply due on a channel that broke goes through ZeroMQ."""

from __future__ import annotations

import logging

from ...protocol import ops
from .. import channel
from .advert import bind_tcp
from .base import Endpoint

log = logging.getLogger(__name__)


class TcpEndpoint(Endpoint):
    kind = "tcp"
    answers = frozenset({ops.CHANNEL})

    def __init__(self, config):
        super().__init__(config)
        self._listener: channel.Listener | None = None
        self._channels: dict[bytes, channel.Sender] = {}   # peer -> its channel's writer
        self._replies: dict[bytes, set] = {}   # peer -> ids of requests to answer on its channel

    def bind(self, sock) -> dict[str, str] | None:
        url = bind_tcp(sock, self.config.node_host)
        if self.config.data_channel and not self.config.secure and self._listener is None:
            self._listener = channel.Listener(self.config.node_host, self._accepted,
                                              name=f"server{self.config.rank}-channels")
        return {"url": url}

    def _accepted(self, peer: bytes, sock) -> None:
        """(Listener thread) ``peer``'s data channel is connected; we only write to it."""
        def failed(error):
            # a worker closing its store ends its channel (EOFError); replies still
            # due to it go through ZeroMQ (send() checks `broken`)
            self._replies.pop(peer, None)
            log.log(logging.DEBUG if isinstance(error, EOFError) else logging.WARNING,
                    "data channel of worker %s ended: %s", peer.hex(), error)
        old = self._channels.pop(peer, None)
        self._channels[peer] = channel.Sender(sock, f"channel-{peer.hex()}", failed)
        if old is not None:
            old.close()

    def note(self, peer: bytes, header: dict) -> None:
        if header.get("channel") is True and peer in self._channels:
            self._replies.setdefault(peer, set()).add(header["id"])

    def answer(self, peer: bytes, header: dict, arrays: list) -> tuple[dict, list]:
        if self._listener is None:
            return {"op": ops.OK, "id": header["id"], "port": None}, []
        return {"op": ops.OK, "id": header["id"], "port": self._listener.port,
                "token": self._listener.offer(peer)}, []

    def send(self, peer: bytes, header: dict, frames: list) -> bool:
        ids = self._replies.get(peer)
        if ids is None or header.get("id") not in ids:
            return False
        ids.discard(header["id"])
        via = self._channels.get(peer)
        if via is None or via.broken is not None:
            return False
        via.send(frames)
        return True

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
        for via in list(self._channels.values()):
            via.close()
