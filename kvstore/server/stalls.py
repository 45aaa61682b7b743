"""Rounds that wait: for a worker that finished, one that left, or just for a long time.

:class:`Stalls` is the part of :class:`kvstore.server.state.ServerState` that
deals with sync rounds that cannot complete or have not yet: when the scheduler
reports finished workers (:meth:`Stalls.workers_finished`), every round still
waiting for one of them fails at once naming it, and so does every later push
(in ssp mode: every read that waits for one of them). In an elastic job workers
leave and join instead (:meth:`Stalls.set_members`, kvstore.server.members): a
worker that left is counted in the rounds it will never push to, so they complete
without it. The stall inspector (:meth:`Stalls.stalled`) names the keys and
workers of rounds (and ssp reads) that wait long (``now`` comes from the caller:
no clocks in here).
"""

from __future__ import annotations

from ..errors import InvalidArgumentError
from ..protocol import chunk_label, error_header
from .rounds import Chunk, Reply, Round


class Stalls:
    """A mixin of ServerState, whose chunks, rounds, grants and helpers
    (``_release``, ``_fail_queued``) it uses."""

    def workers_finished(self, ranks) -> list[Reply]:
        """The scheduler says these workers finished (closed their stores). In sync
        mode every round still waiting for one of them can never complete: the
        requests that depend on such a round fail now, naming that worker, and so
        does every later push (:meth:`_refuse_if_gone`). Returns the replies."""
        new = set(ranks) - self._gone
        if not new:
            return []
        self._gone |= new
        if self.mode == "ssp":          # reads that wait for them (kvstore.server.staleness)
            return self.ssp.workers_finished()
        if self.mode != "sync":
            return []
        replies = []
        with self.backend.scope():
            for cid, chunk in self.chunks.items():
                # a worker joins rounds in order: those it is missing from are a suffix
                first = next((i for i, rnd in enumerate(chunk.rounds)
                              if not self._gone <= rnd.workers), None)
                if first is None:
                    continue
                for pos in range(first, len(chunk.rounds)):
                    rnd = chunk.rounds[pos]
                    self._fail_round(cid, chunk, rnd, self._gone_message(cid, pos, rnd.workers))
                del chunk.rounds[first:]
                replies += self._release(cid, chunk)
            replies += self._fail_queued()
            replies += self.rows.workers_finished(self._gone)
        return replies

    def _fail_round(self, cid, chunk: Chunk, rnd: Round, message: str) -> None:
        """``rnd`` will never be applied: the requests that depend on it (pushes that
        joined it, later reads of the workers that pushed to it, its writer's grant)
        are answered with ``message`` once they wait for nothing else."""
        for pending in chunk.waiting:
            joined = pending.rounds.get(cid)
            if joined is rnd or (joined is None and (pending.worker in rnd.workers - rnd.filled
                                                     or rnd.writer == pending.worker)):
                pending.error = pending.error or message
        for grant in self._grants.values():
            if any(r is rnd for r in grant.rounds):
                grant.error = grant.error or message

    def _gone_message(self, cid, pos: int, workers) -> str:
        """Why round ``pos`` (in the chunk's queue) of ``cid`` cannot complete."""
        missing = sorted(self._gone - set(workers))
        who = ", ".join(map(str, missing))
        number = self._applied.get(cid, 0) + pos + 1
        return (f"worker{'s' if len(missing) > 1 else ''} {who} closed {'their' if len(missing) > 1 else 'its'} "
                f"store while round {number} of {chunk_label(cid)} waits for "
                f"{'their' if len(missing) > 1 else 'its'} push: every worker must take the same "
                "number of steps (give each the same number of batches, e.g. with kvstore.torch.shard)")

    def _refuse_if_gone(self, worker: int, ids) -> None:
        """A sync push (or write) into a round that a finished worker will never join."""
        if not self._gone or self.mode != "sync":
            return
        for cid in ids:
            chunk = self.chunks.get(cid)
            if chunk is None:
                continue                 # the unknown chunk is reported by _existing
            pos = next((i for i, r in enumerate(chunk.rounds) if r.open_to(worker)), len(chunk.rounds))
            workers = chunk.rounds[pos].workers if pos < len(chunk.rounds) else set()
            if not self._gone <= workers:
                raise InvalidArgumentError(self._gone_message(cid, pos, workers))

    # -- elastic members (kvstore.server.members) -------------------------------------------
    def set_members(self, epoch: int, ranks) -> list[Reply]:
        """The elastic job's members as of ``epoch`` (the scheduler's count of changes;
        an epoch not newer than the last is ignored). Returns the replies now ready.

        A worker that left is counted, contributing nothing, in every queued round it
        has not pushed to, of every chunk and table; the rounds that complete so are
        applied and answered. Its pushes already in rounds count; its requests still
        parked are answered with an error naming it. A worker that became a member
        (the scheduler does it at a barrier, when no round is in flight) is waited for
        by every round opened from now on. Before configure (which says how many
        slots there are) the members are kept and applied by it.

        Raises InvalidArgumentError for members that are not worker slots or two sets
        of members for one epoch."""
        ranks = frozenset(ranks)
        if not self.members.newer(epoch, ranks):
            return []
        if self.num_workers is None:
            self.members.pending = (epoch, ranks)
            return []
        replies = []
        with self.backend.scope():
            for worker in self.members.change(epoch, ranks, self.num_workers):
                replies += self._leave(worker)
        return replies

    def _leave(self, worker: int) -> list[Reply]:
        message = f"worker {worker} left the job"
        parked = {id(p): p for chunk in self.chunks.values() for p in chunk.waiting if p.worker == worker}
        queued = [entry for entry in self._queue if entry.worker == worker]   # writes, held pushes
        self._queue = [entry for entry in self._queue if entry.worker != worker]
        for key in parked:
            self._captured.pop(key, None)
        for cid in self._partial:
            self._partial[cid] = [p for p in self._partial[cid] if p.worker != worker]
        replies = [Reply(r.peer, error_header(r.req_id, "RemoteError", message))
                   for r in [*parked.values(), *queued]]
        for key in [key for key in self._grants if key[0] == worker]:
            del self._grants[key]
        for cid, chunk in self.chunks.items():
            chunk.waiting = [p for p in chunk.waiting if p.worker != worker]
            # a round it was writing into holds an unknown part of its gradient: dropped
            for pos, rnd in enumerate(chunk.rounds):
                if rnd.writer == worker:
                    number = self._applied.get(cid, 0) + pos + 1
                    self._fail_round(cid, chunk, rnd, (
                        f"{message} while writing into round {number} of {chunk_label(cid)}: that "
                        "round's sum is incomplete, so it was dropped with every push in it"))
            chunk.rounds = [rnd for rnd in chunk.rounds if rnd.writer != worker]
            for rnd in chunk.rounds:
                if worker not in rnd.workers:
                    rnd.workers.add(worker)
                    rnd.filled |= {worker}
            replies += self._apply_complete_rounds(cid, chunk) + self._release(cid, chunk)
        replies += self._grant_ready() + self.rows.leave(worker, message)
        return replies + (self.ssp.left(worker, message) if self.ssp is not None else [])

    def _started(self, ids, worker: int) -> None:
        """An ssp push of ``worker`` to ``ids`` (validated): a new member's first push
        to a chunk starts its clock there at the slowest active member's."""
        for cid in ids:
            if self.members.start(worker, cid):
                self.ssp.joined(worker, cid)

    def _opened(self, cid, chunk: Chunk, acc, first=None) -> Round:
        """A new round of ``cid``, queued, that counts every slot that is not a member
        from the start (none unless the job is elastic)."""
        absent = self.members.absent(self.num_workers)
        rnd = Round(acc, set(absent), first=first, filled=absent)
        chunk.rounds.append(rnd)
        return rnd

    # -- stall inspector ------------------------------------------------------------------
    def stalled(self, now: float, after: float) -> list[str]:
        """Rounds waiting longer than ``after`` seconds for some workers (each
        reported once), as readable lines naming the key and the missing workers.
        ``now`` comes from the caller's clock; a round's age counts from the first
        call that saw it."""
        seen, lines = {}, []
        rounds = [(cid, rnd) for cid, chunk in self.chunks.items() for rnd in chunk.rounds]
        for cid, rnd in rounds + list(self.rows.queued_rounds()):
            first, reported, known = self._round_seen.get((cid, id(rnd)), (now, False, rnd))
            if known is not rnd:      # an id reused by a newer round
                first, reported = now, False
            if not reported and now - first >= after:
                missing = sorted(set(range(self.num_workers)) - rnd.workers)
                writing = "" if rnd.writer is None else \
                    f"; worker {rnd.writer} was granted its sum to write into and has not said 'written'"
                lines.append(f"{chunk_label(cid)} has waited {now - first:.0f}s for worker(s) "
                             f"{', '.join(map(str, missing))} to push (worker(s) "
                             f"{', '.join(map(str, sorted(rnd.workers - rnd.filled)))} did{writing})")
                reported = True
            seen[(cid, id(rnd))] = (first, reported, rnd)
        self._round_seen = seen
        return lines + (self.ssp.stalled(now, after) if self.ssp is not None else [])
