"""The records of a server's sync rounds (kvstore.server.state): a chunk, its
queued rounds, the requests parked on them, and the replies that come out. A
round's fields are changed by its one owner, the sync strategy (kvstore.server.sync)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import InvalidArgumentError, ProtocolError
from ..modes import ConsistencyMode


@dataclass
class Reply:
    """One message to send: ``peer`` is the opaque address the request came from."""
    peer: object
    header: dict
    arrays: list = field(default_factory=list)


@dataclass
class Round:
    acc: np.ndarray | None            # the sum so far; None while only `first` arrived
    workers: set
    first: np.ndarray | None = None   # the round's first push, kept as it came (not copied)
    # write-in (kvstore.server.write_in), changed by the round's owner (kvstore.server.sync) only
    writer: int | None = None         # the worker granted `acc` to write into, until `written`
    deferred: list = field(default_factory=list)   # pushes to add once the writer is done
    filled: frozenset = frozenset()   # of `workers`: ranks counted without a push (kvstore.server.members)
    # a layer-wise round (kvstore.server.sync, norms across servers): phase 1's sums of
    # squares of this chunk, once it ran, and what phase 2 needs; the round then
    # waits at the head of the queue for the key's sums (apply_norms)
    layerwise: bool = False           # its pushes asked for two phases (a key cut over servers, LARS/LAMB)
    terms: list | None = None
    carry: object = None
    number: int = 0                   # the chunk's round number, from phase 1 on
    # deterministic sums (kvstore.server.sync, ``ordered``): pushes that came before a
    # lower rank's, held until they are next in rank order (key: the lowest rank a
    # push speaks for -> (its ranks, its gradient)), and the ranks added so far
    held: dict = field(default_factory=dict)
    folded: set = field(default_factory=set)
    # the values its pushes named, when each was a row-sparse push on a dense key (a bool
    # mask: their union, updated lazily); None: some push (or write) named every value
    rows: np.ndarray | None = None

    def open_to(self, worker: int) -> bool:
        return worker not in self.workers and self.writer != worker

    def open_to_all(self, ranks: frozenset) -> bool:
        """For a host's sum that speaks for ``ranks`` (kvstore.hostgroup.group)."""
        return self.workers.isdisjoint(ranks) and self.writer not in ranks


@dataclass
class StoredChunk:
    value: np.ndarray                 # 1-D; the stored parameter chunk
    spare: np.ndarray | None = None   # reused as the accumulator of the next round
    rounds: list = field(default_factory=list)   # queued Round, oldest first
    waiting: list = field(default_factory=list)  # ParkedRequest records parked here

    def pending_from(self, worker: int) -> bool:
        return any(worker in r.workers for r in self.rounds)


@dataclass
class ParkedRequest:
    peer: object
    req_id: int
    worker: int
    chunks: list          # chunk ids (tuples) of the request, in order
    want_values: bool
    blocked: set          # chunk ids still waiting for the sender's rounds
    error: str | None = None  # a round it depended on failed: answer with this
    rounds: dict = field(default_factory=dict)  # chunk id -> the Round a push joined
    norms: bool = False       # a layer-wise push: answered with its rounds' terms (phase 1)

    def waits_on(self, cid, chunk: "StoredChunk") -> bool:
        """A push waits for its own round (a layer-wise push only for its phase 1); a
        pull for every round of its worker."""
        joined = self.rounds.get(cid)
        if joined is not None:
            if self.norms and joined.terms is not None:
                return False
            return any(r is joined for r in chunk.rounds)
        return chunk.pending_from(self.worker)


def is_int(value) -> bool:
    """An int that is not a bool (msgpack decodes both)."""
    return isinstance(value, int) and not isinstance(value, bool)


def speaks_for(header: dict, worker: int, num_workers: int, mode: ConsistencyMode) -> frozenset | None:
    """The workers a host's summed push speaks for (header ``group``: sorted,
    distinct ranks including the sender; a ``mode`` with host sums only), or None
    (kvstore.hostgroup.group)."""
    group = header.get("group")
    if group is None:
        return None
    if not (isinstance(group, list) and all(is_int(r) and 0 <= r < num_workers for r in group)
            and group == sorted(set(group)) and worker in group):
        raise ProtocolError(f"'group' must be the sorted, distinct worker ranks (0..{num_workers - 1}) "
                            f"a host's sum speaks for, including its sender {worker}; got {group!r}")
    if not mode.host_sums:
        raise InvalidArgumentError(f"a host's summed push (from worker {worker} for workers {group}) "
                                   f"is for dist_sync only; this server runs dist_{mode.name}")
    return frozenset(group)
