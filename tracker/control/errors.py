"""Errors raised by the tracker layer."""


class TrackerError(Exception):
    """Base class of tracker errors."""


class RendezvousError(TrackerError):
    """The scheduler refused a request (bad role or rank, disagreeing barrier tokens...)."""


class Disagreement(RendezvousError):
    """The workers' tokens at a barrier differed (``mismatch``): each made another
    collective call, or the same with other arguments."""


class RendezvousTimeout(TrackerError, TimeoutError):
    """A rendezvous step (registration, barrier) did not complete in time."""


class JobAborted(TrackerError):
    """The job was aborted because a node died or failed; the message names it."""
