"""Replicated servers (``KVSTORE_REPLICAS=1``): which live server holds each
server's share of chunks and which one holds its replica, as the scheduler
decides it when servers die (docs/reliability.md, docs/architecture.md).

A *share* is what server s held when the job formed (its chunks; the workers'
placement never changes). :class:`ServerBook` maps every share to its *owner*
(the server that serves it now: s itself until it dies) and its *backup* (the
server that holds a replica of it: the next server in the ring, preferring one
on another host, or None once that replica is gone). When a server dies:

- every share it owned moves to that share's backup (the backup is *promoted*),
  which then holds it without a replica;
- every share it was the backup of loses its replica (its owner goes on alone);
- a share it owned whose backup had died already is lost: the job must end,
  naming both servers (two failures of one chain before re-replication).

The book's ``epoch`` grows by one at each change; nodes hear ``owners`` and
``backups`` with it and act on a newer epoch only. Pure: no sockets, no clocks.

Example::

    book = ServerBook(3, ["h0", "h0", "h1"])
    book.backups              # [2, 2, 0]: another host where there is one
    lost = book.server_died(2, "was killed by SIGKILL")   # None: shares 0, 1 lose their replica...
    book.owners               # [0, 1, 0]: ...and server 0 serves share 2 now
"""

from __future__ import annotations


class ServerBook:
    """The owners and backups of ``num_servers`` shares (``hosts``: each server's
    registered host, to put a replica on another host where there is one)."""

    def __init__(self, num_servers: int, hosts: list[str]):
        if num_servers < 2:
            raise ValueError(f"replicated servers (KVSTORE_REPLICAS=1) need at least 2 servers; "
                             f"this job has {num_servers}")
        self.num_servers = num_servers
        self.epoch = 0
        self.owners: list[int] = list(range(num_servers))
        self.backups: list[int | None] = [self._backup_for(s, hosts) for s in range(num_servers)]
        self.dead: dict[int, str] = {}        # server rank -> why it died, in order
        self._unreplicated_by: dict[int, int] = {}   # share -> the dead server its replica went with

    def _backup_for(self, s: int, hosts: list[str]) -> int:
        """The next server in the ring after ``s`` on another host, else the next one."""
        ring = [(s + k) % self.num_servers for k in range(1, self.num_servers)]
        return next((r for r in ring if hosts[r] != hosts[s]), ring[0])

    def fields(self) -> dict:
        """What nodes hear of the book (in ``registered``, every ``ack`` and ``servers``):
        with the dead servers (``dead``: [rank, why] pairs, in order) and, for each share
        without a replica, the dead server it went with (``lost_with``), so that a
        restarted scheduler rebuilds the whole book from what a node re-registers
        with (:meth:`restore`)."""
        return {"book_epoch": self.epoch, "owners": list(self.owners), "backups": list(self.backups),
                "dead": [[rank, why] for rank, why in self.dead.items()],
                "lost_with": [self._unreplicated_by.get(s) for s in range(self.num_servers)]}

    @classmethod
    def restore(cls, num_servers: int, fields: dict) -> "ServerBook":
        """The book a node reported (:meth:`fields`, as it last heard it), for a
        restarted scheduler. Raises ValueError naming what does not fit a book of
        ``num_servers`` shares (a node of another job, a malformed report)."""
        book = cls(num_servers, [""] * num_servers)
        epoch, owners, backups = fields.get("book_epoch"), fields.get("owners"), fields.get("backups")
        dead, lost = fields.get("dead", []), fields.get("lost_with", [None] * num_servers)
        rank = lambda r: type(r) is int and 0 <= r < num_servers   # noqa: E731
        if not (type(epoch) is int and 0 <= epoch <= num_servers and isinstance(owners, list)
                and isinstance(backups, list) and isinstance(dead, list) and isinstance(lost, list)
                and len(owners) == len(backups) == len(lost) == num_servers
                and all(rank(o) for o in owners) and all(b is None or rank(b) for b in backups)
                and all(x is None or rank(x) for x in lost)
                and all(isinstance(d, list) and len(d) == 2 and rank(d[0]) and isinstance(d[1], str)
                        for d in dead) and len(dead) == epoch):
            raise ValueError(f"a servers' book that does not fit this job's {num_servers} servers: epoch "
                             f"{epoch!r:.40}, owners {owners!r:.60}, backups {backups!r:.60}, dead {dead!r:.60}, "
                             f"lost_with {lost!r:.60}")
        book.epoch, book.owners, book.backups = epoch, list(owners), list(backups)
        book.dead = {d[0]: d[1] for d in dead}
        if len(book.dead) != epoch or any(o in book.dead for o in owners):
            raise ValueError(f"a servers' book whose owners {owners!r:.60} include a dead server "
                             f"({sorted(book.dead)!r:.60}) or that names one dead twice")
        book._unreplicated_by = {s: x for s, x in enumerate(lost) if x is not None}
        return book

    def server_died(self, rank: int, why: str) -> str | None:
        """Server ``rank`` died ``why``: promote the backups of its shares. Returns
        None when every share still has a live owner (a new epoch), else why the job
        must end, naming both servers (a share lost with its replica; nothing changes)."""
        if rank in self.dead:
            return None
        for share, owner in enumerate(self.owners):
            if owner == rank and self.backups[share] is None:
                first = self._unreplicated_by[share]
                return (f"server {rank} {why}; the chunks it held (server {share}'s share) had no replica any more: "
                        f"server {first} died before ({self.dead[first]}). Two failures of one replication "
                        f"chain (servers {first} and {rank}) before its replica was rebuilt: KVSTORE_REPLICAS=1 "
                        "survives one")
        self.dead[rank] = why
        for share in range(self.num_servers):
            if self.owners[share] == rank:
                backup = self.backups[share]
                assert backup is not None          # checked above
                self.owners[share] = backup
                self.backups[share] = None
                self._unreplicated_by[share] = rank
            elif self.backups[share] == rank:
                self.backups[share] = None
                self._unreplicated_by[share] = rank
        self.epoch += 1
        return None

    def promoted(self, rank: int) -> list[int]:
        """The shares server ``rank`` serves now that were not its own."""
        return [share for share, owner in enumerate(self.owners) if owner == rank and share != rank]
