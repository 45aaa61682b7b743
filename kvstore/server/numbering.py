"""Replicated servers in an elastic job: which round a worker's numbered push is.

With replicated servers a worker numbers its pushes of each chunk 1, 2, ... from
its process's start (``rounds``, kvstore.worker.failover), so that the promoted
backup of a dead server applies no push twice and loses none. In ``dist_sync``
every member pushes once to each round of a chunk, so a member since the job
formed pushes round n as its push n. A worker that joins the running job (an
elastic joiner, maybe in the rank of one that left: a new process) numbers from 1
again while the chunk has had rounds applied already: its push n is the chunk's
round ``base + n``, its base being the rounds applied when it became a member.
:class:`JoinBases` keeps, per chunk, the bases of the workers that joined (0 for
the others), for a server's own chunks (kvstore.server.sync, kvstore.server.tables)
and for its replicas (kvstore.server.replication), which hand them over at a
promotion and send them in a rebuild.

Every server computes the same bases: a worker becomes a member at a barrier
(the scheduler makes it one there), when no round is in flight (every member's
``barrier()`` waits for its requests' replies first) and every round applied is on
the backups too (a reply waits for the backup's acknowledgement). Were a round
still open at a join, the joiner's first push would be refused, naming its
number and the one expected, never applied twice or lost.

Example::

    bases = JoinBases()
    bases.joined(1, {("w", 0): 7})      # worker 1 joined after 7 rounds of chunk ("w", 0)
    bases.base(("w", 0), 1)              # 7: its push 1 is round 8
    bases.base(("w", 0), 0)              # 0: a member since the job formed
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def member_again(numbers: dict[int, int], worker: int, applied: int, per_push: bool) -> None:
    """One chunk's per-worker numbers when ``worker`` became a member (a new process,
    numbering its pushes from 1 again): where pushes are applied one by one
    (``per_push``, dist_async: ``numbers`` are the workers' last pushes applied) its
    last is forgotten; where they join rounds (``numbers``: the joiners' bases) its
    base is the chunk's rounds ``applied`` now. For replicas, which keep both kinds
    in one dict per chunk."""
    if per_push:
        numbers.pop(worker, None)
    else:
        numbers[worker] = applied


class JoinBases:
    """Per chunk, the rounds applied when each worker that joined became a member."""

    def __init__(self) -> None:
        self._by_chunk: dict[tuple, dict[int, int]] = {}

    def joined(self, worker: int, applied: Mapping[tuple, int] | Iterable[tuple[tuple, int]]) -> None:
        """``worker`` became a member now; ``applied``: each chunk's rounds applied."""
        items = applied.items() if isinstance(applied, Mapping) else applied
        for cid, rounds in items:
            self._by_chunk.setdefault(cid, {})[worker] = rounds

    def base(self, cid, worker: int) -> int:
        """The rounds of chunk ``cid`` applied before ``worker``'s push 1 (0: a member
        since the job formed)."""
        return self._by_chunk.get(cid, {}).get(worker, 0)

    def of(self, cid) -> dict[int, int]:
        """Chunk ``cid``'s bases (worker -> rounds), for a replica or a rebuild."""
        return dict(self._by_chunk.get(cid, {}))

    def adopt(self, cid, bases: Mapping[int, int] | None) -> None:
        """Chunk ``cid`` (a promoted replica, a rebuilt one) comes with ``bases``."""
        if bases:
            self._by_chunk[cid] = dict(bases)
        else:
            self._by_chunk.pop(cid, None)
