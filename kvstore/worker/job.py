"""This worker as a member of the job: its calls to the scheduler, in kvstore's terms.

Registration, collective calls (the scheduler's barrier, with a token describing
what the workers agree on, so that a worker that initialises other keys, shapes
or dtypes gets an error instead of a hang) and finishing go through
:class:`tracker.control.membership.Membership`; its errors come back as kvstore's:
NodeFailedError when the job aborted, DeadlineError, InvalidArgumentError when
the workers disagree. When the job aborts, a worker that has not stopped within
``KVSTORE_ABORT_GRACE`` exits (``Config.exit_on_abort``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from typing import Sequence

from tracker.control import disagreement
from tracker.control.errors import Disagreement, JobAborted, RendezvousError, RendezvousTimeout, TrackerError
from tracker.control.membership import Membership

from ..errors import DeadlineError, InvalidArgumentError, NodeFailedError

log = logging.getLogger(__name__)

NO_DEADLINE = 1e9   # seconds: a barrier timeout the scheduler treats as none (tracker Barrier.arrive)
DISAGREEMENT_TIMEOUT = 10.0   # seconds the workers take to learn where their calls differ


class JobMember:
    """Example (what DistStore does)::

        member = JobMember(config)
        registration = member.register()
        member.collective("init 'w':(3,):float32")    # every worker, same token
        member.finish()
        member.membership.close()
    """

    def __init__(self, config, addr: str = ""):
        self._config = config
        self.membership = Membership(   # ``addr``: this worker's host-group endpoint, if any
            role="worker", rank=config.rank, addr=addr, host=config.node_host,
            scheduler=(config.scheduler_host, config.scheduler_port), timeout=config.timeout,
            heartbeat_interval=config.heartbeat_interval,
            heartbeat_timeout=config.heartbeat_timeout, restart_timeout=config.scheduler_restart_timeout,
            on_abort=self._on_abort,
            security=config.security())

    def register(self):
        """Join the job: the registration (rank, number of workers, server adverts)."""
        return self._translate(self.membership.register)

    def collective(self, token: str, deadline: bool = True, items: Sequence[str] = ()) -> tuple[int, tuple]:
        """Wait until every worker made the call described by ``token`` and ``items``
        (what it agrees on item by item, e.g. each key's shape and dtype); an
        InvalidArgumentError if another worker's differs, naming the worker blamed
        and the first item that differs, both sides
        (:mod:`tracker.control.disagreement`). Returns (membership epoch, member
        ranks); ``membership.progress`` is then the job's progress. Without
        ``deadline`` (a worker joining an elastic job, whose first barrier the others
        reach at their next epoch) it waits as long as the job runs, not KVSTORE_TIMEOUT."""
        whole = f"{token} {', '.join(items)}" if items else token
        if len(whole) > 200:
            whole = f"{whole[:150]}... #{hashlib.sha1(whole.encode()).hexdigest()[:16]}"
        return self._agreed(token, items, self.membership.barrier, whole, None if deadline else NO_DEADLINE)

    def _disagreement(self, token: str, items: Sequence[str]) -> str | None:
        """After a barrier whose tokens differed (every worker got that answer at
        once): every worker's call, item by item, through the scheduler, and where
        they first differ; None if that cannot be learnt within a few seconds."""
        try:
            members, payloads = self.membership.allgather(disagreement.encode(token, items), "disagreement",
                                                          min(self._config.timeout, DISAGREEMENT_TIMEOUT))
            return disagreement.describe({rank: disagreement.decode(p) for rank, p in zip(members, payloads)})
        except (TrackerError, ValueError, TypeError) as e:
            log.debug("could not learn where the workers' calls differ: %s", e)
            # the others may have learnt it and failed first, aborting the job under this one
            if not isinstance(e, JobAborted):
                return None
            return disagreement.quoted(str(e)) or disagreement.quoted(self.membership.abort_reason)

    def allgather(self, data: bytes, token: str, timeout: float | None) -> tuple[tuple, list]:
        """Every member's ``data`` through the scheduler's authenticated barrier
        (:meth:`tracker.control.membership.Membership.allgather`): ``(members, payloads)``,
        sorted ranks and each one's bytes in that order; tracker errors as kvstore's."""
        return self._agreed(f"allgather {token}", (), self.membership.allgather, data, token, timeout)

    def _agreed(self, token: str, items: Sequence[str], fn, *args):
        """``fn(*args)`` (a barrier) through :meth:`_translate`; when the workers'
        calls differed, the error says where (:meth:`_disagreement`)."""
        try:
            return self._translate(fn, *args)
        except InvalidArgumentError as e:
            detail = self._disagreement(token, items) if isinstance(e.__cause__, Disagreement) else None
            if detail is None:
                raise
            raise InvalidArgumentError(detail) from None   # (the scheduler's answer says less)

    def save_progress(self, progress: dict) -> None:
        """Record the job's progress with the scheduler (what joining workers read)."""
        self._translate(self.membership.save_progress, progress)

    def finish(self, closed: bool = True) -> None:
        """Tell the scheduler this worker is done (``closed``: the script said so, not
        the exit handler)."""
        self._translate(self.membership.finish, closed)

    def _translate(self, fn, *args):
        """Call a tracker function, re-raising its errors as kvstore errors."""
        try:
            return fn(*args)
        except JobAborted as e:
            raise NodeFailedError(f"the job was aborted: {e}") from e
        except RendezvousTimeout as e:
            raise DeadlineError(str(e)) from e
        except RendezvousError as e:
            if self.membership.aborted.is_set():
                raise NodeFailedError(f"the job was aborted: {self.membership.abort_reason}") from e
            raise InvalidArgumentError(str(e)) from e

    def _on_abort(self, reason: str) -> None:
        if not self._config.exit_on_abort:
            return
        grace = self._config.abort_grace

        def die():
            log.critical("job aborted (%s) and this worker did not stop within %gs "
                         "(KVSTORE_ABORT_GRACE); exiting", reason, grace)
            os._exit(70)
        timer = threading.Timer(grace, die)
        timer.daemon = True
        timer.start()
