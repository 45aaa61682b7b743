"""Tests of kvstore.server.state.ServerState, the server's pure state machine:
what valid requests do.

Requests go in as (peer, header, arrays) exactly as the I/O loop hands them over
after decode(); the replies that come out are compared: who gets them, which
request id they answer, and which values they carry. No sockets, threads or
clocks. Peers are the bytes identities a ZeroMQ ROUTER would see (b"w0", ...).

Here: sync rounds, async mode, optimizer states, and how optimizer failures are
answered. Invalid and malformed requests are in test_server_state_errors.py; the
``Server`` driver and the reply checks are in state_driver.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import optimizer
from kvstore.protocol import ops
from kvstore.server.state import Reply, ServerState
from state_driver import A, B, C, F32, Server, by_id, expect_error, expect_ok, only, peer, sgd, vec

# every test also runs the GPU server's code path on the device layer's host device
pytestmark = pytest.mark.usefixtures("server_backend")


# -- sync mode ------------------------------------------------------------------------------

def test_configure_is_acknowledged_with_its_id():
    s = ServerState()
    r = s.handle(b"x", {"op": "configure", "id": 41, "src": 0, "mode": "sync", "num_workers": 2}, [])
    assert only(r) == Reply(b"x", {"op": "ok", "id": 41}, [])


@pytest.mark.parametrize("opt", [None, sgd()], ids=["assign", "sgd"])
def test_sync_round_acknowledged_only_when_all_workers_pushed(opt):
    w0 = vec(10, 20, 30)
    srv = Server(num_workers=3, opt=opt, init={A: w0})
    g = [vec(1, 2, 3), vec(4, 5, 6), vec(0.5, -1, 2)]
    id0, r0 = srv.push(0, {A: g[0]})
    id1, r1 = srv.push(1, {A: g[1]})
    assert r0 == [] and r1 == []
    # not applied yet: a pull from worker 2 (nothing pending) still sees the initial value
    np.testing.assert_array_equal(srv.value(A, src=2), w0)
    id2, r2 = srv.push(2, {A: g[2]})
    replies = by_id(r2)
    assert set(replies) == {id0, id1, id2}
    for rid, src in [(id0, 0), (id1, 1), (id2, 2)]:
        expect_ok(replies[rid], peer(src), rid, nvalues=0)
    total = g[0] + g[1] + g[2]
    expected = total if opt is None else w0 - total
    for src in range(3):
        np.testing.assert_array_equal(srv.value(A, src=src), expected)


def test_sync_optimizer_runs_once_per_round():
    srv = Server(num_workers=3, opt=sgd(learning_rate=0.5), init={A: vec(0, 0)})
    for src in range(3):
        srv.push(src, {A: vec(1, 2)})
    np.testing.assert_array_equal(srv.value(A), vec(-1.5, -3))
    _, r = srv.send(0, ops.GET_STATES)
    assert only(r).header["states"] == [["w", 0, 1, 0]]  # t == 1: one update, not three


def test_sync_assignment_does_not_alias_the_pushed_buffer():
    srv = Server(num_workers=1, init={A: vec(0, 0)})
    g = vec(3, 4)
    srv.push(0, {A: g})
    g[:] = 99  # the caller's (decoded) buffer may be reused after the reply
    np.testing.assert_array_equal(srv.value(A), vec(3, 4))
    srv.push(0, {A: vec(5, 6)})
    np.testing.assert_array_equal(srv.value(A), vec(5, 6))
    np.testing.assert_array_equal(g, vec(99, 99))  # and the server never writes into it


def test_pull_with_own_push_pending_is_parked_until_the_round():
    srv = Server(num_workers=2, init={A: vec(1, 1)})
    push0, r = srv.push(0, {A: vec(2, 3)})
    assert r == []
    pull0, r = srv.pull(0, [A])
    assert r == [], "worker 0 must not read the value before its own push's round"
    # worker 1 has nothing pending: answered at once with the current value
    pull1, r = srv.pull(1, [A])
    rep = expect_ok(only(r), peer(1), pull1, nvalues=1)
    np.testing.assert_array_equal(rep.arrays[0], vec(1, 1))
    push1, r = srv.push(1, {A: vec(10, 20)})
    replies = by_id(r)
    assert set(replies) == {push0, pull0, push1}
    expect_ok(replies[push0], peer(0), push0, nvalues=0)
    expect_ok(replies[push1], peer(1), push1, nvalues=0)
    rep = expect_ok(replies[pull0], peer(0), pull0, nvalues=1)
    np.testing.assert_array_equal(rep.arrays[0], vec(12, 23))
    np.testing.assert_array_equal(rep.arrays[0], srv.state.chunks[A].value)


def test_pull_waits_for_every_chunk_it_names():
    srv = Server(num_workers=2, init={A: vec(0), B: vec(0, 0), C: vec(5, dtype=np.int64)})
    push0, _ = srv.push(0, {A: vec(1), B: vec(1, 1)})
    pull0, r = srv.pull(0, [A, B, C])
    assert r == []
    push1a, r = srv.push(1, {A: vec(2)})
    # A's round is done, but worker 0's push and pull also wait for B
    expect_ok(only(r), peer(1), push1a)
    push1b, r = srv.push(1, {B: vec(3, 4)})
    replies = by_id(r)
    assert set(replies) == {push0, pull0, push1b}
    rep = expect_ok(replies[pull0], peer(0), pull0, nvalues=3)
    np.testing.assert_array_equal(rep.arrays[0], vec(3))
    np.testing.assert_array_equal(rep.arrays[1], vec(4, 5))
    np.testing.assert_array_equal(rep.arrays[2], np.array([5], np.int64))
    assert rep.arrays[2].dtype == np.int64


@pytest.mark.parametrize("opt", [None, sgd()], ids=["assign", "sgd"])
def test_push_twice_before_round_completes_queues_into_next_round(opt):
    w0 = vec(100, 100)
    srv = Server(num_workers=2, opt=opt, init={A: w0})
    a1, a2 = vec(1, 2), vec(3, 4)
    b1, b2 = vec(10, 20), vec(30, 40)
    p01, r = srv.push(0, {A: a1})
    assert r == []
    p02, r = srv.push(0, {A: a2})
    assert r == [], "a second push from the same worker must not complete the round"
    p11, r = srv.push(1, {A: b1})
    replies = by_id(r)
    # each push is acknowledged when its own round is applied
    assert p11 in replies and p01 in replies and p02 not in replies
    expect_ok(replies[p11], peer(1), p11)
    first_acks = set(replies)
    round1 = a1 + b1 if opt is None else w0 - (a1 + b1)
    # worker 1 has nothing pending now: it reads the result of round 1
    np.testing.assert_array_equal(srv.value(A, src=1), round1)
    # worker 0 still has a push in round 2: its pull waits
    pull0, r = srv.pull(0, [A])
    assert r == []
    p12, r = srv.push(1, {A: b2})
    replies = by_id(r)
    acked = set(by_id(r)) | first_acks
    assert acked >= {p01, p02, p11, p12, pull0}
    round2 = a2 + b2 if opt is None else round1 - (a2 + b2)
    np.testing.assert_array_equal(replies[pull0].arrays[0], round2)
    assert replies[pull0].peer == peer(0)


@pytest.mark.parametrize("opt", [None, sgd()], ids=["assign", "sgd"])
def test_pushpull_returns_the_values_after_the_round(opt):
    w = {A: vec(1, 1), B: vec(2, 2, 2)}
    srv = Server(num_workers=2, opt=opt, init=w)
    g0 = {A: vec(1, 2), B: vec(3, 4, 5)}
    g1 = {A: vec(10, 20), B: vec(30, 40, 50)}
    id0, r = srv.push(0, g0, op=ops.PUSHPULL)
    assert r == []
    id1, r = srv.push(1, g1, op=ops.PUSHPULL)
    replies = by_id(r)
    assert set(replies) == {id0, id1}
    for rid, src in [(id0, 0), (id1, 1)]:
        rep = expect_ok(replies[rid], peer(src), rid, nvalues=2)
        for cid, got in zip([A, B], rep.arrays):  # in the order of the request
            total = g0[cid] + g1[cid]
            np.testing.assert_array_equal(got, total if opt is None else w[cid] - total)


def test_pull_returns_stored_values_flattened_in_request_order():
    m = np.arange(6, dtype=np.float64).reshape(2, 3)
    srv = Server(num_workers=2, init={A: m, C: vec(1, 2, 3, dtype=np.int32)})
    rid, r = srv.pull(1, [C, A])
    rep = expect_ok(only(r), peer(1), rid, nvalues=2)
    np.testing.assert_array_equal(rep.arrays[0], np.array([1, 2, 3], np.int32))
    np.testing.assert_array_equal(rep.arrays[1], m.reshape(-1))
    assert rep.arrays[0].dtype == np.int32 and rep.arrays[1].dtype == np.float64
    for got, cid in zip(rep.arrays, [C, A]):
        np.testing.assert_array_equal(got, srv.state.chunks[cid].value)


def test_init_copies_the_value():
    v = vec(1, 2, 3)
    srv = Server(num_workers=1, init={A: v})
    v[:] = 0
    np.testing.assert_array_equal(srv.value(A), vec(1, 2, 3))


def test_replies_go_to_the_peer_that_asked():
    srv = Server(num_workers=2, init={A: vec(0)})
    id0, _ = srv.send(0, ops.PUSH, [A], [vec(1)], who=b"client-a")
    id1, r = srv.send(1, ops.PUSH, [A], [vec(2)], who=b"client-b")
    replies = by_id(r)
    assert replies[id0].peer == b"client-a" and replies[id1].peer == b"client-b"


# -- async mode ------------------------------------------------------------------------------

def test_async_push_without_optimizer_is_an_error():
    srv = Server(mode="async", num_workers=2, init={A: vec(1, 2)})
    rid, r = srv.push(0, {A: vec(5, 5)})
    expect_error(only(r), peer(0), rid, "InvalidArgumentError", "set_optimizer")
    rid, r = srv.push(1, {A: vec(5, 5)}, op=ops.PUSHPULL)
    expect_error(only(r), peer(1), rid, "InvalidArgumentError", "set_optimizer")
    np.testing.assert_array_equal(srv.value(A), vec(1, 2))


def test_async_applies_every_push_at_once():
    srv = Server(mode="async", num_workers=3, opt=sgd(), init={A: vec(10, 10)})
    rid, r = srv.push(0, {A: vec(1, 2)})
    expect_ok(only(r), peer(0), rid, nvalues=0)
    np.testing.assert_array_equal(srv.value(A, src=1), vec(9, 8))
    rid, r = srv.push(2, {A: vec(1, 1)}, op=ops.PUSHPULL)
    rep = expect_ok(only(r), peer(2), rid, nvalues=1)
    np.testing.assert_array_equal(rep.arrays[0], vec(8, 7))
    snapshot = rep.arrays[0].copy()
    srv.push(1, {A: vec(1, 1)})
    # replies in async mode carry copies: later pushes do not change what was sent
    np.testing.assert_array_equal(rep.arrays[0], snapshot)
    np.testing.assert_array_equal(srv.value(A, src=0), vec(7, 6))


# -- optimizer states ------------------------------------------------------------------------------

def test_get_and_set_states_round_trip_with_momentum():
    mom = optimizer.SGD(learning_rate=0.1, momentum=0.9)
    w = {A: vec(1, 2, 3, 4), B: vec(-1, 0.5), C: vec(8, 8, 8)}
    rng = np.random.default_rng(0)
    grads = [{cid: rng.standard_normal(v.size).astype(F32) for cid, v in w.items()} for _ in range(4)]

    one = Server(num_workers=1, opt=mom, init=w)
    for g in grads[:2]:
        one.push(0, g)
    rid, r = one.send(0, ops.GET_STATES)
    rep = expect_ok(only(r), peer(0), rid)
    meta = rep.header["states"]
    assert sorted(meta, key=repr) == sorted([["w", 0, 2, 1], ["w", 1, 2, 1], [7, 0, 2, 1]], key=repr)
    saved = [a.copy() for a in rep.arrays]
    assert len(saved) == 3
    # momentum after two steps from zero: m2 = 0.9 * (-0.1 g1) - 0.1 g2
    for (key, index, _, _), got in zip(meta, saved):
        cid = (key, index)
        ref = 0.9 * (-0.1 * grads[0][cid].astype(np.float64)) - 0.1 * grads[1][cid]
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)

    # a fresh server restored from the values and states continues identically
    two = Server(num_workers=1, opt=mom, init={cid: one.value(cid) for cid in w})
    rid, r = two.send(0, ops.SET_STATES, states=meta, arrays=saved)
    expect_ok(only(r), peer(0), rid)
    rid, r = two.send(0, ops.GET_STATES)
    again = only(r)
    assert again.header["states"] == meta
    for x, y in zip(again.arrays, saved):
        np.testing.assert_array_equal(x, y)
    for g in grads[2:]:
        one.push(0, g)
        two.push(0, g)
    for cid in w:
        np.testing.assert_array_equal(two.value(cid), one.value(cid))
    # whereas a server without the states diverges (the check above can fail)
    three = Server(num_workers=1, opt=mom, init={cid: two.value(cid) for cid in w})
    three.push(0, grads[3])
    two.push(0, grads[3])
    assert not np.array_equal(three.value(A), two.value(A))


def test_states_need_an_optimizer():
    srv = Server(num_workers=1, init={A: vec(1)})
    rid, r = srv.send(0, ops.GET_STATES)
    expect_error(only(r), peer(0), rid, "InvalidArgumentError", "no optimizer")
    rid, r = srv.send(0, ops.SET_STATES, states=[["w", 0, 1, 1]], arrays=[vec(1)])
    expect_error(only(r), peer(0), rid, "InvalidArgumentError", "set_optimizer")


def test_set_states_for_unknown_chunk_changes_nothing():
    srv = Server(num_workers=1, opt=optimizer.SGD(learning_rate=0.1, momentum=0.5), init={A: vec(1, 1)})
    srv.push(0, {A: vec(1, 1)})
    _, r = srv.send(0, ops.GET_STATES)
    before = [a.copy() for a in only(r).arrays]
    rid, r = srv.send(0, ops.SET_STATES, states=[["w", 0, 9, 1], ["nope", 0, 1, 1]],
                      arrays=[vec(5, 5), vec(5)])
    expect_error(only(r), peer(0), rid, "InvalidArgumentError", "'nope'")
    _, r = srv.send(0, ops.GET_STATES)
    after = only(r)
    assert after.header["states"] == [["w", 0, 1, 1]]
    np.testing.assert_array_equal(after.arrays[0], before[0])


@pytest.mark.parametrize("states,nbufs", [([["w", 0, 1, 2]], 1), ([["w", 0, 1, 1]], 2), ("x", 1),
                                          ([["w", 0]], 1), ([["w", 0, "1", 1]], 1), ([["w", 0, -1, 1]], 1)])
def test_set_states_malformed(states, nbufs):
    srv = Server(num_workers=1, opt=optimizer.SGD(learning_rate=0.1, momentum=0.5), init={A: vec(1, 1)})
    rid, r = srv.send(0, ops.SET_STATES, states=states, arrays=[vec(1, 1)] * nbufs)
    assert only(r).header["op"] == ops.ERROR and only(r).header["id"] == rid
    _, r = srv.push(0, {A: vec(1, 1)})
    assert only(r).header["op"] == ops.OK
    np.testing.assert_allclose(srv.value(A), vec(0.9, 0.9))


# -- regressions (bugs found by these tests, fixed while they were written) --------------------

@pytest.mark.parametrize("mode", ["sync", "async"])
def test_push_to_integer_chunk_with_optimizer_leaves_no_worker_hanging(mode):
    # the optimizer used to fail only when the round was applied: the round was dropped
    # and the workers who had pushed before got no reply at all
    srv = Server(mode=mode, num_workers=2, opt=sgd(), init={C: np.array([1, 2], np.int32)})
    id0, r0 = srv.push(0, {C: np.array([1, 1], np.int32)})
    id1, r1 = srv.push(1, {C: np.array([1, 1], np.int32)})
    replies = by_id(r0 + r1)
    assert set(replies) == {id0, id1}, "a push got no reply at all"
    assert all(r.header["op"] == ops.ERROR and "key 7" in r.header["message"] for r in replies.values())
    np.testing.assert_array_equal(srv.value(C), np.array([1, 2], np.int32))


def test_async_push_rejected_by_optimizer_changes_nothing():
    # async used to apply chunk by chunk and fail on the int chunk after updating A
    srv = Server(mode="async", num_workers=1, opt=sgd(),
                 init={A: vec(1, 1), C: np.array([1, 2], np.int32)})
    rid, r = srv.send(0, ops.PUSH, [A, C], [vec(1, 1), np.array([1, 1], np.int32)])
    assert only(r).header["op"] == ops.ERROR
    np.testing.assert_array_equal(srv.value(A), vec(1, 1))


@pytest.mark.parametrize("bad", [vec(0, 0, 0), np.zeros(2, np.float64)], ids=["size", "dtype"])
def test_set_states_rejects_state_not_matching_the_chunk(bad):
    # used to be stored, so that the next update raised while applying a round
    srv = Server(num_workers=1, opt=optimizer.SGD(learning_rate=1.0, momentum=0.5), init={A: vec(1, 1)})
    rid, r = srv.send(0, ops.SET_STATES, states=[["w", 0, 1, 1]], arrays=[bad])
    expect_error(only(r), peer(0), rid, "InvalidArgumentError", "'w' (chunk 0)")
    rid, r = srv.push(0, {A: vec(1, 1)})
    expect_ok(only(r), peer(0), rid)
    np.testing.assert_array_equal(srv.value(A), vec(0, 0))


def test_get_states_reply_is_a_snapshot():
    # the reply used to carry the live momentum arrays, which the node sends zero-copy
    srv = Server(mode="async", num_workers=2, opt=optimizer.SGD(learning_rate=0.1, momentum=0.9),
                 init={A: vec(1, 1)})
    srv.push(0, {A: vec(1, 1)})
    _, r = srv.send(0, ops.GET_STATES)
    rep = only(r)
    snapshot = [a.copy() for a in rep.arrays]
    srv.push(1, {A: vec(5, 5)})
    for got, want in zip(rep.arrays, snapshot):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("op", [ops.PUSH, ops.PUSHPULL])
def test_optimizer_failure_fails_every_push_of_the_round(op):
    # the worker whose push completed the failing round used to get 'ok'
    srv = Server(num_workers=2, opt=sgd(), init={A: vec(1, 1)})
    working = srv.state.updater

    def broken(index, grad, weight):
        raise FloatingPointError("boom")

    id0, r0 = srv.push(0, {A: vec(1, 1)}, op=op)
    srv.state.optimizer.updater = broken
    id1, r1 = srv.push(1, {A: vec(2, 2)}, op=op)
    srv.state.optimizer.updater = working
    replies = by_id(r0 + r1)
    assert set(replies) == {id0, id1}
    np.testing.assert_array_equal(srv.value(A), vec(1, 1))
    assert [replies[i].header["op"] for i in (id0, id1)] == [ops.ERROR, ops.ERROR]
    # and the chunk works again once the optimizer does
    srv.push(0, {A: vec(1, 1)})
    _, r = srv.push(1, {A: vec(2, 2)})
    assert [x.header["op"] for x in r] == [ops.OK, ops.OK]
    np.testing.assert_array_equal(srv.value(A), vec(-2, -2))


def _broken(index, grad, weight):
    raise FloatingPointError("boom")


# Regression: an optimizer failure used to fail every request parked on the chunk, also
# those of a later round that was still queued and then applied anyway.
def test_optimizer_failure_only_fails_requests_of_the_failed_round():
    srv = Server(num_workers=2, opt=sgd(), init={A: vec(10, 10)})
    first, _ = srv.push(0, {A: vec(1, 1)})
    second, _ = srv.push(0, {A: vec(2, 2)})   # queued into round 2
    working, srv.state.optimizer.updater = srv.state.updater, _broken
    other, r = srv.push(1, {A: vec(3, 3)})     # completes round 1, which fails
    srv.state.optimizer.updater = working
    replies = by_id(r)
    assert replies[first].header["op"] == ops.ERROR and replies[other].header["op"] == ops.ERROR
    assert second not in replies, "answered before its round was applied"
    last, r = srv.push(1, {A: vec(4, 4)})      # round 2 is applied
    replies = by_id(r)
    assert set(replies) == {second, last}
    assert all(x.header["op"] == ops.OK for x in replies.values())
    np.testing.assert_array_equal(srv.value(A), vec(4, 4))


def test_a_worker_pushing_again_before_its_reply_still_gets_its_own_rounds_values():
    """_pushpull_start then a push of the same key: the worker's next round of a chunk
    may complete before its pushpull (waiting for another chunk) is answered; the
    reply still carries the values after the round it joined, and is a copy (the
    worker reads it only later)."""
    srv = Server(num_workers=2, init={A: vec(0), B: vec(0)})
    pp0, r = srv.push(0, {A: vec(1), B: vec(1)}, op=ops.PUSHPULL)
    assert r == []
    p1, r = srv.push(1, {A: vec(2)}, op=ops.PUSHPULL)          # round 1 of A done...
    assert set(by_id(r)) == {p1}
    p0, r = srv.push(0, {A: vec(10)})                           # ...worker 0 pushes A again
    assert r == []
    p1b, r = srv.push(1, {A: vec(20)})                          # round 2 of A done too
    assert set(by_id(r)) == {p0, p1b}
    p1c, r = srv.push(1, {B: vec(5)}, op=ops.PUSHPULL)          # round 1 of B: pp0 answered
    replies = by_id(r)
    assert set(replies) == {pp0, p1c}
    got = [a.copy() for a in replies[pp0].arrays]
    assert [a.tolist() for a in got] == [[3], [6]]              # A after round 1, not 30
    for src, g in ((0, 100), (1, 200)):                         # round 2 of B
        srv.push(src, {B: vec(g)})
    assert [a.tolist() for a in replies[pp0].arrays] == [[3], [6]]   # not a view on the values
    np.testing.assert_array_equal(srv.value(B), vec(300))
