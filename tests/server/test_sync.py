"""kvstore.server.sync on its own: the :class:`Sync` strategy, built the way
``ServerState._configure`` builds it (a ``ChunkTable`` over a ``HostBackend``, the
state's ``Members`` and ``ServerOptimizer``) and driven through its own interface
(``admit``, ``push``, ``pull``, ``left``, ``workers_finished``, ``write``,
``written``, ``queued_rounds``), with the preconditions ``ServerState`` checks
before it calls them (existing chunks of the right size, a member pushing).

Each test pins a sentence of sync.py's docstring: a round is applied once every
rank contributed and then every push in it is answered; a worker that pushes
again starts the next round; a pull waits for its worker's pending pushes; the
first push is kept as it came and steady rounds allocate nothing; ``ordered``
adds in rank order whatever the arrival; a worker that left counts with nothing;
a finished worker's rounds fail naming it; writes are granted one at a time.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvstore.errors import InvalidArgumentError
from kvstore.protocol import chunk_label, ops
from kvstore.server.backend import HostBackend
from kvstore.server.chunks import ChunkTable
from kvstore.server.members import Members
from kvstore.server.server_optimizer import ServerOptimizer
from kvstore.server.sync import Sync

pytestmark = pytest.mark.timeout(30)

A, B = ("w", 0), ("w", 1)
F32 = np.float32


def peer(worker: int) -> bytes:
    return b"w%d" % worker


def make_sync(workers: int = 3, ordered: bool = False, alloc=None, shared=None, size: int = 4) -> Sync:
    """A Sync over chunks A and B (zeros), as ServerState._configure makes it."""
    table = ChunkTable("server 0", HostBackend(alloc, shared))
    sync = Sync(table, workers, Members(), ServerOptimizer(), None, ordered)
    table.init([A, B], [np.zeros(size, F32), np.zeros(size, F32)])
    return sync


def push(sync: Sync, worker: int, req_id: int, grads: dict, want_values: bool = False) -> list:
    """A validated push, as ServerState._on_push hands it over (admit first)."""
    ids = list(grads)
    sync.admit(worker, ids, want_values)
    arrays = [np.asarray(g, F32) for g in grads.values()]
    return sync.push(peer(worker), req_id, worker, ids, sync.table.existing(ids, arrays), arrays,
                     want_values, None)


def pull(sync: Sync, worker: int, req_id: int, ids) -> list:
    return sync.pull(peer(worker), req_id, worker, list(ids), sync.table.existing(list(ids)))


def by_id(replies) -> dict:
    out = {r.header["id"]: r for r in replies}
    assert len(out) == len(replies), "two replies to one request"
    return out


def ok(reply, worker: int, nvalues: int = 0):
    assert reply.header["op"] == ops.OK, reply.header
    assert reply.peer == peer(worker)
    assert len(reply.arrays) == nvalues
    return reply


def error(reply, worker: int, kind: str, *fragments):
    assert reply.header["op"] == ops.ERROR, reply.header
    assert reply.peer == peer(worker) and reply.header["kind"] == kind
    for f in fragments:
        assert f in reply.header["message"], (f, reply.header["message"])
    return reply


def value(sync: Sync, cid) -> np.ndarray:
    return sync.table.chunks[cid].value


# -- rounds --------------------------------------------------------------------------------
def test_a_round_is_applied_once_every_rank_pushed_and_then_every_push_in_it_is_answered():
    sync = make_sync(workers=3)
    assert push(sync, 0, 1, {A: [1, 1, 1, 1]}) == []
    assert push(sync, 1, 2, {A: [2, 2, 2, 2]}) == []
    [(cid, rnd)] = list(sync.queued_rounds())
    assert cid == A and rnd.workers == {0, 1}
    np.testing.assert_array_equal(value(sync, A), 0)          # nothing applied before the round is full
    replies = by_id(push(sync, 2, 3, {A: [4, 4, 4, 4]}))
    assert set(replies) == {1, 2, 3}
    for rid, worker in ((1, 0), (2, 1), (3, 2)):
        ok(replies[rid], worker)                             # a push is answered without values
    np.testing.assert_array_equal(value(sync, A), 7)         # no optimizer: the sum is the value
    assert list(sync.queued_rounds()) == []


def test_a_worker_that_pushes_again_before_its_round_completed_starts_the_next_round():
    sync = make_sync(workers=2)
    chunk = sync.table.chunks[A]
    assert push(sync, 0, 1, {A: [1] * 4}) == []
    assert push(sync, 0, 2, {A: [10] * 4}) == []
    assert len(chunk.rounds) == 2 and [r.workers for r in chunk.rounds] == [{0}, {0}]
    assert sync.round_to_join(chunk, 0) == 2 and sync.round_to_join(chunk, 1) == 0
    replies = by_id(push(sync, 1, 3, {A: [2] * 4}))
    assert set(replies) == {1, 3}                            # worker 0's second push waits for round 2
    np.testing.assert_array_equal(value(sync, A), 3)
    replies = by_id(push(sync, 1, 4, {A: [20] * 4}))
    assert set(replies) == {2, 4}
    np.testing.assert_array_equal(value(sync, A), 30)


def test_a_pull_waits_for_its_workers_pending_push_and_reads_the_result_of_that_round():
    sync = make_sync(workers=2)
    push(sync, 0, 1, {A: [1] * 4})
    assert pull(sync, 0, 2, [A]) == []                       # its own push is pending: parked
    early = ok(pull(sync, 1, 3, [A])[0], 1, nvalues=1)       # worker 1 has none: answered now
    np.testing.assert_array_equal(early.arrays[0], 0)
    replies = by_id(push(sync, 1, 4, {A: [2] * 4}, want_values=True))   # a pushpull
    assert set(replies) == {1, 2, 4}
    np.testing.assert_array_equal(ok(replies[2], 0, nvalues=1).arrays[0], 3)
    np.testing.assert_array_equal(ok(replies[4], 1, nvalues=1).arrays[0], 3)


def test_a_pull_of_two_chunks_is_answered_once_neither_has_a_push_of_its_worker_pending():
    sync = make_sync(workers=2)
    push(sync, 0, 1, {A: [1] * 4, B: [5] * 4})
    assert pull(sync, 0, 2, [B, A]) == []
    assert by_id(push(sync, 1, 3, {A: [1] * 4})).keys() == {3}   # A done; the push waits for B too
    replies = by_id(push(sync, 1, 4, {B: [1] * 4}))
    assert set(replies) == {1, 2, 4}
    got = ok(replies[2], 0, nvalues=2).arrays
    np.testing.assert_array_equal(got[0], 6)                 # in the order the pull named them
    np.testing.assert_array_equal(got[1], 2)


def test_the_first_push_is_kept_as_it_came_and_steady_rounds_allocate_nothing():
    """contribute(): the first push is kept (a view on the message), the second added
    to it into the accumulator; docs/architecture.md §5: without an optimizer the
    accumulator and the value are swapped, and steady-state rounds allocate nothing."""
    sizes = []

    def alloc(size, dtype):                      # the node's allocator, counted
        sizes.append(size)
        return np.empty(size, dtype)
    sync = make_sync(workers=3, alloc=alloc)
    assert sizes == [4, 4]                       # the values of A and B
    chunk = sync.table.chunks[A]
    for step in range(1, 5):
        g0 = np.full(4, step, F32)
        push(sync, 0, 10 * step, {A: g0})
        rnd = chunk.rounds[0]
        assert rnd.first is not None and np.shares_memory(rnd.first, g0) and rnd.acc is None
        push(sync, 1, 10 * step + 1, {A: np.full(4, 2 * step, F32)})
        assert rnd.first is None and rnd.acc is not None
        np.testing.assert_array_equal(g0, step)  # the worker's buffer was read, never written
        push(sync, 2, 10 * step + 2, {A: np.full(4, 3 * step, F32)})
        np.testing.assert_array_equal(value(sync, A), 6 * step)
    assert sizes == [4, 4, 4]                    # one accumulator, in round 1; recycled since


# -- deterministic sums (ordered) ------------------------------------------------------------
PARTS = [np.full(4, 1.0, F32), np.full(4, 1e8, F32), np.full(4, -1e8, F32)]
RANK_ORDER = (PARTS[0] + PARTS[1]) + PARTS[2]     # float32: (1 + 1e8) - 1e8 == 0, not 1


def summed(ordered: bool, arrival) -> np.ndarray:
    sync = make_sync(workers=3, ordered=ordered)
    for i, worker in enumerate(arrival):
        push(sync, worker, i + 1, {A: PARTS[worker]})
    return value(sync, A).copy()


def test_ordered_sums_add_a_rounds_pushes_in_rank_order_whatever_their_arrival():
    for arrival in itertools.permutations(range(3)):
        assert summed(True, arrival).tobytes() == RANK_ORDER.tobytes(), arrival
    # the values are ones where order shows: summed as they come, some orders differ
    assert {summed(False, arrival).tobytes() for arrival in itertools.permutations(range(3))} != \
        {RANK_ORDER.tobytes()}


def test_an_early_push_is_held_as_it_came_until_every_lower_rank_is_in():
    sync = make_sync(workers=3, ordered=True)
    g2 = PARTS[2].copy()
    push(sync, 2, 1, {A: g2})
    rnd = sync.table.chunks[A].rounds[0]
    assert set(rnd.held) == {2} and np.shares_memory(rnd.held[2][1], g2)   # held, not copied, not added
    assert rnd.acc is None and rnd.first is None
    push(sync, 1, 2, {A: PARTS[1]})
    assert set(rnd.held) == {1, 2} and rnd.acc is None and rnd.first is None
    replies = push(sync, 0, 3, {A: PARTS[0]})                 # rank 0 in: 0, 1, 2 are added
    assert {r.header["id"] for r in replies} == {1, 2, 3}
    assert value(sync, A).tobytes() == RANK_ORDER.tobytes()


# -- a worker that leaves (an elastic job) ---------------------------------------------------
def test_a_worker_that_left_counts_with_nothing_where_it_had_not_pushed_and_its_parked_pull_fails():
    sync = make_sync(workers=3)
    push(sync, 0, 1, {A: [1] * 4})
    push(sync, 1, 2, {A: [2] * 4})
    push(sync, 2, 3, {B: [7] * 4})                            # worker 2's push to B counts...
    assert pull(sync, 2, 4, [B]) == []                        # ...and its pull is parked behind it
    # what ServerState.set_members does: the members first, then the strategy
    assert sync.members.change(1, frozenset({0, 1}), 3) == [2]
    replies = by_id(sync.left(2, "worker 2 left the job"))
    assert set(replies) == {1, 2, 3, 4}
    ok(replies[1], 0)
    ok(replies[2], 1)
    for rid in (3, 4):                                        # its requests still parked fail
        error(replies[rid], 2, "RemoteError", "worker 2 left the job")
    np.testing.assert_array_equal(value(sync, A), 3)          # its round completed without it
    [(cid, rnd)] = list(sync.queued_rounds())                 # B's round keeps its push, waits for 0, 1
    assert cid == B and rnd.workers == {2}
    push(sync, 0, 5, {A: [1] * 4})                            # a new round counts it from the start
    assert sync.table.chunks[A].rounds[0].workers == {0, 2}
    assert {r.header["id"] for r in push(sync, 1, 6, {A: [1] * 4})} == {5, 6}
    np.testing.assert_array_equal(value(sync, A), 2)
    push(sync, 0, 7, {B: [1] * 4})
    assert {r.header["id"] for r in push(sync, 1, 8, {B: [1] * 4})} == {7, 8}
    np.testing.assert_array_equal(value(sync, B), 9)          # the leaver's push to B counted


def test_with_ordered_sums_a_worker_that_left_lets_the_pushes_held_behind_it_in():
    sync = make_sync(workers=3, ordered=True)
    push(sync, 0, 1, {A: PARTS[0]})
    push(sync, 2, 2, {A: PARTS[2]})                           # held: rank 1 has not pushed
    assert set(sync.table.chunks[A].rounds[0].held) == {2}
    sync.members.change(1, frozenset({0, 2}), 3)
    replies = sync.left(1, "worker 1 left the job")
    assert {r.header["id"] for r in replies} == {1, 2}
    assert value(sync, A).tobytes() == (PARTS[0] + PARTS[2]).tobytes()


# -- a worker that finished ------------------------------------------------------------------
def test_a_finished_workers_rounds_fail_naming_it_and_so_do_its_later_pushes():
    sync = make_sync(workers=3)
    push(sync, 0, 1, {A: [1] * 4})
    push(sync, 1, 2, {A: [1] * 4})                            # A's round waits for worker 2
    push(sync, 2, 3, {B: [1] * 4})
    push(sync, 0, 4, {B: [1] * 4})                            # B's has worker 2's push in it
    sync.table.gone |= {2}                                    # the scheduler says 2 finished
    replies = by_id(sync.workers_finished())
    assert set(replies) == {1, 2}
    for rid, worker in ((1, 0), (2, 1)):
        error(replies[rid], worker, "RemoteError", "worker 2 closed its store while round 1 of "
              f"{chunk_label(A)} waits for its push")
    np.testing.assert_array_equal(value(sync, A), 0)          # the failed round changed nothing
    assert [cid for cid, _ in sync.queued_rounds()] == [B]
    assert {r.header["id"] for r in push(sync, 1, 5, {B: [1] * 4})} == {3, 4, 5}   # B completes
    np.testing.assert_array_equal(value(sync, B), 3)
    with pytest.raises(InvalidArgumentError, match="worker 2 closed its store"):
        push(sync, 0, 6, {A: [1] * 4})                        # a round it would never join
    assert list(sync.queued_rounds()) == []                   # refused before anything changed


# -- write-in: Sync grants writes into its rounds, in the order its WriteQueue gives ---------
def write(sync: Sync, worker: int, req_id: int, ids, values: bool = True) -> list:
    return sync.write(peer(worker), {"op": ops.WRITE, "id": req_id, "src": worker,
                                     "chunks": [list(c) for c in ids], "values": values})


def written(sync: Sync, worker: int, req_id: int, grant: int) -> list:
    return sync.written(peer(worker), {"op": ops.WRITTEN, "id": req_id, "src": worker, "grant": grant})


def test_writes_are_granted_one_at_a_time_and_a_push_during_a_write_is_added_after_it():
    sync = make_sync(workers=3)
    chunk = sync.table.chunks[A]
    grant0 = ok(write(sync, 0, 1, [A])[0], 0, nvalues=1)      # opens the round: copy into its sum
    assert grant0.header["modes"] == ["copy"] and grant0.header["write_in"] is True
    acc = grant0.arrays[0]
    assert chunk.rounds[0].acc is acc and chunk.rounds[0].writer == 0
    assert write(sync, 1, 2, [A]) == []                       # one writer at a time: queued
    assert sync.writes.queued(1, A)
    assert push(sync, 2, 3, {A: [100] * 4}) == []             # deferred until the writer is done
    np.copyto(acc, 1)                                         # worker 0 writes its gradient
    replies = by_id(written(sync, 0, 4, grant=1))
    assert set(replies) == {2}                                # worker 1's turn: add to the same sum
    grant1 = ok(replies[2], 1, nvalues=1)
    assert grant1.header["modes"] == ["add"] and grant1.arrays[0] is acc
    np.testing.assert_array_equal(acc, 101)                   # the deferred push was added meanwhile
    acc += 10                                                 # worker 1 adds its gradient
    replies = by_id(written(sync, 1, 5, grant=2))
    assert set(replies) == {3, 4, 5}                          # complete: answered as pushpulls
    np.testing.assert_array_equal(ok(replies[4], 0, nvalues=1).arrays[0], 111)
    np.testing.assert_array_equal(ok(replies[5], 1, nvalues=1).arrays[0], 111)
    ok(replies[3], 2)
    np.testing.assert_array_equal(value(sync, A), 111)


def test_a_write_into_a_sum_outside_shared_memory_is_refused_whole_and_opens_nothing():
    sync = make_sync(workers=2, shared=lambda a: False)
    reply = write(sync, 0, 1, [A, B])[0]
    assert reply.header["op"] == ops.ERROR and reply.header["kind"] == "InternalError"
    assert "not in shared memory" in reply.header["message"] and "KVSTORE_WRITE_IN=0" in reply.header["message"]
    assert list(sync.queued_rounds()) == [] and not sync.writes.queued(0, A)


def test_a_finished_worker_fails_the_queued_writes_and_the_open_grant_of_its_rounds():
    sync = make_sync(workers=3)
    ok(write(sync, 0, 1, [A])[0], 0, nvalues=1)
    assert write(sync, 1, 2, [A]) == []
    sync.table.gone |= {2}
    replies = by_id(sync.workers_finished())
    error(replies[2], 1, "InvalidArgumentError", "worker 2 closed its store")
    assert not sync.writes.queued(1, A)
    reply = written(sync, 0, 3, grant=1)[0]                   # the grant ends with the reason
    error(reply, 0, "InvalidArgumentError", "worker 2 closed its store")
