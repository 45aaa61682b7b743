"""A worker's side of replicated servers (``KVSTORE_REPLICAS=1``): where each
server's share of chunks is served now, the numbers of its pushes, and what it
must send again when a server dies (docs/reliability.md, "Replicated servers").

The placement of chunks never changes (kvstore.sharding: a chunk belongs to the
*share* of server s). :class:`Failover` maps each share to the server that serves
it now, as the scheduler's book says (tracker.control.failover; the heartbeat
thread keeps the latest, :attr:`tracker.control.membership.Membership.servers`).
The :class:`~kvstore.worker.client.Client` asks it at every request and every
wait:

- :meth:`Failover.route`: the server a request for a share goes to;
- :meth:`Failover.number`: a push's ``rounds`` field, this worker's count of its
  pushes of each chunk (1, 2, ...), by which the promoted backup applies no round
  twice and loses none;
- :meth:`Failover.keep`: a copy of every request until its reply came (the
  caller's buffers may change once a push returns), which the client sends again,
  in order, to the new server of its share when the book says its server died
  (:meth:`Failover.moved`); that server may be a replacement started since
  (``--restart-servers``), which the client connects to first (:meth:`Failover.advert`).
  A push answered before its round was on the backup (the reply's ``ticket``:
  kvstore.server.replication.ReplyGate.early) stays kept until a reply from the
  same server says that ticket is ``durable`` (:meth:`Failover.durable`); when
  that server dies first, it is sent again too (:meth:`Failover.unconfirmed`), its
  number telling the new server whether the backup had applied it.

:func:`replicated_config` checks at ``create`` what replicated servers support
and refuses the rest, naming the setting.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from tracker.control.membership import ServersBook

from ..config import Config
from ..errors import ConfigError
from ..modes import ConsistencyMode
from ..protocol import ops

# requests numbered per chunk (Failover.number): the only ones kept after their reply
PUSHES = frozenset({ops.PUSH, ops.PUSHPULL, ops.PUSH_ROWS, ops.PUSH_DYN})
RESENT = -1     # (Failover._answered_by) a push its dead server answered, sent again, not answered since


def replicated_config(config: Config, mode: ConsistencyMode, kind: str) -> Config:
    """The store's configuration with replicated servers: requests go over plain
    ZeroMQ tcp (no shared memory, no writes into the servers' sums, no data
    channel), so that any of them can be sent again to another server. Raises
    ConfigError for what is not built yet."""
    def refuse(what: str) -> ConfigError:
        return ConfigError(f"kvstore.create({kind!r}): KVSTORE_REPLICAS=1 with {what} is not built yet "
                           "(docs/reliability.md, replicated servers); unset KVSTORE_REPLICAS")
    if config.num_servers is not None and config.num_servers < 2:
        raise ConfigError(f"kvstore.create({kind!r}): KVSTORE_REPLICAS=1 needs at least 2 servers (a backup on "
                          f"another server); this job has {config.num_servers}")
    if config.server_device != "cpu":
        raise refuse("KVSTORE_SERVER_DEVICE=gpu")
    if mode.bounded and config.elastic is not None:
        # a joiner's clock starts at the slowest member's, not at its push numbers, which are
        # what a promoted replica's clocks are rebuilt from (kvstore.server.ssp.Ssp.adopt)
        raise refuse(f"{kind} and elastic workers (--elastic)")
    return config.replace(transport="tcp", data_channel=False, write_in=False)


class Failover:
    """Routes, push numbers and kept requests of one worker's client for
    ``num_servers`` shares. Example (what Client does)::

        failover = Failover(3)
        server = failover.route(share)                   # where to send now
        fields["rounds"] = failover.number(op, chunks)   # pushes only
        failover.keep(req_id, share, op, fields, arrays)
        for server in failover.moved(membership.servers): ...   # dead ones: send again
    """

    def __init__(self, num_servers: int):
        self._route = list(range(num_servers))
        self._added: tuple = ()       # the replacement servers' adverts (ranks num_servers and up)
        self._epoch = 0
        self._pushes: dict[tuple, int] = {}
        self._kept: dict[int, tuple[int, str, dict, list]] = {}
        # pushes answered ahead of their backup: server -> [(ticket, request id)], in reply order
        self._unconfirmed: dict[int, deque[tuple[int, int]]] = {}
        self._answered_by: dict[int, tuple[int, str]] = {}    # request id -> (server, what)

    @property
    def epoch(self) -> int:
        """The epoch of the servers' book this worker routes by (0: as the job formed)."""
        return self._epoch

    def route(self, share: int) -> int:
        """The server that serves ``share`` now."""
        return self._route[share]

    def live(self) -> list[int]:
        """The servers that serve some share now, ascending."""
        return sorted(set(self._route))

    def number(self, op: str, chunks) -> list[int] | None:
        """A push's (pushpull's, row-sparse or dynamic rows push's) ``rounds``: this
        worker's count of its pushes of each chunk (a row table's chunk: ``[key,
        server]``), this one included; None for other requests."""
        if op not in PUSHES or not chunks:
            return None
        numbers = []
        for chunk in chunks:
            cid = tuple(chunk)
            self._pushes[cid] = n = self._pushes.get(cid, 0) + 1
            numbers.append(n)
        return numbers

    @staticmethod
    def owned(arrays) -> list:
        """Copies of a request's buffers, which stay valid whatever the caller does
        with its own (they are what is sent, and sent again after a failover)."""
        return [np.array(a, copy=True) for a in arrays]

    def keep(self, req_id: int, share: int, op: str, fields: dict, arrays: list) -> None:
        """Keep request ``req_id`` (for ``share``) until :meth:`answered`."""
        self._kept[req_id] = (share, op, {k: v for k, v in fields.items() if k != "seq"}, arrays)

    def answered(self, req_id: int, server: int = -1, header: dict | None = None, what: str = "") -> None:
        """Request ``req_id`` was answered by ``server`` (its reply's ``header``):
        forgotten, unless it is a push answered before the backup had its round (an
        ``ok`` with a ``ticket``): kept until :meth:`durable` says so. A push answered
        with an error was not applied: it is never sent again."""
        kept = self._kept.get(req_id)
        if kept is None:
            return
        ticket = header.get("ticket") if header is not None and header.get("op") == ops.OK else None
        if type(ticket) is not int or kept[1] not in PUSHES:
            del self._kept[req_id]
            self._answered_by.pop(req_id, None)
            return
        self._unconfirmed.setdefault(server, deque()).append((ticket, req_id))
        self._answered_by[req_id] = (server, what)

    def durable(self, server: int, upto) -> None:
        """A reply from ``server`` says everything up to ticket ``upto`` is on its
        backups: the pushes it answered ahead of them are forgotten."""
        queue = self._unconfirmed.get(server)
        if not queue or type(upto) is not int:
            return
        while queue and queue[0][0] <= upto:
            req_id = queue.popleft()[1]
            if self._answered_by.get(req_id, (None,))[0] == server:
                del self._answered_by[req_id]
                self._kept.pop(req_id, None)

    def unconfirmed(self, dead: set[int]) -> list[tuple[int, str]]:
        """(request id, what) of the pushes that a server in ``dead`` answered before its
        backup had them, to send again: they stay kept, and count as :meth:`resent`
        until their new server answers them."""
        out = [(req_id, what) for req_id, (server, what) in self._answered_by.items() if server in dead]
        for server in dead:
            self._unconfirmed.pop(server, None)
        for req_id, what in out:
            self._answered_by[req_id] = (RESENT, what)
        return out

    def resent(self) -> list[int]:
        """The request ids of those pushes sent again and not answered yet."""
        return [req_id for req_id, (server, _) in self._answered_by.items() if server == RESENT]

    def unsettled(self) -> list[int]:
        """The shares of the pushes answered ahead of their backups, one per server."""
        shares: dict[int, int] = {}
        for req_id, (server, _) in self._answered_by.items():
            if server != RESENT:
                shares.setdefault(server, self._kept[req_id][0])
        return sorted(shares.values())

    def kept(self, req_id: int) -> tuple[int, str, dict, list] | None:
        """(share, op, header fields without ``seq``, buffers) of a kept request."""
        return self._kept.get(req_id)

    def moved(self, book: ServersBook) -> set[int]:
        """Apply the servers' book if newer: the servers that serve no share any more
        (dead: their requests are sent again). A replacement server that serves a
        share now (``--restart-servers``) has its advert in ``book.added``
        (:meth:`advert`)."""
        if book.epoch <= self._epoch or len(book.owners) != len(self._route):
            return set()
        self._epoch = book.epoch
        self._added = tuple(book.added)
        before = set(self._route)
        self._route = [int(o) for o in book.owners]
        return before - set(self._route)

    def advert(self, server: int) -> str:
        """The advert of replacement server ``server`` (ranked past the job's servers)."""
        return self._added[server - len(self._route)]
