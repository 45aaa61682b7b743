"""set_optimizer with keep_state (kv.set_learning_rate) on the server state machine:
new hyper-parameters, the same optimizer state; bad requests change nothing."""

import numpy as np

from kvstore import optimizer
from kvstore.protocol import ops
from state_driver import A, Server, expect_error, expect_ok, only, peer, vec


def test_keep_state_swaps_the_learning_rate_and_keeps_scaled_momentum():
    s = Server(num_workers=1, opt=optimizer.SGD(learning_rate=1.0, momentum=0.5), init={A: vec(0, 0)})
    s.push(0, {A: vec(1, 1)})                                    # mom = -1, w = -1
    rid, r = s.send(0, ops.SET_OPTIMIZER, optimizer=optimizer.SGD(learning_rate=0.1, momentum=0.5)
                    .to_config(), keep_state=True, state_scale=0.1)
    expect_ok(only(r), peer(0), rid)
    s.push(0, {A: vec(1, 1)})                                    # mom = 0.5 * -0.1 - 0.1 = -0.15
    np.testing.assert_allclose(s.value(A), vec(-1.15, -1.15), rtol=1e-6)


def test_keep_state_refuses_another_kind_of_optimizer_and_bad_fields():
    s = Server(num_workers=1, opt=optimizer.SGD(learning_rate=1.0, momentum=0.5), init={A: vec(0, 0)})
    s.push(0, {A: vec(1, 1)})
    adam = optimizer.Adam().to_config()
    rid, r = s.send(0, ops.SET_OPTIMIZER, optimizer=adam, keep_state=True)
    expect_error(only(r), peer(0), rid, "InvalidArgumentError", "only hyper-parameters may change")
    rid, r = s.send(0, ops.SET_OPTIMIZER, optimizer=adam, keep_state="yes")
    expect_error(only(r), peer(0), rid, "ProtocolError", "'keep_state' must be true or false")
    rid, r = s.send(0, ops.SET_OPTIMIZER, optimizer=adam, keep_state=True, state_scale=-1)
    expect_error(only(r), peer(0), rid, "ProtocolError", "'state_scale' must be a positive number")
    s.push(0, {A: vec(1, 1)})                                    # still SGD momentum, lr 1: mom -1.5
    np.testing.assert_allclose(s.value(A), vec(-2.5, -2.5), rtol=1e-6)
    fresh = Server(num_workers=1, init={A: vec(0, 0)})
    rid, r = fresh.send(0, ops.SET_OPTIMIZER, optimizer=adam, keep_state=True)
    expect_error(only(r), peer(0), rid, "InvalidArgumentError", "no optimizer is set")
