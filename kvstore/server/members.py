"""Which worker ranks of an elastic job are members, and where each is active.

A collaborator of :class:`~kvstore.server.state.ServerState`, pure like it (no
sockets, threads or clocks). The scheduler numbers each change of the job's members
with an epoch and the server node hands the latest over
(:meth:`ServerState.set_members`); this file keeps the bookkeeping, the state acts
on its rounds (kvstore.server.stalls).

A round completes when every *rank* (configure's ``num_workers``) is counted in it.
A rank that is not a *member* is counted from the start, contributing nothing
(:meth:`Members.absent`): a rank nobody holds, a worker that left, and a worker
that joined the running job but has not yet met the others at a barrier (the
scheduler makes it a member there, when no round is in flight, and releases
that barrier only once every server holds the new members: so it takes part in
every round from the next one on). Only members push; anybody may pull.

In ssp mode a worker that became a member is *active* on a chunk from its first
push there (:meth:`Members.start`), when its clock there starts at the slowest
active member's (kvstore.server.ssp): until then it holds nobody back.

Without members (no :meth:`ServerState.set_members`, or a job that is not
elastic) every rank is a member and active on every chunk: nothing changes.
"""

from __future__ import annotations

from ..errors import InvalidArgumentError
from .rounds import is_int

NOTHING: frozenset = frozenset()


class Members:
    """The members of an elastic job as one server knows them.

    Example::

        m = Members()
        m.change(1, {0, 2}, num_workers=3)      # -> [1]: worker 1 left
        m.change(2, {0, 1, 2}, num_workers=3)   # -> []: worker 1 joined again
        m.absent(num_workers=3)                 # -> frozenset(): every rank is a member
    """

    def __init__(self) -> None:
        self.epoch: int | None = None
        self.ranks: frozenset | None = None   # None: every rank (not elastic)
        self.pending: tuple | None = None     # (epoch, ranks) given before configure
        self._joiners: dict[int, set] = {}    # rank -> chunk ids it pushed to since it joined
        self._left: set = set()               # ranks that were members and left

    def newer(self, epoch, ranks: frozenset) -> bool:
        """Whether ``(epoch, ranks)`` is news (epochs only grow; an old one is ignored)."""
        if not is_int(epoch) or not all(is_int(r) for r in ranks):
            raise InvalidArgumentError(f"members must be an integer epoch and worker ranks, got "
                                       f"{epoch!r}, {sorted(ranks, key=repr)!r}")
        latest = self.pending or ((self.epoch, self.ranks) if self.epoch is not None else None)
        if latest is None or epoch > latest[0]:
            return True
        if epoch == latest[0] and ranks != latest[1]:
            raise InvalidArgumentError(f"epoch {epoch} of the elastic job came with two sets of members: "
                                       f"{_names(latest[1])} and {_names(ranks)}")
        return False

    @staticmethod
    def check(ranks, num_workers: int) -> None:
        """Members must be worker ranks of the job (configure's ``num_workers``)."""
        outside = sorted(r for r in ranks if not 0 <= r < num_workers)
        if outside:
            raise InvalidArgumentError(
                f"members {_names(outside)} of the elastic job are not worker ranks 0..{num_workers - 1} "
                f"(configure said num_workers={num_workers}; an elastic job configures its maximum)")

    def change(self, epoch: int, ranks: frozenset, num_workers: int) -> list[int]:
        """Take the members of ``epoch``; returns the ranks that left, sorted. Those
        that came are members now; in ssp mode each is inactive on a chunk until it
        pushes there (:meth:`start`)."""
        self.check(ranks, num_workers)
        first = self.ranks is None
        before = frozenset(range(num_workers)) if self.ranks is None else self.ranks
        self.epoch, self.ranks = epoch, frozenset(ranks)
        for w in ranks - before:
            self._joiners[w] = set()
            self._left.discard(w)
        for w in before - ranks:
            self._joiners.pop(w, None)
            if not first:        # at the first members, the other ranks were never held
                self._left.add(w)
        return sorted(before - ranks)

    def refuse(self, src) -> None:
        """A push (or write) from a rank that is not a member is refused, naming it."""
        if self.ranks is None or not is_int(src) or src in self.ranks:
            return
        was = "is no longer a member of the elastic job: it left" if src in self._left else \
            "is not a member of the elastic job (a worker that joins pushes after its first barrier)"
        raise InvalidArgumentError(f"worker {src} {was} (members {_names(self.ranks)} at epoch {self.epoch})")

    def active(self, worker: int, cid) -> bool:
        if self.ranks is None:
            return True
        started = self._joiners.get(worker)
        return worker in self.ranks and (started is None or cid in started)

    def everyone(self, num_workers: int) -> bool:
        """Whether every rank is a member and active on every chunk (the fast path)."""
        return self.ranks is None or (not self._joiners and len(self.ranks) == num_workers)

    def absent(self, num_workers: int) -> frozenset:
        """The ranks a new round (of any chunk) counts from the start: every one that
        is not a member (members change only between rounds)."""
        if self.ranks is None or len(self.ranks) == num_workers:
            return NOTHING
        return frozenset(w for w in range(num_workers) if w not in self.ranks)

    def start(self, worker: int, cid) -> bool:
        """``worker`` pushes to ``cid``: whether that makes a joiner active there (its first push)."""
        started = self._joiners.get(worker)
        if started is None or cid in started:
            return False
        started.add(cid)
        return True


def _names(ranks) -> str:
    return ", ".join(map(str, sorted(ranks))) or "none"
