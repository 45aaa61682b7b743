"""The interface of a server's side of one transport.

An :class:`Endpoint` is what one transport adds to a server: the addresses it
binds on the server's ROUTER socket and advertises (:meth:`Endpoint.bind`), the
handshake requests it answers itself (:attr:`~Endpoint.answers`, e.g. ``hello``,
``channel``), what it notes in every request for that request's reply
(:meth:`~Endpoint.note`), how it resolves references in requests
(:attr:`~Endpoint.resolves`, and whose memory a reference names: :meth:`~Endpoint.owner`),
and how it encodes and sends replies
(:meth:`~Endpoint.encode`, :meth:`~Endpoint.send`). It mirrors the worker's
:class:`kvstore.transport.links.base.Link` of the same transport; the two are
registered together in :mod:`kvstore.transport.registry`.

:class:`kvstore.server.dataplane.DataPlane` composes the endpoints a server
serves and calls them at each of those points; the server's I/O loop
(``server/node.py``) and its state machine know none of them. This base class
adds nothing: plain ZeroMQ frames on an address another endpoint bound.
"""

from __future__ import annotations

from typing import Any, Mapping

from ...protocol.codec import Resolver


class Endpoint:
    """The server's side of transport :attr:`kind` (subclass per transport).

    Lifecycle, driven by the DataPlane: ``cls(config)`` for each transport the
    server serves (from ``KVSTORE_TRANSPORT`` on, in the registry's order); then
    :meth:`bind` (None: not offered here, and not advertised); :meth:`joined`
    whenever the job's workers change; :meth:`serving` once the server's values
    have a backend; per request :meth:`note` and, for its own handshake ops,
    :meth:`answer`; per reply :meth:`encode` and :meth:`send`; :meth:`close`.
    """

    kind = "tcp"                          # its name in the registry and the advert
    answers: frozenset[str] = frozenset()  # the handshake ops it answers (never seen by the state)
    memory: Any = None     # an allocator (shm.Arena) whose arrays co-located workers read in place
    write_in = False       # whether workers may write into the server's sums through it
    # the kinds of reference in requests it resolves into arrays (the codec's ``resolve``):
    # {"shm": ...} for host shared memory, {"dev": ...} for device memory
    resolves: Mapping[str, Resolver] = {}
    # whether :meth:`encode` takes a reply's values left on the device (a GPU server's
    # sync replies, kvstore.server.backend's ``values``); others get them downloaded
    device_replies = False

    def __init__(self, config):
        self.config = config

    def bind(self, sock) -> dict[str, str] | None:
        """Bind what it needs on the server's ROUTER ``sock`` (and beside it); the
        fields it advertises under :attr:`kind` (``{}``: offered, nothing to say),
        or None when it cannot be offered here."""
        return {}

    def joined(self, pids: list[int]) -> None:
        """The job's worker processes (their pids on this host; again after an
        elastic job changed)."""

    def serving(self, backend) -> None:
        """The server's values live in ``backend`` (kvstore.server.backend)."""

    def owner(self, kind: str, segment) -> int | None:
        """The process whose memory ``segment`` (a reference of ``kind`` in
        :attr:`resolves`) is, when the segment names it (``[pid, fd, size]``); None
        when it is opaque (a CUDA IPC handle). The data plane accepts a reference
        only of the sending worker's memory (kvstore.transport.endpoints.owners)."""
        return None

    def note(self, peer: bytes, header: dict) -> None:
        """Every request of ``peer``, before it is handled: what it asks of this
        transport for its reply (a header field such as ``shm_reply``)."""

    def answer(self, peer: bytes, header: dict, arrays: list) -> tuple[dict, list]:
        """The reply (header, arrays) to one of :attr:`answers`."""
        raise NotImplementedError(f"{type(self).__name__} answers no {header.get('op')!r}")

    def encode(self, peer: bytes, header: dict, arrays: list) -> list | None:
        """A reply's frames when this transport encodes it its own way (e.g. values
        as references into shared memory); None: the plain codec encodes it."""
        return None

    def send(self, peer: bytes, header: dict, frames: list) -> bool:
        """Send a reply's ``frames`` its own way (e.g. on a data channel) and return
        True, or False to leave it to the ROUTER socket."""
        return False

    def forget(self) -> None:
        """Forget what it kept of repeated replies (their layouts: keys were made, or
        the job's members changed)."""

    def close(self) -> None:
        """Release what it holds (not the socket: the server node owns it)."""
