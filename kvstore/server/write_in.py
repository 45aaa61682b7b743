"""Writing in: the queue of co-located workers' writes into a server's sums.

Writing in (sync mode, co-located workers, values in shared memory): instead of
pushing a gradient, a worker asks to ``write`` its chunks and is granted, per
chunk, the round's accumulator in our memory, to copy its gradient into (it opens
the round) or add it to (the round has a sum already). One worker writes into a
round at a time; a request is granted all of its chunks at once or waits, so no
two requests can wait on each other. ``written`` ends the grant: the worker then
counts as having pushed, and is answered as a pushpull. Pushes that arrive while a
worker writes into their round are added after it is done.

A write counts as its worker's push from the moment it arrives: the worker's
later pull of those chunks waits for the write's round (read-your-writes), and its
later push or write of a chunk that an earlier write of its own still waits for
is queued behind it, so that each takes its rounds in the order they were sent.

:class:`WriteQueue` is that queue, a collaborator of the round owner
(:class:`kvstore.server.sync.Sync`): it keeps the writes queued (and the pushes
held behind them) in the order they came, offers each to the owner when its
worker's earlier requests on its chunks have gone, and keeps the grants until
``written``; it reads the ``write`` and ``written`` requests (docs/protocol.md
section 4). It never looks into a round: the owner decides whether a write can be
granted, opens and ends the writes into its rounds, and hands each grant the
rounds it wrote into, which the queue keeps only to give back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import ProtocolError
from .requests import chunk_ids, worker_of
from .rounds import is_int


@dataclass
class Grant:
    peer: object
    req_id: int
    worker: int
    ids: list             # chunk ids, in order
    chunks: list          # their StoredChunk
    want_values: bool
    rounds: list = field(default_factory=list)   # the owner's rounds written into, per chunk, once granted
    error: str | None = None   # its rounds failed while it wrote: `written` gets this


@dataclass
class HeldPush:
    """A validated sync push queued behind an earlier, not yet granted write of its
    worker on one of its chunks."""
    peer: object
    req_id: int
    worker: int
    ids: list
    chunks: list
    arrays: list
    want_values: bool
    rows: list | None = None     # its lazy rows per chunk (Sync.push's ``rows``)


def write_request(header: dict, num_workers: int) -> tuple[int, list[tuple], bool]:
    """A ``write`` request's sender, chunk ids and ``values`` (no buffers, sync mode,
    shared sums: checked by the caller)."""
    worker = worker_of(header, num_workers)
    ids = chunk_ids(header, None)
    want_values = header.get("values", True)
    if not isinstance(want_values, bool):
        raise ProtocolError("'values' must be true or false")
    return worker, ids, want_values


class WriteQueue:
    """The writes into a round owner's sums: queued ones (and pushes held behind
    them) and granted ones, until ``written``."""

    def __init__(self) -> None:
        self._queue: list = []      # Grant (write requests) and HeldPush, oldest first
        self._grants: dict = {}     # (worker, write id) -> granted Grant

    def queue(self, grant: Grant) -> None:
        """A validated write request, queued; refused if its id is already open."""
        if (grant.worker, grant.req_id) in self._grants or any(
                isinstance(g, Grant) and (g.worker, g.req_id) == (grant.worker, grant.req_id) for g in self._queue):
            raise ProtocolError(f"write request id {grant.req_id} of worker {grant.worker} is already open")
        self._queue.append(grant)

    def hold(self, push: HeldPush) -> None:
        """Queue a validated push behind its worker's earlier write."""
        self._queue.append(push)

    # -- a worker's order: a write counts as its push from the moment it arrives --------
    def queued(self, worker: int, cid) -> bool:
        """Whether ``worker`` has a write on ``cid`` (or a push behind one) still queued."""
        return bool(self._queue) and any(e.worker == worker and cid in e.ids for e in self._queue)

    def waiting(self) -> bool:
        """Whether any write (or push held behind one) is queued."""
        return bool(self._queue)

    def ahead(self, worker: int, ids) -> bool:
        """Whether a queued write (or held push) of ``worker`` shares a chunk with ``ids``."""
        if not self._queue:
            return False
        wanted = set(ids)
        return any(e.worker == worker and not wanted.isdisjoint(e.ids) for e in self._queue)

    def advance(self, grant: Callable[[Grant], bool], join: Callable[[HeldPush], None]) -> None:
        """Offer the queue to the round owner, oldest first: each write to
        ``grant`` (whether it left the queue: granted, or refused), each held push to
        ``join``. A worker's requests on a chunk go in the order they came: one is
        offered only once its worker's earlier ones on its chunks have left. (The
        queue, as the owner's calls see it, changes only when all were offered.)"""
        still = []
        behind: dict = {}      # worker -> chunk ids of its requests still queued
        for entry in self._queue:
            blocked = behind.setdefault(entry.worker, set())
            if not blocked.isdisjoint(entry.ids):
                still.append(entry)
                blocked.update(entry.ids)
            elif isinstance(entry, HeldPush):
                join(entry)
            elif not grant(entry):
                still.append(entry)
                blocked.update(entry.ids)
        self._queue = still

    def granted(self, grant: Grant, rounds: list) -> None:
        """``grant`` was given ``rounds`` (the owner's, one per chunk): it waits for its
        ``written``, which gives them back."""
        grant.rounds = rounds
        self._grants[(grant.worker, grant.req_id)] = grant

    def take(self, header: dict, num_workers: int) -> tuple[int, Grant]:
        """A ``written`` request's sender and the grant it ends (no longer open)."""
        worker = worker_of(header, num_workers)
        gid = header.get("grant")
        grant = self._grants.pop((worker, gid), None) if is_int(gid) else None
        if grant is None:
            raise ProtocolError(f"'written' names no write granted to worker {worker}: {gid!r}")
        return worker, grant

    # -- writes that cannot go on ----------------------------------------------------------
    def drain(self) -> list:
        """Every queued write and held push, taken out of the queue (a worker
        finished: the rounds they would join cannot complete)."""
        queued, self._queue = self._queue, []
        return queued

    def fail_grants_into(self, rnd, message: str) -> None:
        """The grants that wrote into ``rnd`` (which will never be applied) get
        ``message`` at their ``written``."""
        for grant in self._grants.values():
            if any(r is rnd for r in grant.rounds):
                grant.error = grant.error or message

    def leave(self, worker: int) -> list:
        """``worker`` left the job: its queued writes and held pushes are dropped and
        returned (to be answered with an error), its grants forgotten."""
        queued = [entry for entry in self._queue if entry.worker == worker]
        self._queue = [entry for entry in self._queue if entry.worker != worker]
        for key in [key for key in self._grants if key[0] == worker]:
            del self._grants[key]
        return queued
