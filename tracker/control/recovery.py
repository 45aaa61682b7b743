"""A restarted scheduler's recovery: what the job's members re-register with, and
who must still do so before the job goes on (docs/architecture.md §8.2).

A launcher restarts a scheduler that died on the same address, port, secret and
job id. The new one knows nothing of the job but its size, so every member tells
it what it knows (a ``register`` whose ``rejoin`` field is a :class:`Report`): the
servers' book (replicated servers: owners, backups, the dead, the replacements), the membership
epoch and members (elastic jobs), which workers finished (as the servers heard
it), whether the servers were told to shut down, the job's saved progress, and
(workers) the last barrier release each heard: the old scheduler may have released
a barrier to some workers only, and the others are answered with it
(:meth:`~.records.Barrier.replay`). The launcher replays the exits it saw (:meth:`Recovery.exited`). From these,
:meth:`Recovery.missing` says who is still expected: every server the newest
book does not list as dead (a replacement server too: ranks from ``num_servers``), every worker that has not finished (elastic: every
member), less the processes that ended. Until nobody is missing, the scheduler
completes nothing (no barrier, no finish): the job is paused at its next
control-plane call, while rounds between workers and servers go on.

Pure: no sockets, no clocks (the deadline is a number the caller compares).

Example::

    rec = Recovery(2, 3, elastic=False, job="6f1c")
    rec.add("server-0-...", read_report({"book": None, "epoch": 0, "members": [0, 1],
                                         "finished_workers": [], "shutdown": False,
                                         "progress": {}, "job": "6f1c"}, 2, 3, "6f1c"))
    rec.missing({("server", 0)})   # [("server", 1), ("server", 2), ("worker", 0), ("worker", 1)]
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from .errors import RendezvousError
from .failover import ServerBook
from .records import Released, read_released

PROGRESS_BYTES = 64 << 10   # as tracker.control.elastic's bound on a saved progress
ADDRESS_CHARS = 1024        # a server's data-plane address (its advert) in a report


@dataclass(frozen=True)
class Report:
    """What one node knows of the job when it re-registers (register's ``rejoin``)."""
    book: dict | None                # the servers' book as last heard (ServerBook.fields), or None
    epoch: int                       # the membership epoch it holds
    members: tuple[int, ...]         # the worker ranks of that epoch
    finished_workers: frozenset      # (servers) the workers it heard finished
    shutdown: bool                   # (servers) it was told to shut down
    progress: dict                   # the job's progress as last heard
    barrier: Released | None = None  # (workers) the last barrier's release it heard
    servers: tuple[str, ...] = ()    # the job's servers' data-plane addresses by rank, as it registered


def read_report(rejoin, worker_ranks: int, num_servers: int, job: str) -> Report:
    """``rejoin`` validated (a node of this job: ``worker_ranks`` worker ranks, ``num_servers``
    servers, ``job`` its id). Raises RendezvousError naming the first bad field."""
    if not isinstance(rejoin, dict):
        raise RendezvousError(f"register's 'rejoin' must be a map, not {type(rejoin).__name__}")
    ranks = lambda v, n: isinstance(v, list) and all(type(r) is int and 0 <= r < n for r in v)  # noqa: E731
    other = rejoin.get("job", "")
    if not isinstance(other, str) or (other and other != job):
        raise RendezvousError(f"a node of job {other!r:.60} registered again with the scheduler of job {job!r}")
    book = rejoin.get("book")
    if book is not None:
        if not isinstance(book, dict):
            raise RendezvousError("rejoin's 'book' must be a map or nil")
        try:
            ServerBook.restore(num_servers, book)
        except ValueError as e:
            raise RendezvousError(f"rejoin's 'book': {e}") from None
    epoch, members = rejoin.get("epoch"), rejoin.get("members")
    if type(epoch) is not int or not -1 <= epoch < 2 ** 62:
        raise RendezvousError(f"rejoin's 'epoch' must be an integer, not {epoch!r:.60}")
    if not isinstance(members, list) or not ranks(members, worker_ranks):
        raise RendezvousError(f"rejoin's 'members' must be a list of worker ranks below {worker_ranks}")
    finished = rejoin.get("finished_workers")
    if not isinstance(finished, list) or not ranks(finished, worker_ranks):
        raise RendezvousError(f"rejoin's 'finished_workers' must be a list of worker ranks below {worker_ranks}")
    shutdown, progress = rejoin.get("shutdown"), rejoin.get("progress")
    if type(shutdown) is not bool:
        raise RendezvousError("rejoin's 'shutdown' must be true or false")
    if not isinstance(progress, dict) or len(msgpack.packb(progress, use_bin_type=True)) > PROGRESS_BYTES:
        raise RendezvousError(f"rejoin's 'progress' must be a map of at most {PROGRESS_BYTES} bytes")
    servers = rejoin.get("servers", [])
    if not (isinstance(servers, list) and len(servers) in (0, num_servers)
            and all(isinstance(a, str) and len(a) <= ADDRESS_CHARS for a in servers)):
        raise RendezvousError(f"rejoin's 'servers' must list the {num_servers} servers' addresses "
                              f"(strings of at most {ADDRESS_CHARS} characters)")
    return Report(book, epoch, tuple(sorted(set(members))), frozenset(finished), shutdown, progress,
                  read_released(rejoin.get("barrier"), worker_ranks), tuple(servers))


class Recovery:
    """The reports of the nodes that registered again with a restarted scheduler
    of a job of ``worker_ranks`` worker ranks and ``num_servers`` servers, and the exits
    its launcher replayed."""

    def __init__(self, worker_ranks: int, num_servers: int, *, elastic: bool, job: str):
        self.worker_ranks = worker_ranks
        self.num_servers = num_servers
        self.elastic = elastic
        self.job = job
        self.reports: dict[str, Report] = {}      # node id -> its report (a formed job's members)
        self.exited: dict[tuple[str, int], int] = {}   # (role, rank) -> status, as the launcher saw

    def add(self, node_id: str, report: Report) -> None:
        self.reports[node_id] = report

    def drop(self, node_id: str) -> None:
        self.reports.pop(node_id, None)

    def exit(self, role: str, rank: int, code: int) -> None:
        """The launcher saw the process of ``role`` ``rank`` end with ``code``."""
        self.exited[(role, rank)] = code

    def book(self) -> ServerBook | None:
        """The newest servers' book reported (the highest epoch), or None."""
        books = [r.book for r in self.reports.values() if r.book is not None]
        if not books:
            return None
        return ServerBook.restore(self.num_servers, max(books, key=lambda b: b["book_epoch"]))

    def membership(self) -> tuple[int, tuple[int, ...]]:
        """The newest (epoch, members) reported."""
        best = max(self.reports.values(), key=lambda r: r.epoch)
        return best.epoch, best.members

    def finished_workers(self) -> frozenset:
        """The workers some server heard finished (all, once one was told to shut down)."""
        if any(r.shutdown for r in self.reports.values()):
            return frozenset(range(self.worker_ranks))
        return frozenset().union(*(r.finished_workers for r in self.reports.values()))

    def progress(self) -> dict:
        """The job's progress as its members last heard it (the newest epoch's first non-empty)."""
        ordered = sorted(self.reports.values(), key=lambda r: -r.epoch)
        return next((r.progress for r in ordered if r.progress), {})

    def barrier(self) -> Released | None:
        """The newest barrier release a worker heard (the highest number), or None:
        the scheduler before the restart may have sent it to some workers only."""
        heard = [r.barrier for r in self.reports.values() if r.barrier is not None]
        return max(heard, key=lambda b: b.number, default=None)

    def addresses(self) -> tuple[str, ...]:
        """The job's servers' addresses by rank as the nodes registered with them (those
        of servers that died before the restart included), or () if none reported them."""
        return next((r.servers for r in self.reports.values() if r.servers), ())

    def missing(self, registered: set) -> list[tuple[str, int]]:
        """The (role, rank) still expected to register again: ``registered`` holds those
        that did. Without any report (the job had not formed), every node of the job."""
        if not self.reports:
            want = [("server", s) for s in range(self.num_servers)] + [("worker", w) for w in range(self.worker_ranks)]
            return [n for n in want if n not in registered]
        book = self.book()
        dead = set(book.dead) if book is not None else set()
        workers = set(self.membership()[1]) if self.elastic else set(range(self.worker_ranks))
        workers -= self.finished_workers()
        servers = book.ranks if book is not None else self.num_servers   # replacements included
        want = [("server", s) for s in range(servers) if s not in dead] + \
            [("worker", w) for w in sorted(workers)]
        return [n for n in want if n not in registered and n not in self.exited]
