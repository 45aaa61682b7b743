"""kvstore.server.ssp and kvstore.server.asyncmode on their own: the
:class:`Ssp` (``dist_ssp``) and :class:`Async` (``dist_async``) strategies,
built the way ``ServerState._configure`` builds a strategy and driven through
their interface (``admit``, ``push``, ``pull``, ``workers_finished``, ``stalled``).

Pinned from their docstrings: async applies every push on arrival with the
optimizer and answers every read at once with a copy; ssp does the same and counts
per chunk each worker's clock, a read from a worker at clock ``c`` waits until
every worker's clock is at least ``c - s``, a read of several chunks waits for all;
a read that waits for a finished worker fails naming it (at once when it arrives
after the scheduler said so); parked reads are reported once by the stall
inspector's call.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import optimizer
from kvstore.errors import InvalidArgumentError
from kvstore.protocol import ops
from kvstore.server.asyncmode import Async
from kvstore.server.backend import HostBackend
from kvstore.server.chunks import ChunkTable
from kvstore.server.members import Members
from kvstore.server.server_optimizer import ServerOptimizer
from kvstore.server.ssp import Ssp

pytestmark = pytest.mark.timeout(30)

A, B = ("w", 0), ("w", 1)
F32 = np.float32


def make(strategy, workers: int = 2, bound: int | None = None, opt: bool = True):
    """A strategy over chunks A and B (zeros), with SGD(lr=1) set: value -= grad."""
    table = ChunkTable("server 0", HostBackend())
    server_opt = ServerOptimizer()
    if opt:
        server_opt.set({"optimizer": optimizer.SGD(learning_rate=1.0).to_config()})
    s = strategy(table, workers, Members(), server_opt, bound)
    table.init([A, B], [np.zeros(3, F32), np.zeros(3, F32)])
    return s


def push(s, worker: int, req_id: int, grads: dict, want_values: bool = False) -> list:
    ids = list(grads)
    s.admit(worker, ids, want_values)
    arrays = [np.asarray(g, F32) for g in grads.values()]
    return s.push(b"w%d" % worker, req_id, worker, ids, s.table.existing(ids, arrays), arrays, want_values, None)


def pull(s, worker: int, req_id: int, ids) -> list:
    return s.pull(b"w%d" % worker, req_id, worker, list(ids), s.table.existing(list(ids)))


def values(reply) -> list:
    assert reply.header["op"] == ops.OK, reply.header
    return reply.arrays


# -- async -----------------------------------------------------------------------------------
def test_async_applies_every_push_on_arrival_and_answers_reads_at_once_with_copies():
    s = make(Async)
    [reply] = push(s, 0, 1, {A: [1, 2, 3]})
    assert reply.header["id"] == 1 and values(reply) == []
    [reply] = push(s, 1, 2, {A: [1, 1, 1]}, want_values=True)     # a pushpull: the values after it
    np.testing.assert_array_equal(values(reply)[0], [-2, -3, -4])
    [read] = pull(s, 0, 3, [A, B])
    got = values(read)
    np.testing.assert_array_equal(got[0], [-2, -3, -4])
    assert not np.shares_memory(got[0], s.table.chunks[A].value)  # any push may change it later
    assert list(s.queued_rounds()) == [] and s.workers_finished() == []


def test_async_and_ssp_refuse_pushes_before_an_optimizer_is_set():
    for strategy, bound in ((Async, None), (Ssp, 1)):
        s = make(strategy, bound=bound, opt=False)
        with pytest.raises(InvalidArgumentError, match="applies every push with an optimizer: call "
                                                       "set_optimizer"):
            s.admit(0, [A], False)


def test_modes_without_ordered_sums_refuse_them_and_ssp_needs_its_bound():
    table, server_opt = ChunkTable("server 0", HostBackend()), ServerOptimizer()
    with pytest.raises(InvalidArgumentError, match="deterministic sums need dist_sync"):
        Async(table, 2, Members(), server_opt, None, ordered=True)
    with pytest.raises(ValueError, match="dist_ssp needs a staleness bound"):
        Ssp(table, 2, Members(), server_opt, None)


# -- ssp -------------------------------------------------------------------------------------
def test_a_read_waits_until_every_workers_clock_is_within_the_bound_of_the_readers():
    s = make(Ssp, workers=2, bound=1)
    push(s, 0, 1, {A: [1, 1, 1]})
    assert len(pull(s, 0, 2, [A])) == 1                # clock 1: needs every clock >= 0
    push(s, 0, 3, {A: [1, 1, 1]})                      # applied on arrival: clock 2
    np.testing.assert_array_equal(s.table.chunks[A].value, -2)
    assert pull(s, 0, 4, [A]) == []                    # needs worker 1 at >= 1: parked
    assert pull(s, 1, 5, [A]) != []                    # worker 1 (clock 0) is not held back
    replies = push(s, 1, 6, {A: [10, 10, 10]})         # worker 1 reaches 1: the read goes
    assert {r.header["id"] for r in replies} == {4, 6}
    parked = next(r for r in replies if r.header["id"] == 4)
    np.testing.assert_array_equal(values(parked)[0], -12)   # the values when it was answered
    assert s.clocks[A] == [2, 1]


def test_the_slowest_worker_counts_a_push_that_leaves_another_behind_releases_nothing():
    s = make(Ssp, workers=3, bound=1)
    push(s, 0, 1, {A: [1, 1, 1]})
    push(s, 0, 2, {A: [1, 1, 1]})
    assert pull(s, 0, 3, [A]) == []                    # needs workers 1 and 2 at >= 1
    assert [r.header["id"] for r in push(s, 1, 4, {A: [0, 0, 0]})] == [4]   # worker 2 is still at 0
    assert {r.header["id"] for r in push(s, 2, 5, {A: [0, 0, 0]})} == {3, 5}


def test_a_pushpull_reads_after_its_own_push_and_a_read_of_two_chunks_waits_for_both():
    s = make(Ssp, workers=2, bound=1)
    push(s, 0, 1, {A: [1, 1, 1], B: [1, 1, 1]})
    assert push(s, 0, 2, {A: [1, 1, 1], B: [1, 1, 1]}, want_values=True) == []   # clock 2: waits
    push(s, 1, 3, {A: [0, 0, 0]})                      # A is within the bound now, B is not
    assert {r.header["id"] for r in push(s, 1, 4, {B: [0, 0, 0]})} == {4, 2}     # now both are
    assert s.reads == []


def test_a_read_waiting_for_a_finished_worker_fails_naming_it_and_a_later_one_is_refused_at_once():
    s = make(Ssp, workers=2, bound=1)
    push(s, 0, 1, {A: [1, 1, 1]})
    push(s, 0, 2, {A: [1, 1, 1]})
    assert pull(s, 0, 3, [A]) == []
    s.table.gone |= {1}                                # the scheduler says worker 1 finished
    [reply] = s.workers_finished()
    assert reply.header["op"] == ops.ERROR and reply.header["id"] == 3
    message = reply.header["message"]
    assert "worker 1 (after 0 pushes) closed its store, but worker 0's read of key 'w' (chunk 0) waits for " \
           "every worker to have pushed it 1 times (dist_ssp, staleness 1" in message
    with pytest.raises(InvalidArgumentError, match="worker 1 .after 0 pushes. closed its store"):
        pull(s, 0, 4, [A])
    with pytest.raises(InvalidArgumentError, match="closed its store"):
        s.admit(0, [A], True)                           # a pushpull whose reply would wait for it
    s.admit(0, [A], False)                              # a plain push waits for nobody


def test_a_parked_read_is_reported_once_with_made_up_times():
    s = make(Ssp, workers=3, bound=2)
    for rid in (1, 2, 3):
        push(s, 0, rid, {B: [0, 0, 0]})
    assert pull(s, 0, 4, [B]) == []
    assert s.stalled(10.0, 5.0) == []                   # first seen now
    assert s.stalled(16.0, 5.0) == [
        "a pull of worker 0 has waited 6s for worker(s) 1, 2 to push key 'w' (chunk 1) 1 times (dist_ssp, "
        "staleness 2: no worker reads more than 2 steps ahead of the slowest; they pushed it 0, 0 times)"]
    assert s.stalled(100.0, 5.0) == []
