"""ZeroMQ over tcp, with a data channel for large replies.

Requests and small replies travel as ZeroMQ frames. Unless ``KVSTORE_SECURE=1``
(data must not travel in clear next to CURVE) or ``KVSTORE_DATA_CHANNEL=0``,
the handshake asks the server for a data channel (:mod:`..channel`: a port and
a one-time token, then a plain TCP connection): replies of
``KVSTORE_CHANNEL_BYTES`` or more come through it, received by a reader thread
straight into the caller's arrays, registered by request id before the request
leaves. A server that offers none, or a connection that fails, leaves this link
on ZeroMQ alone: it never falls back to another transport.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .client_seam import LinkClient

import logging
import queue

from ...errors import ProtocolError
from ...protocol import ops
from .. import channel
from .base import Link
from .options import RequestOptions

log = logging.getLogger(__name__)


class TcpLink(Link):
    kind = "tcp"
    aside = "data channel"

    def __init__(self, client: LinkClient, server: int, url: str, advert):
        super().__init__(client, server, url, advert)
        self.receiver: channel.Receiver | None = None   # None: no channel (any more)
        self._offer: dict | None = None
        self._into: dict[int, list] = {}      # request id -> the arrays its reply fills
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()   # from the reader thread
        self._wakeup: channel.Wakeup | None = None

    def hello(self) -> list[int]:
        if not self.config.data_channel or self.config.secure:
            return []

        def keep(header, values):
            self._offer = header
        return [self.client.request(self.server, ops.CHANNEL, f"opening a data channel to server "
                                    f"{self.server}", (),
                                    RequestOptions(on_reply=keep, sequenced=False, on_error=self.refused))[0]]

    def ready(self) -> None:
        offer = self._offer
        if offer is None or offer.get("port") is None:   # none offered (or refused: logged)
            return
        port, token = offer.get("port"), offer.get("token")
        host = self.url.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
        try:
            if not (isinstance(port, int) and isinstance(token, bytes)
                    and len(token) == channel.TOKEN_BYTES):
                raise ProtocolError(f"invalid channel offer {sorted(offer)}")
            sock = channel.connect(host, port, token, min(self.config.timeout, 30.0))
        except (OSError, ProtocolError) as e:
            log.warning("[worker:%d] no data channel to server %d (%s:%s): %s; its large "
                        "replies come through ZeroMQ", self.client.rank, self.server, host, port, e)
            return
        self._wakeup = channel.Wakeup()
        self.fd = self._wakeup.fd
        self.receiver = channel.Receiver(
            sock, f"w{self.client.rank}-channel{self.server}", self.config.max_message_bytes,
            deliver=lambda header, arrays, nbytes: self._post((header, arrays, nbytes)),
            failed=lambda error: self._post((None, error, 0)),
            destinations=lambda header: self._into.pop(header.get("id"), None))

    def _post(self, item: tuple) -> None:
        """(The reader thread) hand (header, arrays, nbytes), or (None, error, 0) when
        the channel ended, to the thread that waits (:meth:`drain`)."""
        self._inbox.put(item)
        if self._wakeup is not None:          # (closed only after the reader was joined)
            self._wakeup.set()

    def prepare(self, req_id, arrays, fields, options):
        via, into = self.receiver, options.into
        if via is None or via.broken is not None or into is None \
                or sum(a.nbytes for a in into) < self.config.channel_bytes:
            return arrays, options.shared, False
        fields["channel"] = True
        self._into[req_id] = list(into)
        return arrays, options.shared, True

    def release(self, req_id: int) -> None:
        self._into.pop(req_id, None)

    def drain(self, complete, failed) -> None:
        if self._wakeup is not None:
            self._wakeup.clear()
        try:
            while True:
                try:
                    header, arrays, nbytes = self._inbox.get_nowait()
                except queue.Empty:
                    return
                if self.receiver is None:
                    continue                  # abandoned: drop what it left
                if header is None:
                    log.warning("[worker:%d] the data channel to server %d ended: %s",
                                self.client.rank, self.server, arrays)
                    failed(f"the data channel to server {self.server} ({self.url}) broke: {arrays}")
                else:
                    complete(header, arrays, nbytes)
        finally:
            # a handler raised: what is left waits for the next call
            if not self._inbox.empty() and self._wakeup is not None:
                self._wakeup.set()

    def abandon(self) -> None:
        if self.receiver is None:
            return
        self.receiver.close()                 # joins the reader: nothing is written after this
        self.receiver = None
        log.warning("[worker:%d] closed the data channel to server %d: a call waiting on it "
                    "failed", self.client.rank, self.server)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        if self._wakeup is not None:
            self._wakeup.close()
            self._wakeup = None
