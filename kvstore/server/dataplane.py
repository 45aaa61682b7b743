"""The server's side of the transports: the registered endpoints, composed.

:class:`~kvstore.server.node.ServerNode` calls it at five points, and it hands each
to the endpoints of the transports this server serves
(:mod:`kvstore.transport.registry`, from ``KVSTORE_TRANSPORT`` on; one
:class:`~kvstore.transport.endpoints.Endpoint` per transport): to bind its socket
and make the advert (:meth:`DataPlane.bind`: each endpoint binds what it needs and
adds its fields under its name), to allocate values and sums (:meth:`alloc`: in
the memory an endpoint shares with co-located workers, if one does), to decode a
request (:meth:`decode`: references resolved by the endpoint that reads them, each
only into the memory of the worker whose connection sent it:
:class:`~kvstore.transport.endpoints.owners.MemoryOwners`), to
answer the transports' own handshake requests (:meth:`intercept`: each op to the
endpoint that :attr:`~kvstore.transport.endpoints.Endpoint.answers` it; every
request is first noted by each endpoint), and to send a reply (:meth:`reply`:
encoded by the first endpoint that encodes it its own way, sent by the first
that sends it its own way, else plain frames on the ROUTER socket).
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable

import numpy as np

from ..config import Config
from ..errors import ConfigError, ProtocolError
from ..protocol import decode, encode, ops
from ..protocol.codec import Resolver
from ..protocol.layouts import Layout, LayoutMemo
from ..transport import memory, registry
from ..transport.endpoints import Advert, Endpoint, host_identity
from ..transport.endpoints.owners import MemoryOwners

# connections whose requests' layouts are kept (each its own LayoutMemo); a server's
# connections are its workers' (and a replacement's), far fewer
MAX_MEMOS = 1024


def _overrides(endpoint: Endpoint, method: str) -> bool:
    return getattr(type(endpoint), method) is not getattr(Endpoint, method)


class DataPlane:
    """Example::

        data = DataPlane(config)
        address = data.bind(router_socket)       # the advert to register
        data.joined(registration.workers)        # the job's workers may share memory
        data.serving(backend)                    # where the values live
        state = ServerState(alloc=data.alloc, write_in=data.write_in)
    """

    def __init__(self, config: Config):
        self.config = config
        if config.malloc_tuning:
            memory.tune(single_arena=True)
        # name -> endpoint, in the registry's order
        self.endpoints: dict[str, Endpoint] = {
            name: registry.endpoint(name, Endpoint)(config) for name in registry.chosen(config.transport)}
        ends = list(self.endpoints.values())
        self._answers: dict[str, Endpoint] = {}
        for end in ends:
            for op in end.answers:
                self._answers.setdefault(op, end)     # the first in the order answers
        # only the endpoints that do something at each point are called there
        self._noting = [e for e in ends if _overrides(e, "note")]
        self._encoding = [e for e in ends if _overrides(e, "encode")]
        self._sending = [e for e in ends if _overrides(e, "send")]
        self.memory = None    # the allocator co-located workers read in place (after bind)
        self._resolve: dict[str, Resolver] = {}     # kind of reference -> its resolver
        self._owner: dict[str, Endpoint] = {}        # kind of reference -> the endpoint that resolves it
        # a reference is resolved only into its sender's memory (kvstore.transport.endpoints.owners)
        self.owners = MemoryOwners()
        # per connection: its requests' layouts decoded (kvstore/protocol/layouts.py)
        self._memos: dict[bytes, LayoutMemo[Layout]] = {}
        self._backend = None  # where the values live (serving): replies may hold its device arrays
        self._downloads: dict | None = None   # within a batch: reply values' host copies

    def bind(self, sock) -> str:
        """Bind ``sock`` for every served transport; the advert of those offered here."""
        offered = {}
        for name, end in self.endpoints.items():
            fields = end.bind(sock)
            if fields is not None:
                offered[name] = fields
        ends = list(self.endpoints.values())
        self.memory = next((e.memory for e in ends if e.memory is not None), None)
        self._resolve, self._owner = {}, {}
        for end in ends:
            for kind, resolver in end.resolves.items():
                if kind in self._resolve:
                    raise ConfigError(f"two served transports resolve {kind!r} references in requests")
                self._resolve[kind], self._owner[kind] = resolver, end
        return Advert(offered, host_identity(self.config.host_label), os.getpid()).format()

    def joined(self, workers) -> None:
        """Accept shared memory from the job's worker processes only: ``workers`` is
        their "host:pid" list (again with workers that joined an elastic job)."""
        pids = []
        for worker in workers:                        # "host:pid" ("" for a vacant rank)
            tail = str(worker).rsplit(":", 1)[-1]
            if tail.isdigit():
                pids.append(int(tail))
        self.owners.joined(list(workers))
        # who may reference what changed: a layout is decoded, and its references checked, anew
        self._forget_layouts()
        for end in self.endpoints.values():
            end.joined(pids)

    def serving(self, backend) -> None:
        """The server's values live in ``backend``."""
        self._backend = backend
        for end in self.endpoints.values():
            end.serving(backend)

    @property
    def write_in(self) -> bool:
        """Whether co-located workers may write into the server's sums."""
        return any(end.write_in for end in self.endpoints.values())

    def alloc(self, size: int, dtype) -> np.ndarray:
        return self.memory.alloc(size, dtype) if self.memory is not None else np.empty(size, dtype)

    def in_shared_memory(self, a: np.ndarray) -> bool:
        return self.memory is not None and self.memory.locate(a) is not None

    def decode(self, peer, body) -> tuple[dict, list]:
        """A request of connection ``peer``: (header, arrays), references resolved into
        the sender's own memory only. Raises ProtocolError."""
        header, arrays = decode(body, self.config.max_message_bytes, resolve=self._resolvers(peer),
                                memo=self._memo(peer))
        if header["op"] in ops.INITS:
            # keys are made (a collective call: every store forgets its call plans, only the
            # leader sends the values): every connection's layouts start again too
            self._forget_layouts()
        if header.get("dev") is not None and (header["op"] not in ops.DEVICE_BUFFERS
                                              or header.get("compression") is not None):
            # the state machine takes device buffers only where it uploads pushes
            error = ProtocolError(f"{header['op']!r} may not carry device-memory buffers (only "
                                  f"{', '.join(sorted(ops.DEVICE_BUFFERS))}, uncompressed)")
            error.request_id = header["id"]
            raise error
        return header, arrays

    def _forget_layouts(self) -> None:
        """Every connection's requests' layouts, and the endpoints' of their replies."""
        self._memos.clear()
        for end in self.endpoints.values():
            end.forget()

    def _memo(self, peer) -> LayoutMemo[Layout]:
        """The layouts connection ``peer``'s requests decoded to (bounded per connection;
        the connections are bounded by MAX_MEMOS, past which all start again empty)."""
        memo = self._memos.get(peer)
        if memo is None:
            if len(self._memos) >= MAX_MEMOS:
                self._memos.clear()
            memo = self._memos[peer] = LayoutMemo()
        return memo

    def _resolvers(self, peer) -> Callable[[dict], dict[str, Resolver]] | None:
        """The resolvers for one message of ``peer``, made from its checked header:
        each reference is checked against its sender (:class:`MemoryOwners`) before its
        endpoint maps it."""
        if not self._resolve:
            return None

        def made(header: dict) -> dict[str, Resolver]:
            passed: set = set()       # (kind, segment) checked for this message: the same answer again

            def checked(kind: str, resolve: Resolver) -> Resolver:
                def resolver(segment, offset, dtype, shape):
                    # (a message's many references into one segment: checked once, not per buffer)
                    key = (kind, segment)
                    if key not in passed:
                        self.owners.check(peer, header, kind, segment, self._owner[kind].owner(kind, segment))
                        passed.add(key)
                    return resolve(segment, offset, dtype, shape)
                return resolver
            return {kind: checked(kind, resolve) for kind, resolve in self._resolve.items()}
        return made

    def intercept(self, peer, header: dict, arrays: list):
        """Let every endpoint note what a request asks of its transport; answer the
        transports' handshake requests (returns the reply's (header, arrays)), or
        None for requests the state machine handles."""
        for end in self._noting:
            end.note(peer, header)
        op = header.get("op")
        owner = self._answers.get(op) if isinstance(op, str) else None
        return None if owner is None else owner.answer(peer, header, arrays)

    def reply(self, peer, header: dict, arrays: list, zmq_send) -> None:
        """Send a reply: the way of the first endpoint that takes it, else
        ``zmq_send(frames)``."""
        frames = self.encode(peer, header, arrays)
        for end in self._sending:
            if end.send(peer, header, frames):
                return
        zmq_send(frames)

    def encode(self, peer, header: dict, arrays: list) -> list:
        """A reply's frames: the first endpoint's that encodes it its own way. Values
        left on the device (a GPU server's sync replies, ``backend.values``) are
        offered to the endpoints that send device memory, and downloaded for the rest."""
        if self._backend is not None and self._backend.on_device(arrays):
            for end in self._encoding:
                if end.device_replies:
                    frames = end.encode(peer, header, arrays)
                    if frames is not None:
                        return frames
            arrays = self._downloaded(arrays)
        for end in self._encoding:
            frames = end.encode(peer, header, arrays)
            if frames is not None:
                return frames
        return encode(header, arrays)

    @contextlib.contextmanager
    def batch(self):
        """The replies of one state-machine event go out inside: their values cannot
        change among them, so device values downloaded for one reply serve the others
        (a sync round's W replies cost one download, not W)."""
        self._downloads = {}
        try:
            yield
        finally:
            self._downloads = None

    def _downloaded(self, arrays: list) -> list:
        """Host copies of a reply's device values: the backend's download, once per
        list of values within a :meth:`batch`."""
        assert self._backend is not None
        if self._downloads is None:
            return self._backend.download(arrays)
        # the replies hold these arrays while the batch lasts: their ids are theirs
        key = tuple(id(a) for a in arrays)
        host = self._downloads.get(key)
        if host is None:
            host = self._downloads[key] = self._backend.download(arrays)
        return host

    def close(self) -> None:
        for end in self.endpoints.values():
            end.close()
