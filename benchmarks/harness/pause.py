"""The pause a fault causes in a job, from the times its steps ended (shared by
benchmarks.failover and benchmarks.chaos --replicated)."""

from __future__ import annotations

__all__ = ["pause"]


def pause(ends: list[float], kill: float, rounds: int = 3) -> float:
    """The longest wait for a round after the signal at ``kill``: over the first
    ``rounds`` steps that end after it, each one's time from the later of its start
    (the previous step's end) and the signal to its end. (The step the signal fell
    in may have been answered already by the dying server; the failover then
    stalls the next one.) Raises ValueError when no step ended after ``kill``."""
    after = [i for i, end in enumerate(ends) if end > kill][:rounds]
    return max(ends[i] - max(ends[i - 1] if i else kill, kill) for i in after)
