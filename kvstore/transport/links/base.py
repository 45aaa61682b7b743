"""The interface of a worker's link to one server, and plain ZeroMQ frames.

A :class:`Link` is how one worker reaches one server: which URL its ZeroMQ
socket connects to (:meth:`Link.reach`), the handshake that proves the
transport works (:meth:`~Link.hello`, :meth:`~Link.ready`), what a request's
buffers become on the way out (:meth:`~Link.prepare`: staged into shared
memory, sent by reference, or left as frames), how a reply is read
(:meth:`~Link.decode`) and delivered into the caller's arrays
(:meth:`~Link.deliver`), what it can write straight into the server's sums
(:attr:`~Link.writer`), and what it holds (:meth:`~Link.close`). It mirrors
:class:`kvstore.transport.endpoints.Endpoint` of the same transport, the
server's side (both registered in :mod:`kvstore.transport.registry`).

The :class:`kvstore.worker.client.Client` owns the sockets, request ids, the pending
table, deadlines and back-pressure; a link never sends by itself but through
``client.request``, so that its handshake and write-in requests are tracked
like any other. This base class is ZeroMQ frames as they are (ipc uses it
unchanged); see :mod:`kvstore.transport.links` for the registry.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from ...errors import InvalidArgumentError
from ...protocol import decode
from .options import RequestOptions

if TYPE_CHECKING:
    from .client_seam import LinkClient
    from .write_in import Writer

log = logging.getLogger(__name__)


class LinkUnavailable(Exception):
    """The handshake showed that this transport cannot reach the server; the client
    tries the next registered link that can. The message says why (it is logged)."""


class Link:
    """How this worker reaches server ``server`` (subclass per transport).

    Lifecycle, driven by the client: ``cls(client, server, url, advert)`` for the
    first registered link whose :meth:`reach` accepts the server's advert; then
    :meth:`hello` (its handshake requests: every server's go out at once, and the
    client waits for them together), then :meth:`ready`. A link that raises
    :class:`LinkUnavailable` from either is closed, and the next one is tried.
    """

    kind = "tcp"          # its registered name (kvstore.transport.registry): the advert's key
    #                       for its server's endpoint, and what Client.transports reports
    aside: str | None = None   # name of a path that replies take besides the socket (its
    #                       own reader thread), e.g. "data channel"; None: only the socket
    frames = True         # large replies arrive as ZeroMQ frames (the client tunes malloc)
    writer: Writer | None = None   # (links/write_in.py) when the server's sums can be written
    fd: int | None = None  # a file descriptor the client polls; readable: call drain()
    reads_device = False  # it takes device arrays in requests and ``into`` (cuda_ipc)

    @classmethod
    def applies(cls, client: LinkClient) -> bool:
        """Whether this worker can use the transport at all (e.g. it has GPUs); a link
        that does not apply is skipped quietly, before its handshake."""
        return True

    @classmethod
    def reach(cls, advert, config, colocated: bool) -> str | None:
        """The URL to connect to for ``advert`` (a transport.Advert), or None when
        this transport cannot reach that server. ``colocated``: same host identity.
        Here: the URL the server's endpoint of this transport advertises."""
        return advert.url(cls.kind)

    def __init__(self, client: LinkClient, server: int, url: str, advert):
        self.client = client
        self.config = client.config
        self.server = server
        self.url = url
        self.advert = advert
        # message size for dist.py's pipelining: a link transfer to overlap with summing
        self.pipeline_bytes = self.config.pipeline_bytes

    def hello(self) -> list[int]:
        """Send the handshake's requests (through ``self.client.request``, unsequenced);
        return their ids. Raises LinkUnavailable when it cannot even start."""
        return []

    def ready(self) -> None:
        """After the client waited for :meth:`hello`'s requests: raise LinkUnavailable
        unless the transport works; otherwise start what it needs."""

    def refused(self, error: Exception) -> None:
        """The ``on_error`` of handshake requests: the server refusing one only means
        that this transport is not used with it (:meth:`ready` says what next)."""
        log.info("[worker:%d] %s", self.client.rank, error)

    def prepare(self, req_id: int, arrays, fields: dict,
                options: RequestOptions) -> tuple[list, list | None, bool]:
        """What request ``req_id`` sends: ``(arrays, shared, aside)``, as
        ``protocol.encode`` takes them (``shared``: where arrays lie in our shared
        memory, None for frames); ``aside``: its reply comes by :attr:`aside`. May add
        header ``fields``. ``options`` (:class:`RequestOptions`): ``stage``,
        ``in_place``, ``shared``, ``into`` and ``replied`` say what the arrays may
        become and where the reply goes. What it holds for the request is freed by
        :meth:`release`."""
        return arrays, options.shared, False

    def release(self, req_id: int) -> None:
        """Request ``req_id`` is answered, failed, or was never sent: free what
        :meth:`prepare` held for it."""

    def decode(self, frames) -> tuple[dict, list]:
        """A reply's (header, arrays); ProtocolError when malformed."""
        return decode(frames, self.config.max_message_bytes)

    def deliver(self, values: list, into: list) -> None:
        """Copy a reply's ``values`` into ``into`` (one contiguous 1-D array per value);
        a value received in place (it *is* its destination) is left as it is."""
        if len(values) != len(into):
            raise InvalidArgumentError(f"reply carries {len(values)} arrays for {len(into)} chunks")
        for dest, value in zip(into, values):
            if value is dest:
                continue
            if value.size != dest.size:
                raise InvalidArgumentError(f"reply carries {value.size} values for a chunk of {dest.size}")
            np.copyto(dest, value.reshape(-1))

    def drain(self, complete, failed) -> None:
        """(When :attr:`fd` is readable) hand what the aside path delivered to
        ``complete(header, arrays, nbytes)``, or ``failed(why)`` once it broke."""

    def abandon(self) -> None:
        """Close the aside path (joining its reader: nothing is written into a
        caller's arrays after this returns); later replies come through the socket."""

    def empty(self, size: int, dtype) -> np.ndarray | None:
        """A 1-D array the server can read in place, or None when this link has no
        such memory."""
        return None

    def device_empty(self, index: int, size: int, dtype):
        """A 1-D array on device ``index`` the server can read in place, or None when
        this link does not read device memory."""
        return None

    def forget(self) -> None:
        """Forget what this link kept of repeated calls (the store forgot its call
        plans): nothing here."""

    def close(self) -> None:
        """Release what the link holds (not the socket: the client owns it)."""
