"""Servers started again in place before a replicated job forms.

With replicated servers (``KVSTORE_REPLICAS=1``) a server's death is survived by
its backups, but only once the job formed: before that nothing is replicated, and
nothing is lost either (no server has served a request). So a server of a job
that a launcher runs (``tracker.local``, ``tracker.ssh``: the scheduler is
``restartable``) that dies or hangs before the job formed is started again by
that launcher, with the same rank and command, at most :data:`LIMIT` times per
rank; the next loss of that rank before the job forms ends the job as without
replicas. The scheduler decides (:class:`StartsAgain`, owned by
:class:`tracker.control.scheduler_state.SchedulerState`) and says so to its
launcher (``{"start_again": [[RANK, COUNT], ...]}``, tracker.scheduler); the
launcher kills the old process if it still runs (a stopped one) and starts the
new one (tracker.launcher). Found by the chaos runner's ``spawned`` moment
(docs/reliability.md).

What counts as "before the job formed": the scheduler has not answered every
registration yet. A server killed before it registered is seen by its launcher;
one that registered and then went silent, by its heartbeats; one stopped (or hung)
before it registered, when every worker registered and only servers are missing,
``KVSTORE_HEARTBEAT_TIMEOUT`` after the last registration (as late as a silent node
is dead), else at the registration deadline (``KVSTORE_TIMEOUT``). A server started
again gets a whole ``KVSTORE_TIMEOUT`` to register.

Example::

    again = StartsAgain(num_servers=2)
    again.take(1)     # True: ask the launcher; again.counts == {1: 1}
    again.take(1)     # False: its second loss ends the job
"""

from __future__ import annotations

# times one server rank is started again in place before the job forms: a server
# that dies twice at start-up has a cause that a third start would meet again
LIMIT = 1


class StartsAgain:
    """How many times each server rank was asked to start again (``counts``)."""

    def __init__(self, num_servers: int, limit: int = LIMIT):
        self.num_servers = num_servers
        self.limit = limit
        self.counts: dict[int, int] = {}

    def can(self, rank: object) -> bool:
        """Whether server ``rank`` (a job's server rank) may be started again."""
        return type(rank) is int and 0 <= rank < self.num_servers and self.counts.get(rank, 0) < self.limit

    def take(self, rank: object) -> bool:
        """Count a start again of server ``rank`` if it may have one; whether it may."""
        if not self.can(rank):
            return False
        assert isinstance(rank, int)
        self.counts[rank] = self.counts.get(rank, 0) + 1
        return True

    def describe(self, rank: int) -> str:
        """'1 of 1' for the log lines: the how-many-th start again of ``rank``."""
        return f"{self.counts.get(rank, 0)} of {self.limit}"
