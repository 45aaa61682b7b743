"""tracker: forms a cluster of scheduler, servers and workers.

The lower layer of the project: launching processes, rendezvous (ranks, address
book, barrier), liveness and teardown. It never imports ``kvstore``.
"""

from .control.errors import TrackerError, RendezvousError, RendezvousTimeout, JobAborted

__all__ = ["TrackerError", "RendezvousError", "RendezvousTimeout", "JobAborted"]
