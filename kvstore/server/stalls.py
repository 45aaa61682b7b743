"""Rounds that wait: for a worker that finished, or just for a long time.

:class:`Stalls` is the part of :class:`kvstore.server.state.ServerState` that
deals with sync rounds that cannot complete or have not yet: when the scheduler
reports finished workers (:meth:`Stalls.workers_finished`), every round still
waiting for one of them fails at once naming it, and so does every later push
(in ssp mode: every read that waits for one of them); the stall inspector
(:meth:`Stalls.stalled`) names the keys and workers of rounds (and ssp reads) that
wait long (``now`` comes from the caller: no clocks in here).
"""

from __future__ import annotations

from ..errors import InvalidArgumentError
from ..protocol import chunk_label
from .rounds import Reply


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
                    message = self._gone_message(cid, pos, rnd.workers)
                    for pending in chunk.waiting:
                        joined = pending.rounds.get(cid)
                        if joined is rnd or (joined is None and (pending.worker in rnd.workers
                                                                 or rnd.writer == pending.worker)):
                            pending.error = pending.error or message
                    for grant in self._grants.values():
                        if any(r is rnd for r in grant.rounds):
                            grant.error = grant.error or message
                del chunk.rounds[first:]
                replies += self._release(cid, chunk)
            replies += self._fail_queued()
            replies += self.rows.workers_finished(self._gone)
        return replies

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
                             f"{', '.join(map(str, sorted(rnd.workers)))} did{writing})")
                reported = True
            seen[(cid, id(rnd))] = (first, reported, rnd)
        self._round_seen = seen
        return lines + (self.ssp.stalled(now, after) if self.ssp is not None else [])
