"""Whose memory a request may pass by reference: its sender's own.

A request's buffers may be references into memory both ends reach (``shm``: a
worker's shared-memory segment; ``dev``: its device memory; docs/protocol.md 2.7).
A server resolves one only when it names memory of the connection that sent it,
so that one worker can never make the server read another's buffers as its own.

A connection says whose it is at its handshake (``hello``, ``device_hello``): the
handshake names its worker (``src``) and its probe lies in that worker's memory,
checked as below; the connection is then that worker's, and every reference it
sends later must come from the same ``src`` and:

- name a segment of that worker's process, where the segment names its process
  (host shared memory ``[pid, fd, size]``, and the emulated device memory of the
  host devices CI runs); each worker's process is the scheduler's (its
  registration lists ``"host:pid"`` per rank);
- where it does not (a CUDA IPC handle is opaque), name an allocation that no
  other process referenced first: the first process whose connection references
  an opaque segment holds it, and another's reference to it is refused.

A refusal is a :class:`~kvstore.errors.ProtocolError` naming the sender and the
owner (both workers, both processes); nothing is mapped or opened for it. Workers
of one process (several stores in one test process) share their memory anyway:
they are not told apart. Pure: no sockets, no clocks.

Example::

    owners = MemoryOwners()
    owners.joined(["h:100", "h:200"])                      # workers 0 and 1
    owners.check(b"c1", {"op": "hello", "src": 1}, "shm", [200, 5, 4096], 200)   # binds c1 to worker 1
    owners.check(b"c1", {"op": "push", "src": 1}, "shm", [100, 7, 4096], 100)    # ProtocolError: worker 0's
"""

from __future__ import annotations

from typing import Sequence

from ...errors import ProtocolError
from ...protocol import ops

HANDSHAKES = frozenset({ops.HELLO, ops.DEVICE_HELLO})


class MemoryOwners:
    def __init__(self):
        self._pids: dict[int, int] = {}       # worker rank -> its process (registered with the scheduler)
        self._peers: dict[bytes, tuple[int, int]] = {}   # connection -> (worker rank, process) of its handshake
        self._claims: dict[tuple, int] = {}   # (kind, opaque segment) -> the process that referenced it first

    def joined(self, workers: Sequence[str]) -> None:
        """The job's workers by rank, ``"host:pid"`` each (``""``: a vacant rank); again
        whenever they change. Connections of a worker whose process changed, and
        segments held by processes that left, are forgotten."""
        pids = {}
        for rank, worker in enumerate(workers):
            tail = str(worker).rsplit(":", 1)[-1]
            if tail.isdigit():
                pids[rank] = int(tail)
        self._pids = pids
        self._peers = {peer: (rank, pid) for peer, (rank, pid) in self._peers.items() if pids.get(rank) == pid}
        live = set(pids.values())
        self._claims = {key: pid for key, pid in self._claims.items() if pid in live}

    def _workers_of(self, pid: int) -> str:
        ranks = sorted(rank for rank, p in self._pids.items() if p == pid)
        if not ranks:
            return f"process {pid}, which is no worker of this job"
        return f"worker{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} (process {pid})"

    def check(self, peer: bytes, header: dict, kind: str, segment, owner: int | None) -> None:
        """May the request ``header`` from connection ``peer`` reference ``segment`` (of
        ``kind``)? ``owner``: the process the segment names, None where it names none.
        Raises ProtocolError naming the sender and the owner; a handshake that passes
        makes the connection its worker's."""
        src, op = header.get("src"), header.get("op")
        if type(src) is not int or src not in self._pids:
            raise ProtocolError(f"a {kind!r} memory reference from worker {src!r}, which has no process "
                                "registered in this job: only a worker's own memory may be referenced")
        bound = self._peers.get(peer, (None, None))[0]
        if bound is None and op not in HANDSHAKES:
            raise ProtocolError(f"worker {src} passed a {kind!r} memory reference on a connection that made "
                                "no handshake (hello): a connection's references are accepted after it")
        if bound is not None and bound != src:
            raise ProtocolError(f"a request from worker {src} passed a {kind!r} memory reference on the "
                                f"connection of worker {bound}: a connection references one worker's memory")
        pid = self._pids[src]
        if owner is not None:
            if owner != pid:
                raise ProtocolError(f"the {kind!r} segment {list(segment)} is memory of {self._workers_of(owner)}, "
                                    f"but worker {src} (process {pid}) sent it: a worker may pass by reference "
                                    "only its own memory")
        else:
            key = (kind, tuple(segment))
            holder = self._claims.setdefault(key, pid)
            if holder != pid:
                raise ProtocolError(f"the {kind!r} segment {list(segment)[:2]}... was referenced first by "
                                    f"{self._workers_of(holder)}, but worker {src} (process {pid}) sent it: "
                                    "a worker may pass by reference only its own memory")
        if op in HANDSHAKES:
            self._peers[peer] = (src, pid)
