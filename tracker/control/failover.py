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
        """What nodes hear of the book (in ``registered``, every ``ack`` and ``servers``)."""
        fields = {"book_epoch": self.epoch, "owners": list(self.owners), "backups": list(self.backups)}
        if self.added:
            fields.update(added=list(self.added), rebuilding=sorted(self.rebuilding))
        return fields

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
