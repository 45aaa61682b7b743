"""A whole-model step on one server's state machine (kvstore.server.sync): a torch
twin with ``clip_grad_norm`` and ``grad_scale`` (GradScaler and ``clip_grad_norm_``
with the servers updating) runs on the layer-wise rounds. Phase 1 answers every
push with each chunk's ``[norm of the unscaled average, overflowed]``; the leader's
``apply_norms`` with ``[clip_coef, 1.0]`` (an overflow anywhere in the model) leaves
every chunk, and its state and count, as they were, and the next round steps from
there (Adam's first step: its count stayed 0); ``[clip_coef, 0.0]`` clips and steps."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import optimizer
from kvstore.protocol import ops
from state_driver import A, B, Server, by_id, expect_ok, peer, vec

pytestmark = pytest.mark.usefixtures("server_backend")

SCALE = 4.0
TWIN = optimizer.create("torch_adam", lr=0.5, rescale_grad=0.5, clip_grad_norm=1.0, grad_scale=SCALE)
W0 = {A: vec(1, 2, 3), B: vec(4, 5)}


def round_of(srv, grads):
    """Both workers' norms pushes of A and B; worker 0's reply (the chunks' terms)."""
    ids = []
    for src, g in enumerate(grads):
        rid, r = srv.send(src, ops.PUSH, list(g), [np.asarray(v) for v in g.values()], norms=True)
        ids.append(rid)
    replies = by_id(r)
    return expect_ok(replies[ids[0]], peer(0), ids[0], nvalues=2)


def test_an_overflowed_round_is_skipped_and_the_next_steps_from_the_same_weights():
    srv = Server(num_workers=2, opt=TWIN, init=W0)
    inf = {A: vec(1, float("inf"), 1), B: vec(0, 0)}
    reply = round_of(srv, [inf, {A: vec(1, 1, 1), B: vec(2, 2)}])
    assert [t[1] for t in reply.arrays] == [1.0, 0.0]             # A overflowed, B not
    aid, r = srv.send(0, ops.APPLY_NORMS, [A, B], sums=[[1.0, 1.0]] * 2, rounds=reply.header["rounds"],
                      values=True)
    applied = expect_ok(by_id(r)[aid], peer(0), aid, nvalues=2)
    for cid, got in zip([A, B], applied.arrays):
        np.testing.assert_array_equal(got, W0[cid])               # skipped: nothing moved
    # the next round: terms of the unscaled average, then the clipped Adam step, its first (bias
    # corrections of step 1: lr * g / (|g| + eps) per element; a count moved by the skip would give 0.74 lr)
    g = [{A: vec(8, 0, 0), B: vec(0, 8)}, {A: vec(8, 0, 0), B: vec(0, 0)}]
    reply = round_of(srv, g)
    avg = {cid: (g[0][cid] + g[1][cid]) / 2 / SCALE for cid in (A, B)}        # A: (2,0,0), B: (0,1)
    assert [t.tolist() for t in reply.arrays] == [[2.0, 0.0], [1.0, 0.0]]
    coef = 1.0 / (np.sqrt(5.0) + 1e-6)
    aid, r = srv.send(0, ops.APPLY_NORMS, [A, B], sums=[[float(np.float32(coef)), 0.0]] * 2,
                      rounds=reply.header["rounds"], values=True)
    applied = expect_ok(by_id(r)[aid], peer(0), aid, nvalues=2)
    for cid, got in zip([A, B], applied.arrays):
        np.testing.assert_allclose(got, W0[cid] - 0.5 * np.sign(avg[cid]), rtol=1e-6)
