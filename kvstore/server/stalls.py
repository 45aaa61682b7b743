"""The stall inspector: which rounds have waited long, and for whom.

The server node asks every few seconds (``KVSTORE_STALL_WARNING``); the inspector
names the keys and workers of sync rounds (dense and row-sparse) that wait longer
than the limit, each once. Pure: ``now`` comes from the caller's clock, and a
round's age counts from the first call that saw it.
"""

from __future__ import annotations

from ..protocol import chunk_label


class StallInspector:
    """Remembers, per waiting round, when it was first seen and whether it was reported."""

    def __init__(self) -> None:
        self._round_seen: dict = {}    # (chunk id, id(round)) -> (first seen, reported, round)

    def stalled(self, now: float, after: float, rounds, num_workers: int) -> list[str]:
        """Of ``rounds`` ((chunk id, round) pairs, every round still queued), those
        waiting longer than ``after`` seconds for some of the ``num_workers`` workers
        and not reported before, as readable lines naming the key and the missing
        workers."""
        seen, lines = {}, []
        for cid, rnd in rounds:
            first, reported, known = self._round_seen.get((cid, id(rnd)), (now, False, rnd))
            if known is not rnd:      # an id reused by a newer round
                first, reported = now, False
            if not reported and now - first >= after:
                missing = sorted(set(range(num_workers)) - rnd.workers)
                writing = "" if rnd.writer is None else \
                    f"; worker {rnd.writer} was granted its sum to write into and has not said 'written'"
                if rnd.terms is not None:
                    lines.append(f"{chunk_label(cid)} has waited {now - first:.0f}s for the key's norms: "
                                 "every worker pushed, and worker 0 (the leader) has not sent apply_norms")
                else:
                    lines.append(f"{chunk_label(cid)} has waited {now - first:.0f}s for worker(s) "
                                 f"{', '.join(map(str, missing))} to push (worker(s) "
                                 f"{', '.join(map(str, sorted(rnd.workers - rnd.filled)))} did{writing})")
                reported = True
            seen[(cid, id(rnd))] = (first, reported, rnd)
        self._round_seen = seen
        return lines
