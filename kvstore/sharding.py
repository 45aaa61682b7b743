"""Where each key lives: pure functions from keys and sizes to chunks and servers,
and how a call's chunks for each server are cut into messages (:func:`pieces`).

A key of more than ``chunk_bytes`` bytes is split into equal-sized chunks of at
most that size; each chunk goes to the server that holds the fewest bytes so far
(ties go to the lowest rank). Because the placement depends only on the
sequence of (key, size) it is fed, every worker that initialises the same keys
in the same order computes the same placement without talking to anyone; the
store checks that order collectively at ``init``.

Compared with MXNet (big arrays split over all servers, small keys placed by a
hash) this keeps the bytes per server within one chunk of each other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chunk:
    """A contiguous range ``[start, stop)`` of a key's flattened elements."""
    key: object
    index: int
    start: int
    stop: int
    server: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def wire_id(self) -> list:
        return [self.key, self.index]


def split(size: int, itemsize: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Split ``size`` elements into the fewest near-equal ranges of at most
    ``chunk_bytes`` bytes each (at least one range, even for empty arrays)."""
    if size < 0 or itemsize < 1 or chunk_bytes < 1:
        raise ValueError("size must be >= 0, itemsize and chunk_bytes >= 1")
    per_chunk = max(1, chunk_bytes // itemsize)
    count = max(1, -(-size // per_chunk))
    return [(size * i // count, size * (i + 1) // count) for i in range(count)]


class Placement:
    """Deterministic, size-balanced assignment of chunks to servers.

    Example::

        p = Placement(num_servers=2, chunk_bytes=4 << 20)
        chunks = p.place("fc1.weight", size=1_000_000, itemsize=4)
    """

    def __init__(self, num_servers: int, chunk_bytes: int):
        if num_servers < 1:
            raise ValueError("need at least one server")
        self.num_servers = num_servers
        self.chunk_bytes = chunk_bytes
        self.load = [0] * num_servers  # bytes placed on each server so far

    def place(self, key, size: int, itemsize: int) -> tuple[Chunk, ...]:
        chunks = []
        for index, (start, stop) in enumerate(split(size, itemsize, self.chunk_bytes)):
            server = min(range(self.num_servers), key=lambda s: (self.load[s], s))
            # count empty chunks as one byte so that many empty keys still spread out
            self.load[server] += max(1, (stop - start) * itemsize)
            chunks.append(Chunk(key, index, start, stop, server))
        return tuple(chunks)


def pieces(groups: dict, limits) -> list[tuple[int, int, int]]:
    """(server, start, stop): each server's chunk list cut into runs of about
    ``limits[server]`` bytes (0: no cut), taken round-robin across servers so that
    all of them work at once: a server sums one run while the next arrives, and one
    run's reply travels while the worker still sends."""
    runs = {}
    for server, (_, parts) in groups.items():
        limit = limits[server]
        cuts, size = [0], 0
        for i, part in enumerate(parts):
            if limit and size and size + part.nbytes > limit:
                cuts.append(i)
                size = 0
            size += part.nbytes
        cuts.append(len(parts))
        runs[server] = list(zip(cuts[:-1], cuts[1:]))
    order = []
    for step in range(max((len(r) for r in runs.values()), default=0)):
        order += [(server, *r[step]) for server, r in runs.items() if step < len(r)]
    return order

