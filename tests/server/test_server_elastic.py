"""Elastic workers in the server's state machine (ServerState.set_members,
kvstore.server.members), driven without sockets.

A round completes when every worker rank (configure's ``num_workers``) is counted in
it; a rank that is not an active member on the chunk is counted from the start,
contributing nothing. A worker that leaves is counted in every queued round it has
not pushed to (its pushes already in rounds count; its parked requests fail naming
it); a worker that joins is inactive on a chunk until its first push there, so its
pulls before then wait for the rounds queued and its first push opens a new round.

Worker ``w`` pushes ``g(w) = (w + 1) * [1, 10]`` (or ``BASE ** w`` in the ssp tests),
so each expected value is a sum over the ranks that counted.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvstore.protocol import ops
from kvstore.server.state import ServerState
from state_driver import A, B, F32, Server, by_id, expect_error, expect_ok, only, peer, sgd, vec

pytestmark = pytest.mark.timeout(60)

I64 = np.int64
E = ["e", 1]                 # the rows of key "e" held by server 1 of 2: rows 1, 3, 5


def g(w, step=0):
    """Worker ``w``'s gradient at ``step``: distinct per worker and step, exact in float32."""
    return vec(w + 1, 10 * (w + 1)) * (100 ** step)


def total(ranks, step=0):
    return sum((g(w, step) for w in ranks), vec(0, 0))


class SspServer(Server):
    """The driver for a dist_ssp server (configure carries the staleness bound)."""

    def __init__(self, num_workers, opt, init, bound=1):
        self.state = ServerState(name="server 0")
        self._ids = itertools.count(1)
        _, r = self.send(0, ops.CONFIGURE, mode="ssp", num_workers=num_workers, staleness=bound)
        expect_ok(only(r), peer(0))
        self.set_optimizer(opt)
        self.init(init)


def elastic(num_workers=3, members=None, opt=None, write_in=False, mode="sync", epoch=0):
    init = {A: vec(0, 0), B: vec(0, 0)}
    srv = SspServer(num_workers, opt, init) if mode == "ssp" else \
        Server(mode=mode, num_workers=num_workers, opt=opt, init=init, write_in=write_in)
    assert srv.state.set_members(epoch, range(num_workers) if members is None else members) == []
    return srv


def ok_ids(replies, expected: dict):
    """The replies are ok answers to exactly ``expected`` (request id -> worker)."""
    out = by_id(replies)
    assert set(out) == set(expected), (sorted(out), sorted(expected))
    for rid, w in expected.items():
        expect_ok(out[rid], peer(w), rid)
    return out


# -- members ----------------------------------------------------------------------------------

def test_with_every_rank_a_member_a_round_waits_for_every_rank_as_before():
    srv = elastic(num_workers=3)
    p0, _ = srv.push(0, {A: g(0)})
    p1, r = srv.push(1, {A: g(1)})
    assert r == []
    p2, r = srv.push(2, {A: g(2)})
    ok_ids(r, {p0: 0, p1: 1, p2: 2})
    np.testing.assert_array_equal(srv.value(A), total(range(3)))


def test_set_members_before_configure_is_applied_by_configure():
    state = ServerState()
    assert state.set_members(4, [0, 2]) == []
    r = state.handle(peer(0), {"op": ops.CONFIGURE, "id": 1, "src": 0, "mode": "sync", "num_workers": 3}, [])
    expect_ok(only(r), peer(0), 1)
    assert (state.members.epoch, state.members.ranks) == (4, frozenset({0, 2}))
    r = state.handle(peer(1), {"op": ops.PUSH, "id": 2, "src": 1, "chunks": []}, [])
    expect_error(only(r), peer(1), 2, "InvalidArgumentError",
                 "worker 1 is not a member of the elastic job (a worker that joins pushes after its "
                 "first barrier) (members 0, 2 at epoch 4)")


def test_members_that_are_not_ranks_make_configure_fail_and_change_nothing():
    state = ServerState()
    state.set_members(0, [0, 3])
    r = state.handle(peer(0), {"op": ops.CONFIGURE, "id": 1, "src": 0, "mode": "sync", "num_workers": 2}, [])
    expect_error(only(r), peer(0), 1, "InvalidArgumentError",
                 "members 3 of the elastic job are not worker ranks 0..1 (configure said num_workers=2")
    assert state.mode is None and state.members.pending == (0, frozenset({0, 3}))


def test_old_epochs_are_ignored_and_one_epoch_has_one_set_of_members():
    srv = elastic(num_workers=3, members=[0, 1], epoch=5)
    assert srv.state.set_members(4, [0]) == [] and srv.state.set_members(5, [0, 1]) == []
    assert srv.state.members.ranks == {0, 1}
    with pytest.raises(Exception, match="epoch 5 of the elastic job came with two sets of members: 0, 1 and 0"):
        srv.state.set_members(5, [0])


def test_a_request_from_a_rank_that_is_no_member_is_refused_and_changes_nothing():
    srv = elastic(num_workers=4, members=[0, 1, 2])
    p0, _ = srv.push(0, {A: g(0)})
    assert srv.state.set_members(1, [0, 1]) == []          # 2 left; 3 never was a member
    rid, r = srv.push(2, {A: g(2)})
    expect_error(only(r), peer(2), rid, "InvalidArgumentError",
                 "worker 2 is no longer a member of the elastic job: it left (members 0, 1 at epoch 1)")
    rid, r = srv.push(3, {A: g(3)})
    expect_error(only(r), peer(3), rid, "InvalidArgumentError", "worker 3 is not a member of the elastic job")
    q3, r = srv.pull(3, [A])             # reads change nothing: anybody may (after the queued round)
    assert r == []
    p1, r = srv.push(1, {A: g(1)})
    ok_ids(r, {p0: 0, p1: 1, q3: 3})
    np.testing.assert_array_equal(srv.value(A), total([0, 1]))   # nothing of worker 2's


# -- leave ------------------------------------------------------------------------------------

@pytest.mark.parametrize("opt", [None, sgd()], ids=["assign", "sgd"])
def test_a_round_completes_without_the_worker_that_left(opt):
    srv = elastic(num_workers=3, opt=opt)
    p0, _ = srv.push(0, {A: g(0)})
    p1, r = srv.push(1, {A: g(1)})
    assert r == []
    ok_ids(srv.state.set_members(1, [0, 1]), {p0: 0, p1: 1})   # 2 left: the round is theirs
    np.testing.assert_array_equal(srv.value(A), total([0, 1]) * (1 if opt is None else -1))
    p0, _ = srv.push(0, {A: g(0, 1)})                            # and so is every later round
    p1, r = srv.push(1, {A: g(1, 1)})
    ok_ids(r, {p0: 0, p1: 1})


def test_the_leavers_push_counts_where_it_pushed_and_its_parked_requests_fail():
    srv = elastic(num_workers=3)
    p0, _ = srv.push(0, {A: g(0), B: g(0, 1)})
    p2, r = srv.push(2, {A: g(2)})                   # in A's round, not in B's
    q2, r2 = srv.pull(2, [A, B])
    assert r == [] and r2 == []
    replies = by_id(srv.state.set_members(1, [0, 1]))
    assert set(replies) == {p2, q2}
    for rid in (p2, q2):
        expect_error(replies[rid], peer(2), rid, "RemoteError", "worker 2 left the job")
    p1, r = srv.push(1, {A: g(1), B: g(1, 1)})
    ok_ids(r, {p0: 0, p1: 1})
    np.testing.assert_array_equal(srv.value(A), total([0, 1, 2]))      # its push counts
    np.testing.assert_array_equal(srv.value(B), total([0, 1], step=1))  # it counts with nothing
    assert srv.state.chunks[A].rounds == [] and srv.state.chunks[B].rounds == []


def test_rounds_queued_behind_each_other_all_complete_in_order_when_a_worker_leaves():
    srv = elastic(num_workers=3, opt=sgd())
    ids = {}
    for step in range(2):                          # workers 0 and 1 run two rounds ahead
        for w in (0, 1):
            ids[srv.push(w, {A: g(w, step)})[0]] = w
    pull0, r = srv.pull(0, [A])
    assert r == []
    replies = ok_ids(srv.state.set_members(1, [0, 1]), {**ids, pull0: 0})
    np.testing.assert_array_equal(replies[pull0].arrays[0], -(total([0, 1]) + total([0, 1], step=1)))


def test_workers_that_leave_together_each_count_once():
    srv = elastic(num_workers=4)
    p0, _ = srv.push(0, {A: g(0)})
    p3, _ = srv.push(3, {A: g(3)})
    ok_ids(srv.state.set_members(1, [0, 3]), {p0: 0, p3: 3})
    np.testing.assert_array_equal(srv.value(A), total([0, 3]))


# -- join -------------------------------------------------------------------------------------

def test_a_joiners_first_pull_waits_for_the_queued_round_and_reads_its_result():
    srv = elastic(num_workers=3, members=[0, 1])
    p0, _ = srv.push(0, {A: g(0)})                     # rank 2 vacant: counted with nothing
    assert srv.state.set_members(1, [0, 1, 2]) == []  # 2 joins while the round waits for 1
    q2, r = srv.pull(2, [A])
    assert r == [], "the joiner's pull waits for the round queued before it came"
    p1, r = srv.push(1, {A: g(1)})
    replies = ok_ids(r, {p0: 0, p1: 1, q2: 2})
    np.testing.assert_array_equal(replies[q2].arrays[0], total([0, 1]))


def test_a_joiners_first_push_opens_a_new_round_that_waits_for_it():
    srv = elastic(num_workers=3, members=[0, 1], opt=sgd())      # (learning rate 1: the value is -sum)
    p0, _ = srv.push(0, {A: g(0)})
    srv.state.set_members(1, [0, 1, 2])
    p2, r = srv.push(2, {A: g(2, 1)})                  # the queued round counts it already
    assert r == [] and len(srv.state.chunks[A].rounds) == 2
    p1, r = srv.push(1, {A: g(1)})
    ok_ids(r, {p0: 0, p1: 1})                          # the first round: without worker 2
    p0b, r = srv.push(0, {A: g(0, 1)})
    assert r == []                                     # the new round waits for worker 1
    p1b, r = srv.push(1, {A: g(1, 1)})
    ok_ids(r, {p2: 2, p0b: 0, p1b: 1})
    np.testing.assert_array_equal(srv.value(A), -(total([0, 1]) + total([0, 1, 2], step=1)))
    p0c, r = srv.push(0, {A: g(0, 2)})
    p1c, r = srv.push(1, {A: g(1, 2)})
    assert r == [], "a round opened after worker 2's first push waits for it"


def test_a_new_member_is_waited_for_on_every_chunk_from_the_next_round():
    srv = elastic(num_workers=2, members=[0])
    srv.state.set_members(1, [0, 1])                   # (the scheduler does it at a barrier)
    p0, r = srv.push(0, {A: g(0), B: g(0, 1)})
    assert r == [], "both rounds wait for the new member"
    p1, r = srv.push(1, {A: g(1), B: g(1, 1)})
    ok_ids(r, {p0: 0, p1: 1})
    np.testing.assert_array_equal(srv.value(A), total([0, 1]))
    np.testing.assert_array_equal(srv.value(B), total([0, 1], step=1))


def test_a_worker_that_leaves_and_joins_again_is_waited_for_again():
    srv = elastic(num_workers=2)
    srv.state.set_members(1, [0])
    p0, r = srv.push(0, {A: g(0)})                     # alone: its round completes
    expect_ok(only(r), peer(0), p0)
    srv.state.set_members(2, [0, 1])
    p0, r = srv.push(0, {A: g(0, 1)})
    assert r == []
    p1, r = srv.push(1, {A: g(1, 1)})
    ok_ids(r, {p0: 0, p1: 1})
    np.testing.assert_array_equal(srv.value(A), total([0, 1], step=1))


def test_the_stall_inspector_names_only_the_members_a_round_waits_for():
    srv = elastic(num_workers=4, members=[0, 1, 2])
    srv.push(0, {A: g(0)})
    assert srv.state.stalled(100.0, 30.0) == []
    assert srv.state.stalled(131.0, 30.0) == [
        "key 'w' (chunk 0) has waited 31s for worker(s) 1, 2 to push (worker(s) 0 did)"]


# -- row-sparse tables --------------------------------------------------------------------------

def rows_server(num_workers=3, members=None):
    srv = Server(num_workers=num_workers)
    _, r = srv.send(0, ops.INIT_ROWS, arrays=[np.array([1, 3, 5], I64), np.zeros((3, 2), F32)], chunk=E,
                    shape=[7, 2], dtype="float32", servers=2, init=None)
    expect_ok(only(r), peer(0))
    srv.state.set_members(0, range(num_workers) if members is None else members)
    return srv


def push_rows(srv, w, rows):
    """Worker ``w`` pushes ``rows``, each row ``g(w) * (row + 1)``."""
    data = np.array([g(w) * (row + 1) for row in rows], F32).reshape(len(rows), 2)
    return srv.send(w, ops.PUSH_ROWS, arrays=[np.array(rows, I64), data], chunk=E)


def pull_rows(srv, w, rows=(1, 3, 5)):
    return srv.send(w, ops.PULL_ROWS, arrays=[np.array(rows, I64)], chunk=E)


def rows_of(pushed: dict) -> list:
    """The table's rows 1, 3, 5 after one round of ``pushed`` (worker -> its rows)."""
    return [(sum((g(w) for w, rows in pushed.items() if row in rows), vec(0, 0)) * (row + 1)).tolist()
            for row in (1, 3, 5)]


def test_a_row_round_counts_absent_ranks_with_empty_parts_and_merges_in_rank_order():
    srv = rows_server(num_workers=3, members=[0, 2])
    p2, r = push_rows(srv, 2, [1, 5])
    assert r == []
    (rnd,) = srv.state.rows.tables[tuple(E)].rounds
    assert sorted(rnd.parts) == [1, 2] and rnd.filled == {1} and len(rnd.parts[1][0]) == 0
    p0, r = push_rows(srv, 0, [5])
    ok_ids(r, {p0: 0, p2: 2})
    q, r = pull_rows(srv, 0)
    assert only(r).arrays[0].tolist() == rows_of({0: [5], 2: [1, 5]})


def test_a_row_round_completes_when_a_worker_leaves_and_its_parked_requests_fail():
    srv = rows_server(num_workers=3)
    p0, _ = push_rows(srv, 0, [1])
    p2, _ = push_rows(srv, 2, [5])
    q2, r = pull_rows(srv, 2)
    assert r == []
    replies = by_id(srv.state.set_members(1, [0, 1]))
    assert set(replies) == {p2, q2}
    for rid in (p2, q2):
        expect_error(replies[rid], peer(2), rid, "RemoteError", "worker 2 left the job")
    p1, r = push_rows(srv, 1, [1, 3])
    ok_ids(r, {p0: 0, p1: 1})
    _, r = pull_rows(srv, 0)
    assert only(r).arrays[0].tolist() == rows_of({0: [1], 1: [1, 3], 2: [5]})   # its rows count


def test_a_row_round_completes_without_the_leaver_and_a_joiner_waits_for_it():
    srv = rows_server(num_workers=3, members=[0, 1, 2])
    p0, _ = push_rows(srv, 0, [3])
    p1, _ = push_rows(srv, 1, [3, 5])
    ok_ids(srv.state.set_members(1, [0, 1]), {p0: 0, p1: 1})
    p0, _ = push_rows(srv, 0, [1])
    assert srv.state.set_members(2, [0, 1, 2]) == []
    q2, r = pull_rows(srv, 2)
    assert r == []
    p1, r = push_rows(srv, 1, [])
    replies = ok_ids(r, {p0: 0, p1: 1, q2: 2})
    first, second = rows_of({0: [3], 1: [3, 5]}), rows_of({0: [1]})
    assert replies[q2].arrays[0].tolist() == [[a + b for a, b in zip(x, y)] for x, y in zip(first, second)]


# -- write-in rounds ----------------------------------------------------------------------------

def write(srv, w, chunks=(A,)):
    return srv.send(w, ops.WRITE, list(chunks), values=True)


def written(srv, w, grant_id):
    return srv.send(w, ops.WRITTEN, grant=grant_id)


def test_a_round_opened_by_a_write_counts_the_ranks_that_are_no_members():
    srv = elastic(num_workers=3, members=[0, 1], write_in=True)
    w0, r = write(srv, 0)
    grant = expect_ok(only(r), peer(0), w0, nvalues=1)
    assert grant.header["modes"] == ["copy"]
    np.copyto(grant.arrays[0], g(0))
    d0, r = written(srv, 0, w0)
    assert r == []                                     # waits for worker 1, not for rank 2
    p1, r = srv.push(1, {A: g(1)}, op=ops.PUSHPULL)
    replies = ok_ids(r, {d0: 0, p1: 1})
    np.testing.assert_array_equal(replies[p1].arrays[0], total([0, 1]))


def test_a_leavers_queued_write_and_held_push_fail_and_the_round_counts_it_with_nothing():
    srv = elastic(num_workers=3, write_in=True)
    w0, r = write(srv, 0)
    np.copyto(only(r).arrays[0], g(0))
    w1, r = write(srv, 1)
    assert r == []                                     # queued behind worker 0's grant
    h1, r = srv.push(1, {A: g(1)})
    assert r == []                                     # held behind worker 1's own write
    replies = by_id(srv.state.set_members(1, [0, 2]))
    assert set(replies) == {w1, h1}
    for rid in (w1, h1):
        expect_error(replies[rid], peer(1), rid, "RemoteError", "worker 1 left the job")
    d0, r = written(srv, 0, w0)
    assert r == []
    p2, r = srv.push(2, {A: g(2)})
    ok_ids(r, {d0: 0, p2: 2})
    np.testing.assert_array_equal(srv.value(A), total([0, 2]))


def test_a_writer_that_leaves_drops_the_round_it_was_writing_into():
    srv = elastic(num_workers=3, write_in=True)
    p1, _ = srv.push(1, {A: g(1)})                     # opens the round as a message
    w0, r = write(srv, 0)
    assert only(r).header["modes"] == ["add"]          # worker 0 adds (part of) g(0), then leaves
    p2, r = srv.push(2, {A: g(2)})                     # while it writes: deferred
    replies = by_id(srv.state.set_members(1, [1, 2]))
    assert set(replies) == {p1, p2}
    for rid, w in ((p1, 1), (p2, 2)):
        expect_error(replies[rid], peer(w), rid, "RemoteError",
                     "worker 0 left the job while writing into round 1 of key 'w' (chunk 0): that round's "
                     "sum is incomplete, so it was dropped")
    np.testing.assert_array_equal(srv.value(A, src=1), vec(0, 0))
    p1, _ = srv.push(1, {A: g(1, 1)})                  # the next round counts worker 0 with nothing
    p2, r = srv.push(2, {A: g(2, 1)})
    ok_ids(r, {p1: 1, p2: 2})
    np.testing.assert_array_equal(srv.value(A, src=1), total([1, 2], step=1))


# -- dist_ssp ----------------------------------------------------------------------------------

def ssp_push(srv, w, op=ops.PUSH):
    return srv.push(w, {A: vec(1, 1)}, op=op)


def test_ssp_a_leaver_holds_no_read_back_and_a_joiner_starts_at_the_slowest_clock():
    srv = elastic(num_workers=3, mode="ssp", opt=sgd(), members=[0, 1, 2])
    for w in (0, 0, 1):
        ssp_push(srv, w)
    q0, r = srv.pull(0, [A])                           # needs clock 1: worker 2 is at 0
    assert r == []
    ok_ids(srv.state.set_members(1, [0, 1]), {q0: 0})  # 2 left: it holds nothing back
    for w in (1, 0, 1):
        ssp_push(srv, w)                               # clocks 3, 3 (worker 2's 0 does not count)
    assert srv.state.set_members(2, [0, 1, 2]) == []
    q2, r = srv.pull(2, [A])
    expect_ok(only(r), peer(2), q2)                    # a joiner that has not pushed reads at once
    q0, r = srv.push(0, {A: vec(1, 1)}, op=ops.PUSHPULL)   # clock 4, needs 3: the joiner does not count
    expect_ok(only(r), peer(0), q0)
    p2, r = ssp_push(srv, 2)
    expect_ok(only(r), peer(2), p2)
    assert srv.state.consistency.clock(A) == [4, 3, 4]         # it started at min(4, 3) = 3
    q2, r = srv.pull(2, [A])                           # needs 3: everyone is there
    expect_ok(only(r), peer(2), q2)
    for _ in range(2):
        ssp_push(srv, 2)
    q2, r = srv.pull(2, [A])                           # clock 6 needs 5: it waits for 0 and 1
    assert r == []
    assert srv.state.stalled(0.0, 10.0) == [] and "for worker(s) 0, 1 to push" in srv.state.stalled(20.0, 10.0)[0]


def test_ssp_a_leavers_parked_read_fails():
    srv = elastic(num_workers=2, mode="ssp", opt=sgd())
    ssp_push(srv, 1)
    q1, r = ssp_push(srv, 1, op=ops.PUSHPULL)          # clock 2 needs 1: worker 0 is at 0
    assert r == []
    replies = srv.state.set_members(1, [0])
    expect_error(only(replies), peer(1), q1, "RemoteError", "worker 1 left the job")


def test_async_checks_membership_only():
    srv = elastic(num_workers=2, mode="async", opt=sgd(), members=[0])
    p0, r = srv.push(0, {A: g(0)})
    expect_ok(only(r), peer(0), p0)
    rid, r = srv.push(1, {A: g(1)})
    expect_error(only(r), peer(1), rid, "InvalidArgumentError", "worker 1 is not a member")
    np.testing.assert_array_equal(srv.value(A), -g(0))
