"""How a worker leaves its job: ``close`` (finish), a failure (``fail``: the
scheduler aborts the job at once), and the exit handlers that pick one of the two
when the script never called ``close``.

:class:`Leaving` is the part of :class:`kvstore.dist.DistStore` that ends its
membership; it uses the store's client, job member, membership and rank. Leaving
by an exception, after a call gave up on a deadline, or with an uncaught
exception reports a failure instead of a clean finish: the other workers would
otherwise wait for this one until their deadline.
"""

from __future__ import annotations

import atexit
import logging
import sys

log = logging.getLogger("kvstore.dist")


class Leaving:
    """A mixin of DistStore (``_client``, ``_job``, ``_membership``, ``_rank``,
    ``_closed``, ``_crash``)."""

    def close(self) -> None:
        """Wait for pushes in flight, tell the scheduler this worker is done, release sockets."""
        if self._closed:
            return
        if self._client.failure is not None:   # an earlier call gave up: do not wait again
            return self._fail(self._client.failure)
        self._closed = True
        atexit.unregister(self._close_at_exit)
        try:
            if not self._membership.aborted.is_set():
                self._client.flush("close")
                if getattr(self, "_host", None) is not None:
                    self._host.leave("close")   # the leader waits until its members have all
                self._job.finish()
        except BaseException as e:      # e.g. a push that failed: the job must learn it now
            try:
                self._membership.fail(f"close: {type(e).__name__}: {e}")
            except Exception as report:   # the scheduler is gone too: the error below says enough
                log.warning("[worker:%d] could not report the failure of close(): %s", self._rank, report)
            raise
        finally:
            self._release()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        elif not self._closed:   # leaving on an error: tell the job instead of finishing
            self._fail(f"{exc_type.__name__}: {exc}")

    def _fail(self, reason: str) -> None:
        """Report this worker's failure (the scheduler aborts the job) and release."""
        self._closed = True
        atexit.unregister(self._close_at_exit)
        try:
            self._membership.fail(reason)
        finally:
            self._release()

    def _release(self) -> None:
        if getattr(self, "_host", None) is not None:
            self._host.close()
        if self._client is not None:
            self._client.close()
        self._membership.close()

    def _watch_for_crash(self) -> None:
        """Remember an uncaught exception so that the exit handler reports a failure
        (the scheduler then aborts the job at once) instead of a clean finish."""
        previous = sys.excepthook

        def hook(exc_type, exc, tb):
            self._crash = f"{exc_type.__name__}: {exc}"
            previous(exc_type, exc, tb)
        sys.excepthook = hook

    def _close_at_exit(self) -> None:
        if self._crash is not None and not self._closed:
            return self._fail(self._crash)
        try:
            self.close()
        except Exception as e:  # at interpreter exit there is no caller left to raise to
            log.error("[worker:%d] closing the store at exit failed: %s", self._rank, e)

