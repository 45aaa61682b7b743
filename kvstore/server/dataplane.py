"""The server's side of the transports, kept out of the I/O loop.

:class:`~kvstore.server.node.ServerNode` calls it at five points: to bind its
socket (:meth:`DataPlane.bind`), to allocate values and sums (:meth:`alloc`: in
shared memory, so that co-located workers can read results in place), to decode
a request (:meth:`decode`: buffers a co-located worker left in its own shared
memory become views on it), to answer transport requests (:meth:`intercept`:
``hello``, ``channel``), and to send a reply (:meth:`reply`: values in shared
memory are sent as references when the request asked for that; replies a worker
asked for on its data channel go there). Over ZeroMQ on tcp and ipc buffers
travel as frames.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from ..config import Config
from ..protocol import decode, encode, error_header, ops
from ..transport import channel, endpoints, memory, shm

log = logging.getLogger(__name__)


class DataPlane:
    """Example::

        data = DataPlane(config)
        address = data.bind(router_socket)       # the advert to register
        data.joined(registration.workers)        # the job's workers may share memory
        state = ServerState(alloc=data.alloc)
    """

    def __init__(self, config: Config):
        self.config = config
        if config.malloc_tuning:
            memory.tune(single_arena=True)
        use_shm = config.transport in ("auto", "shm") and shm.available()
        self.arena = shm.Arena(f"s{config.rank}") if use_shm else None
        self._mapper = shm.Mapper()
        self._shm_replies: set = set()   # (peer, request id) whose reply may point into our memory
        self._probe = None
        if self.arena is not None:
            # kept for the server's lifetime: a worker reads it after our hello reply
            self._probe = self.arena.alloc(16, np.uint8)
            self._probe[:] = np.frombuffer(os.urandom(16), np.uint8)
        # data channels (transport.channel): large replies to workers over tcp
        self._listener = None
        if config.data_channel and not config.secure:
            self._listener = channel.Listener(config.node_host, self._accepted,
                                              name=f"server{config.rank}-channels")
        self._channels: dict = {}          # peer -> channel.Sender
        self._channel_replies: dict = {}   # peer -> ids of requests to answer on its channel
        # whether workers may write into our sums (False when they live on a GPU)
        self.write_in = self.arena is not None

    def bind(self, sock) -> str:
        """Bind ``sock`` (tcp, and ipc unless KVSTORE_TRANSPORT=tcp); the advert."""
        advert = endpoints.bind(sock, self.config.node_host, ipc=self.config.transport != "tcp",
                                label=self.config.host_label)
        return advert.format()

    def joined(self, workers) -> None:
        """Accept shared memory from the job's worker processes only: ``workers`` is
        their "host:pid" list (again with workers that joined an elastic job)."""
        pids = []
        for worker in workers:                        # "host:pid" ("" for a vacant slot)
            tail = str(worker).rsplit(":", 1)[-1]
            if tail.isdigit():
                pids.append(int(tail))
        self._mapper.allow(pids)

    def alloc(self, size: int, dtype) -> np.ndarray:
        return self.arena.alloc(size, dtype) if self.arena is not None else np.empty(size, dtype)

    def in_shared_memory(self, a: np.ndarray) -> bool:
        return self.arena is not None and self.arena.locate(a) is not None

    def decode(self, body) -> tuple[dict, list]:
        return decode(body, self.config.max_message_bytes, resolve=self._mapper.view)

    def _accepted(self, peer, sock) -> None:
        """(Listener thread) ``peer``'s data channel is connected; we only write to it."""
        def failed(error):
            # a worker closing its store ends its channel (EOFError); replies still
            # due to it go through ZeroMQ (reply() checks `broken`)
            self._channel_replies.pop(peer, None)
            log.log(logging.DEBUG if isinstance(error, EOFError) else logging.WARNING,
                    "data channel of worker %s ended: %s", peer.hex(), error)
        old = self._channels.pop(peer, None)
        self._channels[peer] = channel.Sender(sock, f"channel-{peer.hex()}", failed)
        if old is not None:
            old.close()

    def intercept(self, peer, header: dict, arrays: list):
        """Note what a request asks of the transport; answer ``hello`` and
        ``channel`` (returns the reply's (header, arrays)), or None for requests the
        state machine handles."""
        if header.get("shm_reply") is True and self.arena is not None:
            self._shm_replies.add((peer, header["id"]))
        if header.get("channel") is True and peer in self._channels:
            self._channel_replies.setdefault(peer, set()).add(header["id"])
        if header["op"] == ops.CHANNEL:
            if self._listener is None:
                return {"op": ops.OK, "id": header["id"], "port": None}, []
            return {"op": ops.OK, "id": header["id"], "port": self._listener.port,
                    "token": self._listener.offer(peer)}, []
        if header["op"] != ops.HELLO:
            return None
        nonce = header.get("nonce")
        # the worker's probe must have come through shared memory and read back right
        ok = (self.arena is not None and isinstance(header.get("shm"), dict) and len(arrays) == 1
              and isinstance(nonce, bytes) and arrays[0].tobytes() == nonce)
        if not ok:
            return {"op": ops.OK, "id": header["id"], "shm_ok": False}, []
        return {"op": ops.OK, "id": header["id"], "shm_ok": True, "nonce": self._probe.tobytes(),
                "sums_writable": self.write_in}, [self._probe]

    def reply(self, peer, header: dict, arrays: list, zmq_send) -> None:
        """Send a reply: on ``peer``'s data channel when its request asked for that
        and the channel works, else ``zmq_send(frames)``."""
        frames = self.encode(peer, header, arrays)
        ids = self._channel_replies.get(peer)
        if ids is not None and header.get("id") in ids:
            ids.discard(header["id"])
            via = self._channels.get(peer)
            if via is not None and via.broken is None:
                via.send(frames)
                return
        zmq_send(frames)

    def encode(self, peer, header: dict, arrays: list) -> list:
        key = (peer, header.get("id"))
        shared = None
        if header.get("write_in") is True:
            # a grant must point into our memory: a copy would swallow the worker's writes
            self._shm_replies.discard(key)
            shared = [self.arena.locate(a) if self.arena is not None else None for a in arrays]
            if any(place is None for place in shared):
                return encode(error_header(header.get("id"), "InternalError",
                                           "cannot grant a write: the sum is not in shared memory"))
            return encode(header, arrays, shared)
        if key in self._shm_replies:
            self._shm_replies.discard(key)
            if arrays:
                # small values travel in the message (cheaper than a reference), except
                # the hello reply's probe, which must prove the shared memory works
                least = 0 if header.get("shm_ok") is True else self.config.zero_copy_bytes
                shared = [self.arena.locate(a) if a.nbytes >= least else None for a in arrays]
        return encode(header, arrays, shared)

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
        for via in list(self._channels.values()):
            via.close()
        if self.arena is not None:
            self.arena.close()
        self._mapper.close()
