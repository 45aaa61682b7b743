"""Delivery order per connection: requests carry a sequence number per
(worker, server) connection; the server handles them in that order exactly once.

A duplicate (a sequence number already handled) is dropped with a log line; a
request that arrives early waits until the ones before it arrived. A request
that never arrives holds back the later ones of that connection, whose worker
then fails with a deadline error naming this server: never a wrong result. A
request rejected before it could be handled (malformed after its header was read)
still uses up its sequence number (:meth:`Sequencer.skip`), so the ones after it go on.

What early requests hold is bounded: per connection at most :data:`MAX_HELD`
requests and :data:`MAX_HELD_BYTES` bytes of buffers received in the message, and
those bytes count against the server's memory budget (kvstore.server.budget) while
they wait; an early request past either bound is refused (not held). Held requests
are let go when their connection goes: ZeroMQ tells a ROUTER nothing when a peer
disconnects, but a request can only wait on one that was lost (one connection
delivers in order), and the worker that sent it gives up after ``KVSTORE_TIMEOUT``;
so a connection that holds requests and makes no progress for that long (its
worker gone, or its call failed) has them dropped (:meth:`Sequencer.expire`).
Pure: no sockets, no clocks (the caller passes the time).
"""

from __future__ import annotations

import logging

from ..protocol.codec import REF_KINDS
from .budget import MemoryBudget

log = logging.getLogger(__name__)

MAX_HELD = 1024             # early requests kept per connection
MAX_HELD_BYTES = 256 << 20  # bytes of their buffers kept per connection


def received_bytes(header: dict, arrays: list) -> int:
    """Bytes of a request's buffers that came in its message (not those passed by
    reference into a worker's memory, which the server does not hold)."""
    referenced: set = set()
    for kind in REF_KINDS:
        field = header.get(kind)
        refs = field.get("refs") if isinstance(field, dict) else None
        if isinstance(refs, list):
            referenced |= {i for i, r in enumerate(refs) if r is not None}
    return sum(int(getattr(a, "nbytes", 0)) for i, a in enumerate(arrays) if i not in referenced)


class Sequencer:
    """Example::

        seq = Sequencer("server 0", budget)
        for header, arrays in seq.accept(peer, header, arrays):
            state.handle(peer, header, arrays)
        seq.expire(time.monotonic(), config.timeout)     # now and then
    """

    def __init__(self, name: str, budget: MemoryBudget | None = None, max_held: int = MAX_HELD,
                 max_bytes: int = MAX_HELD_BYTES):
        self.name = name
        self.budget = budget or MemoryBudget(None)
        self.max_held, self.max_bytes = max_held, max_bytes
        self._next: dict = {}   # peer -> next expected sequence number
        self._held: dict = {}   # peer -> {seq: (header, arrays, bytes), or None: rejected, skip it}
        self._bytes: dict = {}  # peer -> bytes its held requests hold (counted in the budget)
        self._since: dict = {}  # peer -> when expire() first saw it hold requests without progress
        self.duplicates = 0
        self.expired = 0        # requests dropped by expire()

    def held_bytes(self, peer=None) -> int:
        """Bytes held for ``peer`` (all connections: None)."""
        return sum(self._bytes.values()) if peer is None else self._bytes.get(peer, 0)

    def accept(self, peer, header: dict, arrays: list) -> list[tuple[dict, list]]:
        """The requests now deliverable, in order. Raises ValueError when an early
        request cannot be held (past :attr:`max_held` requests or :attr:`max_bytes`
        bytes on its connection, or past the server's memory budget): it is refused,
        and the connection still waits for the missing one."""
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
            self._hold(peer, seq, header, arrays, expected)
            return []
        return self._advance(peer, expected, [(header, arrays)])

    def _hold(self, peer, seq: int, header: dict, arrays: list, expected: int) -> None:
        held, nbytes = self._held[peer], received_bytes(header, arrays)
        already = self._bytes.get(peer, 0)
        waiting = (f"{len(held)} requests ({already:,} bytes) from worker {header.get('src')} wait for "
                   f"sequence {expected}, which never arrived")
        if len(held) >= self.max_held:
            raise ValueError(f"{waiting}: at most {self.max_held} are held per connection")
        if already + nbytes > self.max_bytes:
            raise ValueError(f"{waiting}: request {header.get('id')} (sequence {seq}, {nbytes:,} bytes) "
                             f"would pass the {self.max_bytes:,} bytes held per connection")
        try:
            self.budget.take(nbytes, f"holding request {header.get('id')} (sequence {seq}) of worker "
                                     f"{header.get('src')} until sequence {expected} arrives")
        except ValueError as e:      # InvalidArgumentError: the server's budget
            raise ValueError(f"{waiting}: {e}") from None
        held[seq] = (header, arrays, nbytes)
        self._bytes[peer] = already + nbytes

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
            if len(held) < self.max_held:
                held[seq] = None
            return []
        return self._advance(peer, expected, [])

    def _advance(self, peer, expected: int, ready: list) -> list[tuple[dict, list]]:
        """``expected`` was just taken care of: release what follows it in order."""
        held = self._held[peer]
        expected += 1
        freed = 0
        while expected in held:
            item = held.pop(expected)
            if item is not None:
                header, arrays, nbytes = item
                ready.append((header, arrays))
                freed += nbytes
            expected += 1
        self._next[peer] = expected
        self._release(peer, freed)
        self._since.pop(peer, None)             # progress: its age counts again from the next look
        if not held:
            del self._held[peer]
        return ready

    def _release(self, peer, nbytes: int) -> None:
        if nbytes:
            self.budget.give(nbytes)
            self._bytes[peer] -= nbytes
        if not self._bytes.get(peer):
            self._bytes.pop(peer, None)

    def expire(self, now: float, after: float) -> int:
        """Drop the held requests of every connection that has held some, without
        progress, for ``after`` seconds (``KVSTORE_TIMEOUT``: their worker has given
        up on them) since the first call that saw it so; ``now`` comes from the
        caller's clock. Their bytes are free again; the connection still waits for
        its missing request. Returns how many requests were dropped."""
        dropped = 0
        for peer in [p for p, held in self._held.items() if held]:
            since = self._since.setdefault(peer, now)
            if now - since < after:
                continue
            held = self._held.pop(peer)
            self._since.pop(peer, None)
            self._release(peer, sum(item[2] for item in held.values() if item is not None))
            dropped += len(held)
            log.warning("%s: dropped %d requests held for %gs waiting for sequence %d of their connection, "
                        "which never arrived (their worker has given up: KVSTORE_TIMEOUT)", self.name,
                        len(held), after, self._next.get(peer, 0))
        self.expired += dropped
        return dropped
