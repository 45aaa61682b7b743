"""Delivery order per connection: requests carry a sequence number per
(worker, server) connection; the server handles them in that order exactly once.

A duplicate (a sequence number already handled) is dropped with a log line; a
request that arrives early waits until the ones before it arrived. A request
that never arrives holds back the later ones of that connection, whose worker
then fails with a deadline error naming this server: never a wrong result. A
request rejected before it could be handled (malformed after its header was read)
still uses up its sequence number (:meth:`Sequencer.skip`), so the ones after it go on.
Pure: no sockets, no clocks.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

MAX_HELD = 1024  # early requests kept per connection before it is considered broken


class Sequencer:
    """Example::

        seq = Sequencer("server 0")
        for header, arrays in seq.accept(peer, header, arrays):
            state.handle(peer, header, arrays)
    """

    def __init__(self, name: str):
        self.name = name
        self._next: dict = {}   # peer -> next expected sequence number
        self._held: dict = {}   # peer -> {seq: (header, arrays), or None: rejected, skip it}
        self.duplicates = 0

    def accept(self, peer, header: dict, arrays: list) -> list[tuple[dict, list]]:
        """The requests now deliverable, in order. Raises ValueError when too many
        early requests pile up (the connection lost one)."""
        seq = header.get("seq")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            return [(header, arrays)]            # unsequenced (e.g. a tool): handle as it comes
        expected = self._next.get(peer, 0)
        held = self._held.setdefault(peer, {})
        if seq < expected or seq in held:
            self.duplicates += 1
            log.warning("%s: dropped a duplicate of request %s (sequence %d) from worker %s",
                        self.name, header.get("id"), seq, header.get("src"))
            return []
        if seq > expected:
            if len(held) >= MAX_HELD:
                raise ValueError(f"{len(held)} requests from worker {header.get('src')} wait for "
                                 f"sequence {expected}, which never arrived")
            held[seq] = (header, arrays)
            return []
        return self._advance(peer, expected, [(header, arrays)])

    def skip(self, peer, seq) -> list[tuple[dict, list]]:
        """Request ``seq`` of ``peer`` was rejected (and answered) without being
        handled: count it as done. Returns the held requests now deliverable."""
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            return []
        expected = self._next.get(peer, 0)
        held = self._held.setdefault(peer, {})
        if seq < expected or seq in held:
            return []
        if seq > expected:
            if len(held) < MAX_HELD:
                held[seq] = None
            return []
        return self._advance(peer, expected, [])

    def _advance(self, peer, expected: int, ready: list) -> list[tuple[dict, list]]:
        """``expected`` was just taken care of: release what follows it in order."""
        held = self._held[peer]
        expected += 1
        while expected in held:
            item = held.pop(expected)
            if item is not None:
                ready.append(item)
            expected += 1
        self._next[peer] = expected
        return ready
