"""Bytes a worker moved, by the way they went: ``tcp``, ``ipc``, ``shm`` (shared
memory with a co-located server), ``channel`` (a data channel's replies) and
``host`` (a host group's link between workers).

What is counted is the same whatever the transport: each message's header plus
the bytes of the arrays it carries (a gradient staged in, or written into, shared
memory counts as much as one sent over tcp), so one model reports the same bytes
on one host as across hosts. ``kv.comm_stats()`` returns it.

Example::

    traffic = Traffic()
    traffic.sent("shm", 4096)
    traffic.totals()          # (4096, 0)
    traffic.by_transport()    # {"shm": {"sent": 4096, "received": 0}}
"""

from __future__ import annotations

from collections import defaultdict


class Traffic:
    def __init__(self) -> None:
        self._sent: dict[str, int] = defaultdict(int)
        self._received: dict[str, int] = defaultdict(int)

    def sent(self, transport: str, nbytes: int) -> None:
        self._sent[transport] += int(nbytes)

    def received(self, transport: str, nbytes: int) -> None:
        self._received[transport] += int(nbytes)

    def totals(self) -> tuple[int, int]:
        """(bytes sent, bytes received), every transport together."""
        return sum(self._sent.values()), sum(self._received.values())

    def by_transport(self) -> dict[str, dict[str, int]]:
        return {t: {"sent": self._sent.get(t, 0), "received": self._received.get(t, 0)}
                for t in sorted(set(self._sent) | set(self._received))}
