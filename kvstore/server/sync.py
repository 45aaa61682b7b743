"""Synchronous mode (BSP, ``dist_sync``): the consistency strategy whose pushes
merge into rounds, one per chunk at a time, each applied once.

Per chunk, pushes are merged into a round until every worker contributed once (in
an elastic job, a slot that is not a member counts with nothing:
kvstore.server.members); then the round is applied once (assigned, or given to
the optimizer) and every push that joined it is acknowledged. A worker that
pushes again before its round completed starts the next round. A pull is answered
once the sender has no push pending on the chunk (a pushpull once its own round
is applied), so a worker always reads the result of its own last push's round (a
write it was granted, or asked for, counts as a push: kvstore.server.writein). If
the optimizer fails on a round, exactly the requests that depended on that round
get the error; later rounds proceed.

When the scheduler reports that a worker finished (:meth:`Sync.workers_finished`),
every round still waiting for it fails at once naming it, and so does every later
push: such a round can never complete. A worker that left an elastic job
(:meth:`Sync.left`) is counted, contributing nothing, in every queued round it has
not pushed to.

:class:`Sync` owns the requests parked on rounds and its write-in grants
(:class:`~kvstore.server.writein.WriteIn`); the chunks and their rounds live in the
server's :class:`~kvstore.server.chunks.ChunkTable`. Pure: no sockets, threads or
clocks.
"""

from __future__ import annotations

import numpy as np

from ..protocol import chunk_label, error_header
from ..errors import InvalidArgumentError
from .chunks import ChunkTable
from .members import Members
from .optimizer_slot import ServerOptimizer
from .requests import ok
from .rounds import Chunk, Pending, Reply, Round
from .writein import WriteIn


class Sync:
    """The sync rounds of the chunks in ``table`` for ``num_workers`` worker slots."""

    name = "sync"
    applies_on_arrival = False    # pushes merge into rounds
    takes_rows = True             # row-sparse tables have rounds of their own (kvstore.server.tables)
    bounded = False               # configure carries no staleness bound

    def __init__(self, table: ChunkTable, num_workers: int, members: Members, optimizer: ServerOptimizer,
                 bound: int | None = None):
        self.table = table
        self.num_workers = num_workers
        self.members = members
        self.optimizer = optimizer
        self.bound = bound
        self.xp = table.backend.xp
        self.writes = WriteIn(self)
        self._applied: dict = {}       # chunk id -> rounds applied (to name a round by number)
        # requests answered with values once their other chunks are done: a chunk
        # whose round of theirs was applied keeps that value for them if a later
        # round changes it first (possible when a worker pushes again before its
        # reply, e.g. _pushpull_start then push)
        self._partial: dict = {}       # chunk id -> [Pending] done with it, not yet answered
        self._captured: dict = {}      # id(Pending) -> {chunk id: its value for it}

    # -- the strategy ---------------------------------------------------------------------
    def admit(self, worker: int, ids, want_values: bool) -> None:
        """Refuse a push (or write) into a round that a finished worker will never join."""
        gone = self.table.gone
        if not gone:
            return
        for cid in ids:
            chunk = self.table.chunks[cid]
            pos = self.round_to_join(chunk, worker)
            workers = chunk.rounds[pos].workers if pos < len(chunk.rounds) else set()
            if not gone <= workers:
                raise InvalidArgumentError(self.gone_message(cid, pos, workers))

    def push(self, peer, req_id, worker: int, ids, chunks, arrays, want_values: bool,
             group: frozenset | None) -> list[Reply]:
        """A validated push (for ``group``, a host's sum) joins the rounds, or waits
        behind an earlier write of its worker that is not granted yet."""
        if self.writes.ahead(worker, ids):
            if group is not None:    # a host's leader does not write in (kvstore.hostreduce)
                raise InvalidArgumentError(f"worker {worker} pushed a host's sum while its write was pending")
            # that write takes its round first (kvstore.server.writein), then this push the next one
            return self.writes.hold(peer, req_id, worker, ids, chunks, arrays, want_values)
        return self.join(peer, req_id, worker, ids, chunks, arrays, want_values, group)

    def pull(self, peer, req_id, worker: int, ids, chunks) -> list[Reply]:
        pending = Pending(peer, req_id, worker, ids, True,
                          {cid for cid, c in zip(ids, chunks)
                           if c.pending_from(worker) or self.writes.writing(worker, cid, c)})
        if not pending.blocked:
            return [self.finish(pending)]
        for cid in pending.blocked:
            self.table.chunks[cid].waiting.append(pending)
        return []

    def workers_finished(self) -> list[Reply]:
        """Every round still waiting for a finished worker (``table.gone``) fails now,
        and so do the requests that depend on it. Returns the replies."""
        replies = []
        gone = self.table.gone
        for cid, chunk in self.table.chunks.items():
            # a worker joins rounds in order: those it is missing from are a suffix
            first = next((i for i, rnd in enumerate(chunk.rounds) if not gone <= rnd.workers), None)
            if first is None:
                continue
            for pos in range(first, len(chunk.rounds)):
                rnd = chunk.rounds[pos]
                self.fail_round(cid, chunk, rnd, self.gone_message(cid, pos, rnd.workers))
            del chunk.rounds[first:]
            replies += self.release(cid, chunk)
        return replies + self.writes.fail_queued()

    def left(self, worker: int, message: str) -> list[Reply]:
        """``worker`` left the elastic job: its parked requests get ``message``; it
        counts, with nothing, in every queued round it has not pushed to."""
        parked = {id(p): p for chunk in self.table.chunks.values() for p in chunk.waiting if p.worker == worker}
        for key in parked:
            self._captured.pop(key, None)
        for cid in self._partial:
            self._partial[cid] = [p for p in self._partial[cid] if p.worker != worker]
        queued = self.writes.leave(worker)
        replies = [Reply(r.peer, error_header(r.req_id, "RemoteError", message))
                   for r in [*parked.values(), *queued]]
        for cid, chunk in self.table.chunks.items():
            chunk.waiting = [p for p in chunk.waiting if p.worker != worker]
            # a round it was writing into holds an unknown part of its gradient: dropped
            for pos, rnd in enumerate(chunk.rounds):
                if rnd.writer == worker:
                    number = self._applied.get(cid, 0) + pos + 1
                    self.fail_round(cid, chunk, rnd, (
                        f"{message} while writing into round {number} of {chunk_label(cid)}: that "
                        "round's sum is incomplete, so it was dropped with every push in it"))
            chunk.rounds = [rnd for rnd in chunk.rounds if rnd.writer != worker]
            for rnd in chunk.rounds:
                if worker not in rnd.workers:
                    rnd.workers.add(worker)
                    rnd.filled |= {worker}
            replies += self.apply_complete(cid, chunk) + self.release(cid, chunk)
        return replies + self.writes.grant_ready()

    def queued_rounds(self):
        """(chunk id, round) of every round still waiting (for the stall inspector)."""
        for cid, chunk in self.table.chunks.items():
            for rnd in chunk.rounds:
                yield cid, rnd

    def stalled(self, now: float, after: float) -> list[str]:
        return []                # no reads wait here but on rounds, which queued_rounds lists

    # -- rounds ---------------------------------------------------------------------------
    def join(self, peer, req_id, worker: int, ids, chunks, arrays, want_values: bool,
             group: frozenset | None = None) -> list[Reply]:
        """A validated push (for ``group``, a host's sum) joins the rounds; the replies now ready."""
        # Park the request first: completing (or failing) the rounds below answers
        # it through the same path as everyone else waiting on those chunks.
        pending = Pending(peer, req_id, worker, ids, want_values, set(ids))
        for chunk in chunks:
            chunk.waiting.append(pending)
        ready, ranks = [], group or frozenset((worker,))
        for cid, chunk, grad in zip(ids, chunks, arrays):
            pending.rounds[cid] = self.contribute(cid, chunk, ranks, grad.reshape(-1))
            ready += self.apply_complete(cid, chunk)
        return ready

    def contribute(self, cid, chunk: Chunk, ranks: frozenset, grad: np.ndarray) -> Round:
        """Add one worker's push (``ranks``: it, or the workers a host's sum speaks
        for) to the first round none of them has contributed to.

        A round's first push is kept as it came (a view on the message, or on the
        worker's shared memory, which the worker leaves alone until the round is
        acknowledged); the second is added to it in one pass into the accumulator
        (2 reads + 1 write of the chunk instead of copy + add's 3 + 2)."""
        for rnd in chunk.rounds:
            if rnd.open_to_all(ranks):
                if rnd.writer is not None:     # a worker is writing into acc: add after it
                    rnd.deferred.append(grad)
                elif rnd.acc is None:
                    rnd.acc = self.take_spare(chunk)
                    self.xp.add(rnd.first, grad, out=rnd.acc)
                    rnd.first = None
                else:
                    rnd.acc += grad
                rnd.workers.update(ranks)
                return rnd
        rnd = self.opened(chunk, None, first=grad)
        rnd.workers.update(ranks)
        return rnd

    def opened(self, chunk: Chunk, acc, first=None) -> Round:
        """A new round of ``chunk``, queued, that counts every slot that is not a member
        from the start (none unless the job is elastic)."""
        absent = self.members.absent(self.num_workers)
        rnd = Round(acc, set(absent), first=first, filled=absent)
        chunk.rounds.append(rnd)
        return rnd

    def take_spare(self, chunk: Chunk) -> np.ndarray:
        if chunk.spare is not None:
            acc, chunk.spare = chunk.spare, None
            return acc
        return self.table.alloc(chunk.value.size, chunk.value.dtype)

    def apply_complete(self, cid, chunk: Chunk) -> list[Reply]:
        """Apply every round at the head of ``chunk``'s queue that every slot is in."""
        replies = []
        while chunk.rounds and len(chunk.rounds[0].workers) == self.num_workers:
            rnd = chunk.rounds.pop(0)
            self._applied[cid] = self._applied.get(cid, 0) + 1
            for waiting in self._partial.pop(cid, ()):    # the value is about to change
                if waiting.blocked:                          # (not answered yet)
                    self._captured.setdefault(id(waiting), {}).setdefault(cid, self.xp.copy(chunk.value))
            if rnd.acc is None:   # one worker: its push is the sum
                rnd.acc = self.take_spare(chunk)
                self.xp.copyto(rnd.acc, rnd.first)
                rnd.first = None
            acc = rnd.acc
            updater = self.optimizer.updater
            if updater is None:
                # no optimizer: the merged sum becomes the value; the old value
                # buffer is recycled as the next round's accumulator
                chunk.value, acc = acc, chunk.value
            else:
                try:
                    updater(cid, acc, chunk.value)
                except Exception as e:  # an optimizer failure must not leave workers waiting
                    message = (f"applying the optimizer to {chunk_label(cid)} failed: "
                               f"{type(e).__name__}: {e}")
                    for pending in chunk.waiting:
                        joined = pending.rounds.get(cid)
                        if joined is rnd or (joined is None and pending.worker in rnd.workers):
                            pending.error = message   # answered with it when it completes
            chunk.spare = acc
            replies += self.release(cid, chunk)
        return replies

    def release(self, cid, chunk: Chunk) -> list[Reply]:
        """Answer the requests parked on ``chunk`` that no longer wait for it (and for
        no other chunk)."""
        replies, still = [], []
        for pending in chunk.waiting:
            if self._waits(pending, cid, chunk):
                still.append(pending)
                continue
            pending.blocked.discard(cid)
            if not pending.blocked:
                replies.append(self.finish(pending))
            elif pending.want_values:
                self._partial.setdefault(cid, []).append(pending)
        chunk.waiting = still
        return replies

    def _waits(self, pending: Pending, cid, chunk: Chunk) -> bool:
        """A push waits for its own round; a pull for every round of its worker,
        including the one a write of that worker (granted, or still queued) goes to."""
        if pending.waits_on(cid, chunk):
            return True
        return cid not in pending.rounds and self.writes.writing(pending.worker, cid, chunk)

    def finish(self, pending: Pending) -> Reply:
        captured = self._captured.pop(id(pending), {})
        if pending.error is not None:
            return Reply(pending.peer, error_header(pending.req_id, "RemoteError", pending.error))
        chunks = self.table.chunks
        # Values are sent without a copy: in sync mode a chunk cannot change again
        # before this worker, who is blocked on this reply, pushes to it. Unless it
        # has pushed (or asked to write) again already, which a worker that did not
        # wait for this reply can (_pushpull_start, then a push): then its next round
        # may complete before the reply is read, so it gets a copy.
        values = [captured.get(cid, chunks[cid].value) for cid in pending.chunks] \
            if pending.want_values else []
        ahead = bool(values) and any(
            chunks[cid].pending_from(pending.worker) or self.writes.writing(pending.worker, cid, chunks[cid])
            for cid in pending.chunks)
        return ok(pending.peer, pending.req_id, self.table.backend.download(values, copy=ahead))

    # -- rounds that cannot complete ------------------------------------------------------
    def fail_round(self, cid, chunk: Chunk, rnd: Round, message: str) -> None:
        """``rnd`` will never be applied: the requests that depend on it (pushes that
        joined it, later reads of the workers that pushed to it, its writer's grant)
        are answered with ``message`` once they wait for nothing else."""
        for pending in chunk.waiting:
            joined = pending.rounds.get(cid)
            if joined is rnd or (joined is None and (pending.worker in rnd.workers - rnd.filled
                                                     or rnd.writer == pending.worker)):
                pending.error = pending.error or message
        self.writes.fail_grants_into(rnd, message)

    def gone_message(self, cid, pos: int, workers) -> str:
        """Why round ``pos`` (in the chunk's queue) of ``cid`` cannot complete."""
        missing = sorted(self.table.gone - set(workers))
        who = ", ".join(map(str, missing))
        many = len(missing) > 1
        number = self._applied.get(cid, 0) + pos + 1
        return (f"worker{'s' if many else ''} {who} closed {'their' if many else 'its'} "
                f"store while round {number} of {chunk_label(cid)} waits for "
                f"{'their' if many else 'its'} push: every worker must take the same "
                "number of steps (give each the same number of batches, e.g. with kvstore.torch.shard)")

    def round_to_join(self, chunk: Chunk, worker: int) -> int:
        """The position in ``chunk``'s queue of the round ``worker``'s next push joins."""
        return next((i for i, r in enumerate(chunk.rounds) if r.open_to(worker)), len(chunk.rounds))

