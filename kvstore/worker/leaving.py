"""How a worker leaves its job: ``close`` (finish), a failure (``fail``: the
scheduler aborts the job at once), and the exit handlers that pick one of the two
when the script never called ``close``.

:class:`Departure` is the collaborator of :class:`kvstore.worker.dist.DistStore` that
ends its membership. It owns whether the worker has left and the uncaught
exception it saw; the store hands it the job member at once and the client and
host group once registration made them. Leaving by an exception, after a call
gave up on a deadline, or with an uncaught exception reports a failure instead of
a clean finish: the other workers would otherwise wait for this one until their
deadline.

Example::

    departure = Departure(job)               # before registration
    departure.attach(client, host, rank)     # after it
    departure.watch(exit_on_abort=True)      # exit handlers
    departure.close()                        # or departure.fail("why")
"""

from __future__ import annotations

import atexit
import logging
import sys
from typing import Any

log = logging.getLogger("kvstore.worker.dist")


class Departure:
    """Leaving the job of ``job`` (a :class:`kvstore.worker.job.JobMember`)."""

    def __init__(self, job: Any):
        self._job = job
        self._membership = job.membership
        self._client: Any = None
        self._host: Any = None
        self._rank = -1
        self.left = False                 # closed or failed: the store takes no more calls
        self._crash: str | None = None    # an uncaught exception, reported at exit

    def attach(self, client: Any, host: Any, rank: int) -> None:
        """The store's client and host group (None without one), once registered."""
        self._client, self._host, self._rank = client, host, rank

    def watch(self, exit_on_abort: bool) -> None:
        """Leave at interpreter exit if the script did not; with ``exit_on_abort``,
        remember an uncaught exception so that the exit reports a failure (the
        scheduler then aborts the job at once) instead of a clean finish."""
        if exit_on_abort:
            previous = sys.excepthook

            def hook(exc_type, exc, tb):
                self._crash = f"{exc_type.__name__}: {exc}"
                previous(exc_type, exc, tb)
            sys.excepthook = hook
        atexit.register(self._close_at_exit)

    def close(self, at_exit: bool = False) -> None:
        """Wait for pushes in flight, tell the scheduler this worker is done, release
        sockets. ``at_exit``: the exit handler's, not the script's (the status the
        interpreter exits with is not known yet: the launcher judges it)."""
        if self.left:
            return
        if self._client.failure is not None:   # an earlier call gave up: do not wait again
            return self.fail(self._client.failure)
        self.left = True
        atexit.unregister(self._close_at_exit)
        try:
            if not self._membership.aborted.is_set():
                if self._host is not None:
                    self._host.flush("close")   # its calls first: the leader's are the client's
                self._client.flush("close")
                self._client.settle("close")    # (replicas) no push left that only this worker holds
                if self._host is not None:
                    self._host.leave("close")   # the leader waits until its members have all
                self._job.finish(closed=not at_exit)
        except BaseException as e:      # e.g. a push that failed: the job must learn it now
            try:
                self._membership.fail(f"close: {type(e).__name__}: {e}")
            except Exception as report:   # the scheduler is gone too: the error below says enough
                log.warning("[worker:%d] could not report the failure of close(): %s", self._rank, report)
            raise
        finally:
            self.release()

    def exit_block(self, exc_type, exc) -> None:
        """Leaving a ``with`` block: finish, or on an exception report a failure."""
        if exc_type is None:
            self.close()
        elif not self.left:
            self.fail(f"{exc_type.__name__}: {exc}")

    def fail(self, reason: str) -> None:
        """Report this worker's failure (the scheduler aborts the job) and release."""
        self.left = True
        atexit.unregister(self._close_at_exit)
        try:
            self._membership.fail(reason)
        finally:
            self.release()

    def release(self) -> None:
        """Close the host group, the client and the membership (what exists of them)."""
        if self._host is not None:
            self._host.close()
        if self._client is not None:
            self._client.close()
        self._membership.close()

    def _close_at_exit(self) -> None:
        if self._crash is not None and not self.left:
            return self.fail(self._crash)
        try:
            self.close(at_exit=True)
        except Exception as e:  # at interpreter exit there is no caller left to raise to
            log.error("[worker:%d] closing the store at exit failed: %s", self._rank, e)
