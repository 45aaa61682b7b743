"""kvstore.server.write_in on its own: :class:`WriteQueue`, the queue of writes (and of
pushes held behind them) of a sync server, and the grants it keeps until
``written``; :func:`write_request`, its reading of a ``write`` request.

The queue decides only the order in which it offers its entries to the round
owner (``advance``): oldest first, each worker's requests on a chunk in the order
they came; the owner (``kvstore.server.sync.Sync``) decides whether a write can be
granted. To pin that order on its own, the tests stand in for the owner with
:class:`Owner`, which records what the queue asked it and answers as told (the
real owner is driven in tests/server/test_sync.py). Rounds handed to the queue are
bare ``object()``: it never looks into one, only gives them back.
"""

from __future__ import annotations

import pytest

from kvstore.errors import ProtocolError
from kvstore.protocol import ops
from kvstore.server.write_in import Grant, HeldPush, WriteQueue, write_request

pytestmark = pytest.mark.timeout(30)

A, B = ("w", 0), ("w", 1)


def grant(worker: int, req_id: int, ids) -> Grant:
    return Grant(b"w%d" % worker, req_id, worker, list(ids), [None] * len(ids), True)


def held(worker: int, req_id: int, ids) -> HeldPush:
    return HeldPush(b"w%d" % worker, req_id, worker, list(ids), [None] * len(ids), [], False)


class Owner:
    """Records what the queue asks (a test double of the round owner: it has no
    rounds; ``refuse`` names the write ids it cannot grant yet)."""

    def __init__(self, refuse=()):
        self.refuse = set(refuse)
        self.asked: list = []          # ("grant" | "join", request id), in the order asked

    def grant(self, request: Grant) -> bool:
        self.asked.append(("grant", request.req_id))
        return request.req_id not in self.refuse

    def join(self, push: HeldPush) -> None:
        self.asked.append(("join", push.req_id))

    def advance(self, queue: WriteQueue) -> list:
        self.asked = []
        queue.advance(self.grant, self.join)
        return self.asked


def test_writes_are_offered_oldest_first_and_those_not_granted_stay_queued():
    q = WriteQueue()
    for g in (grant(0, 1, [A]), grant(1, 2, [A]), grant(2, 3, [B])):
        q.queue(g)
    assert Owner(refuse={1}).advance(q) == [("grant", 1), ("grant", 2), ("grant", 3)]
    assert q.queued(0, A) and not q.queued(1, A) and not q.queued(2, B)
    assert Owner().advance(q) == [("grant", 1)]               # offered again next time
    assert not q.queued(0, A)


def test_a_workers_request_is_offered_only_once_its_earlier_ones_on_its_chunks_left():
    q = WriteQueue()
    for g in (grant(0, 1, [A]), grant(0, 2, [B]), grant(0, 3, [A, B]), grant(1, 4, [A])):
        q.queue(g)
    # write 1 waits: worker 0's write 3 shares A with it and is not offered; its write 2
    # (B only) and worker 1's (another worker) are
    assert Owner(refuse={1}).advance(q) == [("grant", 1), ("grant", 2), ("grant", 4)]
    assert Owner().advance(q) == [("grant", 1), ("grant", 3)]
    assert Owner().advance(q) == []


def test_a_push_held_behind_its_workers_write_joins_only_after_that_write_left_the_queue():
    q = WriteQueue()
    q.queue(grant(0, 1, [A]))
    assert q.ahead(0, [A, B]) and not q.ahead(0, [B]) and not q.ahead(1, [A])
    q.hold(held(0, 2, [A]))
    assert q.queued(0, A)
    assert Owner(refuse={1}).advance(q) == [("grant", 1)]     # the push stays behind it
    assert Owner().advance(q) == [("grant", 1), ("join", 2)]
    assert not q.ahead(0, [A])


def test_a_write_id_is_open_once_per_worker_queued_or_granted():
    q = WriteQueue()
    q.queue(grant(0, 1, [A]))
    with pytest.raises(ProtocolError, match="write request id 1 of worker 0 is already open"):
        q.queue(grant(0, 1, [B]))
    q.queue(grant(1, 1, [A]))                                 # another worker's id 1 is its own
    g = q.drain()[0]
    q.granted(g, [object()])
    with pytest.raises(ProtocolError, match="already open"):
        q.queue(grant(0, 1, [A]))


def test_a_grant_is_ended_by_written_once_and_only_by_its_worker():
    q = WriteQueue()
    g, rnd = grant(0, 7, [A]), object()
    q.queue(g)
    Owner().advance(q)
    q.granted(g, [rnd])
    with pytest.raises(ProtocolError, match="'written' names no write granted to worker 1: 7"):
        q.take({"op": ops.WRITTEN, "id": 9, "src": 1, "grant": 7}, num_workers=2)
    worker, taken = q.take({"op": ops.WRITTEN, "id": 9, "src": 0, "grant": 7}, num_workers=2)
    assert worker == 0 and taken is g and taken.rounds[0] is rnd    # the owner's rounds, given back
    for bad in (7, "7", None):
        with pytest.raises(ProtocolError, match="names no write granted to worker 0"):
            q.take({"op": ops.WRITTEN, "id": 10, "src": 0, "grant": bad}, num_workers=2)


def test_failing_a_round_marks_only_the_grants_that_wrote_into_it_with_the_first_reason():
    q = WriteQueue()
    r1, r2 = object(), object()
    g1, g2 = grant(0, 1, [A]), grant(1, 2, [B])
    q.granted(g1, [r1])
    q.granted(g2, [r2])
    q.fail_grants_into(r1, "worker 2 closed its store")
    q.fail_grants_into(r1, "a later reason")
    assert g1.error == "worker 2 closed its store" and g2.error is None
    assert q.take({"src": 0, "grant": 1}, 3)[1].error == "worker 2 closed its store"


def test_drain_empties_the_queue_and_a_worker_that_leaves_takes_only_its_own_requests():
    q = WriteQueue()
    entries = [grant(0, 1, [A]), held(0, 2, [A]), grant(1, 3, [A]), grant(1, 4, [B])]
    q.queue(entries[0])
    q.hold(entries[1])
    q.queue(entries[2])
    q.queue(entries[3])
    mine = grant(0, 5, [B])
    q.granted(mine, [object()])
    assert q.leave(0) == entries[:2]                          # its queued write and held push
    with pytest.raises(ProtocolError):                        # its grant is forgotten
        q.take({"src": 0, "grant": 5}, 2)
    assert q.queued(1, A) and q.queued(1, B)
    assert q.drain() == entries[2:] and q.drain() == []
    assert not q.queued(1, A)


def test_write_request_reads_the_sender_its_chunks_and_whether_it_wants_values():
    assert write_request({"src": 1, "chunks": [["w", 0], [3, 1]]}, 2) == (1, [A, (3, 1)], True)
    assert write_request({"src": 0, "chunks": [["w", 0]], "values": False}, 2) == (0, [A], False)
    for header, fragment in [
        ({"src": 0, "chunks": [["w", 0]], "values": "yes"}, "'values' must be true or false"),
        ({"src": 2, "chunks": [["w", 0]]}, r"'src' must be the sender's worker rank \(0..1\)"),
        ({"src": 0, "chunks": [["w", 0], ["w", 0]]}, "a chunk appears twice"),
        ({"src": 0, "chunks": "w"}, "'chunks' must be a list"),
    ]:
        with pytest.raises(ProtocolError, match=fragment):
            write_request(header, 2)
