"""Norms across servers on one server's state machine (kvstore.server.sync): a
layer-wise push (``norms``) is answered with its chunk's sums of squares once every
worker pushed; the round then waits at the head of its queue for the leader's
``apply_norms``, and pulls wait with it. Wrong sums, rounds or requests are refused,
naming the chunk, and change nothing; a leader that finishes fails what waits."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import optimizer
from kvstore.protocol import ops
from state_driver import A, B, Server, by_id, expect_error, expect_ok, only, peer, vec

pytestmark = pytest.mark.usefixtures("server_backend")

LARS = optimizer.LARS(learning_rate=0.5, eta=0.1)
W0 = {A: vec(1, 2, 3), B: vec(4, 5)}


def norms_push(srv, src, grads):
    return srv.send(src, ops.PUSH, list(grads), [np.asarray(g) for g in grads.values()], norms=True)


def both_pushed(srv, grads=({A: vec(1, 1, 1), B: vec(2, 2)}, {A: vec(1, 0, 1), B: vec(0, 2)})):
    """Both workers' layer-wise pushes of A and B; returns worker 0's terms reply."""
    rid0, r = norms_push(srv, 0, grads[0])
    assert r == []                                   # the round is not complete yet
    rid1, r = norms_push(srv, 1, grads[1])
    replies = by_id(r)
    assert set(replies) == {rid0, rid1}
    return expect_ok(replies[rid0], peer(0), rid0, nvalues=2)


def test_a_layerwise_round_answers_with_its_terms_and_waits_for_the_sums():
    srv = Server(num_workers=2, opt=LARS, init=W0)
    reply = both_pushed(srv)
    g = {A: vec(2, 1, 2), B: vec(2, 4)}
    assert reply.header["rounds"] == [1, 1]
    for cid, terms in zip([A, B], reply.arrays):      # |w|^2 and |sum of grads|^2 of each chunk
        assert terms.dtype == np.float64
        np.testing.assert_array_equal(terms, [float(np.dot(W0[cid], W0[cid])), float(np.dot(g[cid], g[cid]))])
    rid, r = srv.pull(1, [A])                        # its round is not applied: the pull waits
    assert r == []
    assert (srv.state.chunks[A].value == W0[A]).all()
    # the leader's sums over the key (here: A and B are its two chunks)
    sums = [float(sum(np.dot(v, v) for v in W0.values())), float(sum(np.dot(v, v) for v in g.values()))]
    aid, r = srv.send(0, ops.APPLY_NORMS, [A, B], sums=[sums, sums], rounds=[1, 1], values=True)
    replies = by_id(r)
    applied = expect_ok(replies[aid], peer(0), aid, nvalues=2)
    expect_ok(replies[rid], peer(1), rid, nvalues=1)
    # LARS with the key's norms: lr * eta * |w| / |g|, the same factor on both chunks
    w_norm, g_norm = np.sqrt(sums[0]), np.sqrt(sums[1])
    for cid, got in zip([A, B], applied.arrays):
        want = W0[cid] - np.float32(0.5 * 0.1 * w_norm / g_norm) * g[cid]
        np.testing.assert_allclose(got, want, rtol=1e-6)
        np.testing.assert_allclose(srv.state.chunks[cid].value, want, rtol=1e-6)


@pytest.mark.parametrize("fields, fragment", [
    ({"sums": [[1.0, 1.0], [1.0, 1.0]], "rounds": [2, 1]}, "names round 2 of key 'w' (chunk 0), but round 1 awaits"),
    ({"sums": [[1.0], [1.0, 1.0]], "rounds": [1, 1]}, "needs 2 finite sums >= 0"),
    ({"sums": [[1.0, float("nan")], [1.0, 1.0]], "rounds": [1, 1]}, "needs 2 finite sums >= 0"),
    ({"sums": [[1.0, -1.0], [1.0, 1.0]], "rounds": [1, 1]}, "needs 2 finite sums >= 0"),
])
def test_wrong_sums_or_rounds_are_refused_and_change_nothing(fields, fragment):
    srv = Server(num_workers=2, opt=LARS, init=W0)
    both_pushed(srv)
    aid, r = srv.send(0, ops.APPLY_NORMS, [A, B], values=False, **fields)
    expect_error(only(r), peer(0), aid, "InvalidArgumentError", fragment)
    assert (srv.state.chunks[A].value == W0[A]).all() and (srv.state.chunks[B].value == W0[B]).all()
    assert srv.state.chunks[A].rounds[0].terms is not None      # still waiting for the right sums
    aid, r = srv.send(0, ops.APPLY_NORMS, [A, B], sums=[[1.0, 1.0], [1.0, 1.0]], rounds=[1, 1])
    expect_ok(only(r), peer(0), aid)


def test_apply_norms_without_a_waiting_round_is_refused():
    srv = Server(num_workers=2, opt=LARS, init=W0)
    aid, r = srv.send(0, ops.APPLY_NORMS, [A], sums=[[1.0, 1.0]], rounds=[1])
    expect_error(only(r), peer(0), aid, "InvalidArgumentError", "no round of key 'w' (chunk 0) awaits")


@pytest.mark.parametrize("mode, opt, extra, kind, fragment", [
    ("sync", None, {}, "InvalidArgumentError", "needs an optimizer that splits its update by norms"),
    ("sync", optimizer.SGD(), {}, "InvalidArgumentError", "needs an optimizer that splits its update by norms"),
    ("async", LARS, {}, "InvalidArgumentError", "norms across servers are for dist_sync"),
    ("sync", LARS, {"op": ops.PUSHPULL}, "ProtocolError", "a layer-wise push (norms) is a plain push"),
    ("sync", LARS, {"norms": 1}, "ProtocolError", "'norms' must be true or false"),
])
def test_layerwise_pushes_that_cannot_be_served_are_refused(mode, opt, extra, kind, fragment):
    srv = Server(mode=mode, num_workers=2, opt=opt, init=W0)
    extra = dict(extra)
    op = extra.pop("op", ops.PUSH)
    fields = {"norms": True, **extra}
    rid, r = srv.send(0, op, [A], [vec(1, 1, 1)], **fields)
    expect_error(only(r), peer(0), rid, kind, fragment)
    assert srv.state.chunks[A].rounds == []


def test_workers_that_disagree_on_norms_are_refused_naming_the_round():
    srv = Server(num_workers=2, opt=LARS, init=W0)
    norms_push(srv, 0, {A: vec(1, 1, 1)})
    rid, r = srv.push(1, {A: vec(1, 1, 1)})                     # without norms
    expect_error(only(r), peer(1), rid, "InvalidArgumentError", "round 1 was opened by pushes that do",
                 "the workers disagree")


def test_the_next_round_runs_its_phase_1_once_the_first_is_applied():
    srv = Server(num_workers=2, opt=LARS, init=W0)
    both_pushed(srv)
    r0, r = norms_push(srv, 0, {A: vec(1, 1, 1), B: vec(1, 1)})   # round 2, before round 1's norms
    r1, r = norms_push(srv, 1, {A: vec(1, 1, 1), B: vec(1, 1)})
    assert r == []                                                # waits behind round 1
    aid, r = srv.send(0, ops.APPLY_NORMS, [A, B], sums=[[1.0, 1.0], [1.0, 1.0]], rounds=[1, 1])
    replies = by_id(r)
    expect_ok(replies[aid], peer(0), aid)
    assert replies[r0].header["rounds"] == [2, 2] and replies[r1].header["rounds"] == [2, 2]


def test_a_leader_that_finishes_fails_the_round_awaiting_its_norms():
    srv = Server(num_workers=2, opt=LARS, init=W0)
    both_pushed(srv)
    rid, r = srv.pull(1, [A])
    assert r == []
    r = srv.state.workers_finished([0])
    expect_error(only(r), peer(1), rid, "RemoteError", "worker 0, the leader that adds up a key's norms",
                 "round 1 of key 'w' (chunk 0) awaits them")
    assert srv.state.chunks[A].rounds == []


def test_the_stall_inspector_names_the_missing_norms():
    srv = Server(num_workers=2, opt=LARS, init=W0)
    both_pushed(srv)
    assert srv.state.stalled(0.0, 5.0) == []
    lines = srv.state.stalled(10.0, 5.0)
    assert any("waited 10s for the key's norms" in line and "worker 0 (the leader)" in line for line in lines)
