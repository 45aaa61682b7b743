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

A *replacement* server (``--restart-servers``: rank ``num_servers``, then one
more for each) joins with :meth:`ServerBook.server_joined`: it becomes the backup
of every share that has none (their owners rebuild the replica on it) and serves
no share until a death promotes it. Its replica counts only once its owner
reported it rebuilt (:meth:`ServerBook.replica_rebuilt`): an owner that dies
before is a chain's second failure, as above.

The book's ``epoch`` grows by one at each change; nodes hear ``owners``,
``backups``, ``rebuilding`` and the replacements' addresses (``added``) with it
and act on a newer epoch only. Pure: no sockets, no clocks.

Example::

    book = ServerBook(3, ["h0", "h0", "h1"])
    book.backups              # [2, 2, 0]: another host where there is one
    lost = book.server_died(2, "was killed by SIGKILL")   # None: shares 0, 1 lose their replica...
    book.owners               # [0, 1, 0]: ...and server 0 serves share 2 now
    book.server_joined(3, "tcp://h1:7000 ...")           # [0, 1, 2]: server 3 backs them up
    book.replica_rebuilt(2, 3)                            # True: share 2 survives a failure again
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
        self.added: list[str] = []            # the replacements' adverts: server num_servers + i
        self.rebuilding: dict[int, int] = {}  # share -> the replacement its replica is being rebuilt on

    def _backup_for(self, s: int, hosts: list[str]) -> int:
        """The next server in the ring after ``s`` on another host, else the next one."""
        ring = [(s + k) % self.num_servers for k in range(1, self.num_servers)]
        return next((r for r in ring if hosts[r] != hosts[s]), ring[0])

    def fields(self) -> dict:
        """What nodes hear of the book (in ``registered``, every ``ack`` and ``servers``):
        with the dead servers (``dead``: [rank, why] pairs, in order), for each share
        without a complete replica the dead server it went with (``lost_with``) and,
        once a replacement joined, the replacements' adverts (``added``) and the shares
        whose replica is still being rebuilt on one (``rebuilding``), so that a restarted
        scheduler rebuilds the whole book from what a node re-registers with (:meth:`restore`)."""
        fields = {"book_epoch": self.epoch, "owners": list(self.owners), "backups": list(self.backups),
                  "dead": [[rank, why] for rank, why in self.dead.items()],
                  "lost_with": [self._unreplicated_by.get(s) for s in range(self.num_servers)]}
        if self.added:
            fields.update(added=list(self.added), rebuilding=sorted(self.rebuilding))
        return fields

    @classmethod
    def restore(cls, num_servers: int, fields: dict) -> "ServerBook":
        """The book a node reported (:meth:`fields`, as it last heard it), for a
        restarted scheduler. Raises ValueError naming the field that does not fit a
        book of ``num_servers`` shares (a node of another job, a malformed report).

        What holds in every book: server ranks are below ``num_servers`` plus the
        replacements (``added``); no owner or backup is dead, nobody died twice; a
        share being rebuilt is backed up by a replacement; and the epoch counts every
        death and every replacement joined, plus at most one rebuilt replica per
        share and replacement (those are not listed), so
        ``len(dead) + len(added) <= epoch <= len(dead) + len(added) * (1 + num_servers)``."""
        book = cls(num_servers, [""] * num_servers)

        def bad(name: str, value, why: str) -> ValueError:
            return ValueError(f"a servers' book that does not fit this job's {num_servers} servers: "
                              f"{name} {value!r:.60} {why}")

        added = fields.get("added", [])
        if not (isinstance(added, list) and all(isinstance(a, str) for a in added)):
            raise bad("added", added, "must be a list of the replacements' adverts")
        ranks = num_servers + len(added)
        rank = lambda r: type(r) is int and 0 <= r < ranks   # noqa: E731
        owners, backups = fields.get("owners"), fields.get("backups")
        for name, value, ok in (("owners", owners, rank), ("backups", backups, lambda b: b is None or rank(b)),
                                ("lost_with", fields.get("lost_with", [None] * num_servers),
                                 lambda x: x is None or rank(x))):
            if not (isinstance(value, list) and len(value) == num_servers and all(ok(v) for v in value)):
                raise bad(name, value, f"must list {num_servers} server ranks below {ranks}")
        lost = fields.get("lost_with", [None] * num_servers)
        assert isinstance(owners, list) and isinstance(backups, list)   # checked above
        dead = fields.get("dead", [])
        if not (isinstance(dead, list) and all(isinstance(d, list) and len(d) == 2 and rank(d[0])
                                               and isinstance(d[1], str) for d in dead)):
            raise bad("dead", dead, f"must list [rank, why] pairs of server ranks below {ranks}")
        book.dead = {d[0]: d[1] for d in dead}
        if len(book.dead) != len(dead):
            raise bad("dead", dead, "names a server twice")
        if any(o in book.dead for o in owners) or any(b in book.dead for b in backups if b is not None):
            raise bad("owners", owners, f"or backups {backups!r:.60} include a dead server ({sorted(book.dead)})")
        rebuilding = fields.get("rebuilding", [])
        if not (isinstance(rebuilding, list) and all(type(s) is int and 0 <= s < num_servers
                                                    and type(backups[s]) is int and backups[s] >= num_servers
                                                    for s in rebuilding)):
            raise bad("rebuilding", rebuilding, "must list shares backed up by a replacement")
        epoch, least = fields.get("book_epoch"), len(dead) + len(added)
        if not (type(epoch) is int and least <= epoch <= least + len(added) * num_servers):
            raise bad("book_epoch", epoch, f"must count its {len(dead)} dead and {len(added)} replacement "
                      f"server(s): {least} to {least + len(added) * num_servers}")
        book.epoch, book.owners, book.backups, book.added = epoch, list(owners), list(backups), list(added)
        book.rebuilding = {s: backups[s] for s in rebuilding}
        book._unreplicated_by = {s: x for s, x in enumerate(lost) if x is not None}
        return book

    @property
    def ranks(self) -> int:
        """Server ranks given so far: the job's servers and the replacements."""
        return self.num_servers + len(self.added)

    def server_joined(self, rank: int, advert: str) -> list[int]:
        """Replacement server ``rank`` (the next one: :attr:`ranks`) joined with
        ``advert``: it becomes the backup of every share without one (its replica
        is rebuilt by the share's owner). Returns those shares; a new epoch.
        Raises ValueError for another rank."""
        if rank != self.ranks:
            raise ValueError(f"a replacement server registers as server {self.ranks} (the next rank), "
                             f"not {rank}")
        self.added.append(advert)
        shares = self._back_up(rank)
        self.epoch += 1
        return shares

    def _back_up(self, rank: int) -> list[int]:
        """Replacement ``rank`` becomes the backup of every share without one."""
        shares = [share for share, backup in enumerate(self.backups) if backup is None]
        for share in shares:
            self.backups[share] = rank
            self.rebuilding[share] = rank
        return shares

    def _spare(self) -> int | None:
        """A live replacement that serves no share and backs up none (it joined when
        every share had a backup), or None."""
        busy = set(self.owners) | set(self.backups)
        return next((r for r in range(self.num_servers, self.ranks) if r not in self.dead and r not in busy),
                    None)

    def replica_rebuilt(self, share: int, backup: int) -> bool:
        """The owner of ``share`` says its replica on ``backup`` is complete (the
        backup acknowledged the rebuild): from now on the chain survives a failure.
        True when that changed the book (a new epoch); an old report changes nothing."""
        if self.rebuilding.get(share) != backup or self.backups[share] != backup:
            return False
        del self.rebuilding[share]
        self._unreplicated_by.pop(share, None)
        self.epoch += 1
        return True

    def server_died(self, rank: int, why: str) -> str | None:
        """Server ``rank`` died ``why``: promote the backups of its shares. Returns
        None when every share still has a live owner (a new epoch), else why the job
        must end, naming both servers (a share lost with its replica; nothing changes)."""
        if rank in self.dead:
            return None
        for share, owner in enumerate(self.owners):
            if owner == rank and (self.backups[share] is None or share in self.rebuilding):
                first = self._unreplicated_by[share]
                where = (f" (its rebuild on server {self.rebuilding[share]} had not completed)"
                         if share in self.rebuilding else "")
                return (f"server {rank} {why}; the chunks it held (server {share}'s share) had no replica any more"
                        f"{where}: server {first} died before ({self.dead[first]}). Two failures of one replication "
                        f"chain (servers {first} and {rank}) before its replica was rebuilt: KVSTORE_REPLICAS=1 "
                        "survives one (--restart-servers rebuilds it)")
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
                self.rebuilding.pop(share, None)
                self._unreplicated_by[share] = rank
        spare = self._spare()
        if spare is not None:          # a replacement that waited for work backs up what lost its replica
            self._back_up(spare)
        self.epoch += 1
        return None

    def promoted(self, rank: int) -> list[int]:
        """The shares server ``rank`` serves now that were not its own."""
        return [share for share, owner in enumerate(self.owners) if owner == rank and share != rank]
