"""The server node's side of replicated servers (``KVSTORE_REPLICAS=1``): the
connection to its backup, the replies held until the backups acknowledged, and
the servers' book as the scheduler publishes it (tracker.control.failover).

The state machine decides what is replicated (kvstore.server.replication); this
module moves it: :meth:`ReplicaLink.after` sends the ``replicate`` requests an
event made, each on a DEALER socket to its share's backup's tcp address
(sequenced like a worker's requests), and passes the event's replies through the
:class:`~kvstore.server.replication.ReplyGate`; :meth:`ReplicaLink.acks` reads the
backups' answers and returns the replies they release. :meth:`ReplicaLink.book`
applies a new epoch of the servers' book: a dead primary's replica is promoted
into the state, a dead backup's replica is given up (the held replies leave), and
a replacement that became a share's backup (``--restart-servers``) gets the
share rebuilt (values, round counts, optimizer and its state, as of that event:
later rounds follow in order); once it acknowledged all of it,
:attr:`ReplicaLink.rebuilt` names it, for the scheduler.

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

from tracker.control.membership import ServersBook

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
    """Server ``rank``'s links to the backups of the shares it serves, among
    ``servers`` (their adverts, whose first word is the tcp URL; replacements'
    come with the book), for ``state``. Example (what ServerNode does)::

        link = ReplicaLink(config, ctx, rank, reg.servers, state)
        link.book(membership.servers)        # the backups, the replicas held, promotions
        send(link.after(state.handle(...)))  # replicate, then hold the replies
        send(link.acks())                    # when a backup's socket is readable
        membership.rebuilt = link.rebuilt    # replicas rebuilt on replacements, for the scheduler
    """

    def __init__(self, config: Config, ctx: zmq.Context, rank: int, servers: list[str], state: ServerState):
        self.config = config
        self.rank = rank
        self.state = state
        self.gate = ReplyGate()
        self._ctx = ctx
        # a dead server's advert is "" from a restarted scheduler (it never registered with
        # it): a dead server is never a backup, so its URL is never used
        self._urls = [(advert.split() or [""])[0] for advert in servers]
        self._num_servers = len(servers)     # the shares (replacements' adverts come later)
        self._socks: dict[int, zmq.Socket] = {}   # backup rank -> DEALER
        self._seqs: dict[int, int] = {}
        self._sent: dict[int, set[int]] = {}      # backup rank -> its replicate requests not acknowledged
        self._backups: dict[int | None, int] = {}  # share (None: its own) -> backup rank
        self._ids = itertools.count(1)
        self._epoch = -1
        self.promoted: list[int] = []      # the shares this server took over, in order
        self._waiting: list[tuple[float, bytes, dict, list]] = []   # (since, peer, header, arrays), in order
        self._rebuilding: dict[int, tuple[int, int]] = {}   # share -> (backup, the rebuild's last request id)
        self.rebuilt: list[list[int]] = []   # [share, backup] of each replica rebuilt (for the scheduler)

    @property
    def sockets(self) -> list[zmq.Socket]:
        """The backups' sockets (readable: their answers)."""
        return list(self._socks.values())

    # -- the servers' book -----------------------------------------------------------------
    def book(self, servers: ServersBook) -> list[Reply]:
        """Apply a servers' book (an older or equal epoch is ignored): connect to the
        backups of the shares this server serves, note whose replicas it holds,
        promote the replicas of the shares it now owns, and rebuild the replicas on
        a new backup (a replacement). Returns the replies now released."""
        epoch, owners, backups = servers.epoch, servers.owners, servers.backups
        if epoch <= self._epoch or not owners:
            return []
        first = self._epoch < 0
        self._epoch = epoch
        self._urls += [advert.split()[0] for advert in servers.added[len(self._urls) - self._num_servers:]]
        released: list[Reply] = []
        for share, owner in enumerate(owners):
            if owner == self.rank and share != self.rank and share not in self.promoted:
                self.promoted.append(share)
                released += self.state.promote(share)
                log.warning("%s serves server %d's chunks now (its backup; servers' book epoch %d)",
                            self.state.name, share, epoch)
        holding = frozenset(s for s, b in enumerate(backups) if b == self.rank and owners[s] != self.rank)
        for gone in self.state.replicas.primaries - holding:
            self.state.replicas.drop(gone)
        self.state.replicas.primaries = holding
        wanted: dict[int | None, int] = {}
        for share, owner in enumerate(owners):
            if owner == self.rank and backups[share] is not None:
                wanted[None if share == self.rank else share] = backups[share]
        for gone in set(self._backups.values()) - set(wanted.values()):
            log.warning("%s: its backup, server %d, is gone: the chunks it backed up have no replica now",
                        self.state.name, gone)
            released += self._disconnect(gone)
        for part, backup in wanted.items():
            if self._backups.get(part) != backup and backup not in self._socks:
                self._connect(backup)
        fresh = [part for part, backup in wanted.items() if self._backups.get(part) != backup]
        self._backups = wanted
        self.state.replication.backups = dict(wanted)
        for part in fresh if not first else ():    # a new backup mid-job: a replacement to rebuild
            count = self.state.rebuild(part)
            mine = self.rank if part is None else part
            log.warning("%s rebuilds the replica of server %d's share (%d chunks) on server %d "
                        "(servers' book epoch %d)", self.state.name, mine, count, wanted[part], epoch)
            self._rebuilding[mine] = (wanted[part], -1)
        self._rebuilding = {s: b for s, b in self._rebuilding.items()
                            if wanted.get(None if s == self.rank else s) == b[0]}
        released += self.after([])       # the rebuilds leave now, not with the next request
        return released

    def _connect(self, backup: int) -> None:
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
        self._socks[backup], self._seqs[backup], self._sent[backup] = sock, 0, set()

    def _disconnect(self, backup: int) -> list[Reply]:
        """Backup ``backup`` is gone (its replicas with it): what waited for its
        acknowledgements may leave."""
        sock = self._socks.pop(backup, None)
        if sock is not None:
            sock.close(linger=0)
        self._seqs.pop(backup, None)
        return self.gate.forget(self._sent.pop(backup, set()))

    # -- events ----------------------------------------------------------------------------
    def after(self, replies: list[Reply], early: bool = False) -> list[Reply]:
        """An event of the state machine made ``replies``: send the ``replicate``
        requests it made, each to its share's backup, then the replies that may
        leave now (the others are held until the backups acknowledged; with
        ``early``, a round's replies, all of them, each with its ``ticket``:
        :meth:`ReplyGate.early`)."""
        for fields, arrays in self.state.replication.take():
            share = fields.get("share")
            backup = self._backups[share]
            req_id = next(self._ids)
            header = replicate_request(req_id, self.rank, self._seqs[backup], fields)
            self._seqs[backup] += 1
            self._socks[backup].send_multipart(encode(header, arrays), copy=False)
            self.gate.sent(req_id)
            self._sent[backup].add(req_id)
            mine = self.rank if share is None else share
            if mine in self._rebuilding and self._rebuilding[mine][0] == backup:
                self._rebuilding[mine] = (backup, req_id)
        return self.gate.early(replies) if early else self.gate.hold(replies)

    def acks(self) -> list[Reply]:
        """Read the backups' answers; the replies they release. Raises BackupFailed
        when a backup refused one."""
        released: list[Reply] = []
        for backup, sock in list(self._socks.items()):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                header, _ = decode(frames, self.config.max_message_bytes)
                if header.get("op") != ops.OK:
                    raise BackupFailed(f"{self.state.name}'s backup, server {backup}, refused to replicate: "
                                       f"{header.get('kind')}: {header.get('message')}")
                self._sent[backup].discard(header["id"])
                released += self.gate.acknowledged(header["id"])
            for share, (to, last) in list(self._rebuilding.items()):
                if to == backup and last >= 0 and last not in self._sent[backup]:
                    del self._rebuilding[share]
                    self.rebuilt = self.rebuilt + [[share, backup]]
                    log.warning("%s: the replica of server %d's share on server %d is rebuilt",
                                self.state.name, share, backup)
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
        for sock in self._socks.values():
            sock.close(linger=0)
        self._socks.clear()
