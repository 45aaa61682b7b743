"""The server node's side of replicated servers (``KVSTORE_REPLICAS=1``): the
connection to its backup, the replies held until the backup acknowledged, and
the servers' book as the scheduler publishes it (tracker.control.failover).

The state machine decides what is replicated (kvstore.server.replication); this
module moves it: :meth:`ReplicaLink.after` sends the ``replicate`` requests an
event made on a DEALER socket to the backup's tcp address (sequenced like a
worker's requests) and passes the event's replies through the
:class:`~kvstore.server.replication.ReplyGate`; :meth:`ReplicaLink.acks` reads the
backup's answers and returns the replies they release. :meth:`ReplicaLink.book`
applies a new epoch of the servers' book: a dead primary's replica is promoted
into the state, a dead backup's replica is given up (the held replies leave).

Workers and servers hear a new book at about the same time, in no set order: a
worker's request carries the epoch it routed by (``book``), and a request from a
newer epoch than this server holds waits (:meth:`ReplicaLink.waits`), with every
request after it, until the server holds that epoch (:meth:`ReplicaLink.ready`),
or ``KVSTORE_TIMEOUT`` passed (they are then answered with an error).
"""

from __future__ import annotations

import itertools
import logging

import zmq

from ..config import Config
from ..errors import ProtocolError
from ..protocol import decode, encode, error_header, ops
from .replication import ReplyGate, replicate_request
from .rounds import Reply
from .state import ServerState

log = logging.getLogger(__name__)


class BackupFailed(Exception):
    """The backup refused a ``replicate`` request: the replica would differ from the
    primary, so the job must end (naming both servers)."""


class ReplicaLink:
    """Server ``rank``'s link to its backup among ``servers`` (their adverts, whose
    first word is the tcp URL), for ``state``. Example (what ServerNode does)::

        link = ReplicaLink(config, ctx, rank, reg.servers, state)
        link.book(*membership.servers)      # the backup, the replicas held, promotions
        send(link.after(state.handle(...)))  # replicate, then hold the replies
        send(link.acks())                    # when the backup's socket is readable
    """

    def __init__(self, config: Config, ctx: zmq.Context, rank: int, servers: list[str], state: ServerState):
        self.config = config
        self.rank = rank
        self.state = state
        self.gate = ReplyGate()
        self._ctx = ctx
        self._urls = [advert.split()[0] for advert in servers]
        self.sock: zmq.Socket | None = None
        self._backup: int | None = None
        self._ids = itertools.count(1)
        self._seq = 0
        self._epoch = -1
        self.promoted: list[int] = []      # the shares this server took over, in order
        self._waiting: list[tuple[float, bytes, dict, list]] = []   # (since, peer, header, arrays), in order

    # -- the servers' book -----------------------------------------------------------------
    def book(self, epoch: int, owners: tuple, backups: tuple) -> list[Reply]:
        """Apply epoch ``epoch`` of the servers' book (an older or equal one is ignored):
        connect to this server's backup, note whose replicas it holds, promote the
        replicas of the shares it now owns. Returns the replies now released."""
        if epoch <= self._epoch or not owners:
            return []
        self._epoch = epoch
        released: list[Reply] = []
        for share, owner in enumerate(owners):
            if owner == self.rank and share != self.rank and share not in self.promoted:
                self.promoted.append(share)
                released += self.state.promote(share)
                log.warning("%s serves server %d's chunks now (its backup; servers' book epoch %d)",
                            self.state.name, share, epoch)
        holding = frozenset(s for s, b in enumerate(backups) if b == self.rank and owners[s] == s)
        for gone in self.state.replicas.primaries - holding:
            self.state.replicas.drop(gone)
        self.state.replicas.primaries = holding
        backup = backups[self.rank] if owners[self.rank] == self.rank else None
        if backup != self._backup:
            if self._backup is not None:
                log.warning("%s: its backup, server %d, is gone: its chunks have no replica now",
                            self.state.name, self._backup)
                released += self.gate.open()
            self._connect(backup)
        self.state.replication.backup = backup
        return released

    def _connect(self, backup: int | None) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        self._backup = backup
        if backup is None:
            return
        url = self._urls[backup]
        if not url.startswith("tcp://"):
            raise ProtocolError(f"server {backup}'s advert has no tcp URL first: {url!r}")
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SNDHWM, 0)      # never drop: the replies wait for these
        self.config.security().connect(sock)
        sock.connect(url)
        self.sock, self._seq = sock, 0

    # -- events ----------------------------------------------------------------------------
    def after(self, replies: list[Reply]) -> list[Reply]:
        """An event of the state machine made ``replies``: send the ``replicate``
        requests it made, then the replies that may leave now (the others are held
        until the backup acknowledged)."""
        for fields, arrays in self.state.replication.take():
            assert self.sock is not None        # the state replicates only with a backup
            req_id = next(self._ids)
            header = replicate_request(req_id, self.rank, self._seq, fields)
            self._seq += 1
            self.sock.send_multipart(encode(header, arrays), copy=False)
            self.gate.sent(req_id)
        return self.gate.hold(replies)

    def acks(self) -> list[Reply]:
        """Read the backup's answers; the replies they release. Raises BackupFailed
        when the backup refused one."""
        released: list[Reply] = []
        while self.sock is not None:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            header, _ = decode(frames, self.config.max_message_bytes)
            if header.get("op") != ops.OK:
                raise BackupFailed(f"{self.state.name}'s backup, server {self._backup}, refused to replicate: "
                                   f"{header.get('kind')}: {header.get('message')}")
            released += self.gate.acknowledged(header["id"])
        return released

    # -- requests from a newer book --------------------------------------------------------
    def waits(self, peer: bytes, header: dict, arrays: list, now: float) -> bool:
        """Whether this request must wait (kept here): it was routed by a newer book
        than this server holds, or an earlier one waits (the order stays)."""
        book = header.get("book")
        newer = type(book) is int and book > self._epoch
        if not newer and not self._waiting:
            return False
        self._waiting.append((now, peer, header, arrays))
        return True

    def ready(self, now: float) -> tuple[list[tuple[bytes, dict, list]], list[Reply]]:
        """The waiting requests that may be handled now, in order (up to the first that
        still waits), and the error replies of those that waited past the deadline."""
        ready: list[tuple[bytes, dict, list]] = []
        late: list[Reply] = []
        while self._waiting:
            since, peer, header, arrays = self._waiting[0]
            book = header.get("book")
            if type(book) is int and book > self._epoch:
                if now - since <= self.config.timeout:
                    break
                late.append(Reply(peer, error_header(header["id"], "DeadlineError", (
                    f"{self.state.name} never heard of the servers' book epoch {book} the request was "
                    f"sent by (it holds {self._epoch}) within {self.config.timeout:g}s (KVSTORE_TIMEOUT)"))))
            else:
                ready.append((peer, header, arrays))
            self._waiting.pop(0)
        return ready, late

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
