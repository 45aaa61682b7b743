"""Tests of kvstore.server.state.ServerState: invalid requests are answered with
an error and change nothing.

Unknown chunks, mismatched gradients, unknown ops, malformed headers, requests
before ``configure``, reconfiguration, bad configurations and optimizer configs,
``src`` outside the workers, missing ids, booleans where integers belong. Each test
checks the error reply (to whom, which id, which kind, what the message names) and
that the state keeps working as before. Same conventions as test_server_state.py
(no sockets, threads or clocks; the ``Server`` driver is in state_driver.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.protocol import ops
from kvstore.server.state import ServerState
from state_driver import A, B, Server, by_id, expect_error, expect_ok, only, peer, sgd, vec


# -- invalid requests change nothing -------------------------------------------------------------

def test_init_of_existing_chunk_is_an_error_and_changes_nothing():
    srv = Server(num_workers=1, init={A: vec(1, 2)})
    rid, r = srv.send(0, ops.INIT, [A], [vec(9, 9)])
    expect_error(only(r), peer(0), rid, "InvalidArgumentError", "'w'", "already initialised")
    np.testing.assert_array_equal(srv.value(A), vec(1, 2))
    # B is new, A exists: B must not be created either
    rid, r = srv.send(0, ops.INIT, [B, A], [vec(3), vec(9, 9)])
    expect_error(only(r), peer(0), rid, "InvalidArgumentError", "already initialised")
    rid, r = srv.pull(0, [B])
    expect_error(only(r), peer(0), rid, "InvalidArgumentError", "not initialised")
    srv.init({B: vec(4)})  # and can still be initialised properly
    np.testing.assert_array_equal(srv.value(B), vec(4))


@pytest.mark.parametrize("op", [ops.PUSH, ops.PULL, ops.PUSHPULL])
@pytest.mark.parametrize("cid,label", [(("nope", 3), "'nope' (chunk 3)"), ((12345, 0), "12345 (chunk 0)")])
def test_unknown_chunk_is_an_error_naming_the_key(op, cid, label):
    srv = Server(num_workers=2, init={A: vec(1)})
    arrays = [] if op == ops.PULL else [vec(1), vec(1)]
    rid, r = srv.send(0, op, [A, cid], arrays)
    expect_error(only(r), peer(0), rid, "InvalidArgumentError", label, "init")
    # A is untouched and worker 0 has nothing pending on it
    np.testing.assert_array_equal(srv.value(A, src=0), vec(1))


BAD_GRADS = {
    "dtype": vec(1, 2, dtype=np.float64),
    "size": vec(1, 2, 3),
    "empty": vec(),
    "int": np.array([1, 2], np.int32),
}


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("bad", list(BAD_GRADS))
@pytest.mark.parametrize("op", [ops.PUSH, ops.PUSHPULL])
def test_mismatched_gradient_is_an_error_and_changes_nothing(mode, bad, op):
    srv = Server(mode=mode, num_workers=2, opt=sgd(), init={A: vec(1, 1, 1), B: vec(5, 5)})
    # only the last chunk is bad: the first must not be touched either
    rid, r = srv.send(0, op, [A, B], [vec(1, 1, 1), BAD_GRADS[bad]])
    expect_error(only(r), peer(0), rid, "InvalidArgumentError", "'w' (chunk 1)", "stored is 2 x float32")
    np.testing.assert_array_equal(srv.value(A, src=0), vec(1, 1, 1))  # answered at once: no push pending
    np.testing.assert_array_equal(srv.value(B, src=0), vec(5, 5))
    if mode == "sync":
        # a full round afterwards counts only the valid pushes
        srv.push(0, {A: vec(1, 2, 3)})
        _, r = srv.push(1, {A: vec(1, 1, 1)})
        assert len(r) == 2
        np.testing.assert_array_equal(srv.value(A), vec(-1, -2, -3))


def test_unknown_op():
    srv = Server(num_workers=1)
    r = srv.raw(0, {"op": "frobnicate", "id": 5, "src": 0})
    expect_error(only(r), peer(0), 5, "ProtocolError", "unknown op", "'frobnicate'")
    r = srv.raw(0, {"op": "ok", "id": 6, "src": 0})  # a reply op is not a request
    expect_error(only(r), peer(0), 6, "ProtocolError", "unknown op")


def _ok_push(**over):
    h = {"op": "push", "id": 99, "src": 0, "chunks": [["w", 0]]}
    h.update(over)
    return h


MALFORMED = {
    "chunks-str": (_ok_push(chunks="w"), 1),
    "chunks-map": (_ok_push(chunks={"w": 0}), 1),
    "chunks-int": (_ok_push(chunks=3), 1),
    "chunks-missing": ({"op": "push", "id": 99, "src": 0}, 1),
    "id-short": (_ok_push(chunks=[["w"]]), 1),
    "id-long": (_ok_push(chunks=[["w", 0, 0]]), 1),
    "id-str-index": (_ok_push(chunks=[["w", "0"]]), 1),
    "id-float-key": (_ok_push(chunks=[[1.5, 0]]), 1),
    "id-bool-key": (_ok_push(chunks=[[True, 0]]), 1),
    "id-list-key": (_ok_push(chunks=[[["w"], 0]]), 1),
    "id-nil-key": (_ok_push(chunks=[[None, 0]]), 1),
    "id-not-list": (_ok_push(chunks=["w"]), 1),
    "id-float-index": (_ok_push(chunks=[["w", 0.0]]), 1),
    "src-missing": ({"op": "push", "id": 99, "chunks": [["w", 0]]}, 1),
    "src-str": (_ok_push(src="0"), 1),
    "src-bool": (_ok_push(src=False), 1),
    "src-nil": (_ok_push(src=None), 1),
    "duplicate-chunk": (_ok_push(chunks=[["w", 0], ["w", 0]]), 2),
    "more-buffers": (_ok_push(), 2),
    "fewer-buffers": (_ok_push(chunks=[["w", 0], ["w", 1]]), 1),
    "pull-with-buffer": (_ok_push(op="pull"), 1),
    "pushpull-src-missing": ({"op": "pushpull", "id": 99, "chunks": [["w", 0]]}, 1),
    "pull-chunks-str": (_ok_push(op="pull", chunks="w"), 0),
    "pull-duplicate": (_ok_push(op="pull", chunks=[["w", 0], ["w", 0]]), 0),
    "init-chunks-map": (_ok_push(op="init", chunks={"w": 0}), 1),
    "init-bad-id": (_ok_push(op="init", chunks=[["x", 0, 1]]), 1),
    "init-duplicate": (_ok_push(op="init", chunks=[["x", 0], ["x", 0]]), 2),
    "init-buffer-count": (_ok_push(op="init", chunks=[["x", 0]]), 2),
    "op-missing": ({"id": 99, "src": 0, "chunks": [["w", 0]]}, 1),
    "configure-mode-missing": ({"op": "configure", "id": 99, "src": 0, "num_workers": 2}, 0),
    "set-optimizer-missing": ({"op": "set_optimizer", "id": 99, "src": 0}, 0),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_request_gets_protocol_error_and_state_keeps_working(name):
    header, nbufs = MALFORMED[name]
    srv = Server(num_workers=2, init={A: vec(1, 1), B: vec(2, 2)})
    r = srv.raw(0, dict(header), [vec(7, 7)] * nbufs)
    expect_error(only(r), peer(0), 99, "ProtocolError")
    assert srv.state.mode.name == "sync" and srv.state.num_workers == 2
    assert set(srv.state.chunks) == {A, B}
    # nothing was contributed: worker 0 reads at once, and a full round sums two pushes
    np.testing.assert_array_equal(srv.value(A, src=0), vec(1, 1))
    srv.push(0, {A: vec(1, 2)})
    _, r = srv.push(1, {A: vec(3, 4)})
    assert len(r) == 2
    np.testing.assert_array_equal(srv.value(A), vec(4, 6))


@pytest.mark.parametrize("op", [ops.INIT, ops.PUSH, ops.PULL, ops.PUSHPULL, ops.SET_OPTIMIZER,
                                ops.GET_STATES, ops.SET_STATES])
def test_request_before_configure_is_an_error(op):
    s = ServerState(name="server 3")
    r = s.handle(b"w0", {"op": op, "id": 8, "src": 0, "chunks": [["w", 0]]}, [vec(1)])
    expect_error(only(r), b"w0", 8, "InvalidArgumentError", "not configured")
    assert s.chunks == {} and s.updater is None
    r = s.handle(b"w0", {"op": "configure", "id": 9, "src": 0, "mode": "sync", "num_workers": 1}, [])
    expect_ok(only(r), b"w0", 9)


def test_reconfigure():
    srv = Server(mode="sync", num_workers=2, init={A: vec(1)})
    # the same configuration again (a second store connecting) is fine
    rid, r = srv.send(1, ops.CONFIGURE, mode="sync", num_workers=2)
    expect_ok(only(r), peer(1), rid)
    for mode, n in [("async", 2), ("sync", 3), ("async", 1)]:
        rid, r = srv.send(1, ops.CONFIGURE, mode=mode, num_workers=n)
        expect_error(only(r), peer(1), rid, "InvalidArgumentError", "already runs in sync mode",
                     f"{mode}/{n}")
    assert (srv.state.mode.name, srv.state.num_workers) == ("sync", 2)
    np.testing.assert_array_equal(srv.value(A), vec(1))


@pytest.mark.parametrize("mode,n", [("bsp", 2), (None, 2), ("sync", 0), ("sync", -1), ("async", "2"),
                                    ("sync", 1.0), ("sync", None)])
def test_bad_configuration(mode, n):
    s = ServerState()
    r = s.handle(b"w0", {"op": "configure", "id": 3, "src": 0, "mode": mode, "num_workers": n}, [])
    expect_error(only(r), b"w0", 3, "InvalidArgumentError", "bad configuration")
    assert s.mode is None


def test_set_optimizer_with_bad_config():
    srv = Server(mode="async", num_workers=1, init={A: vec(1)})
    for cfg in [{"name": "nosuch"}, "sgd", {"name": "sgd", "params": {"learning_rate": -1}},
                {"name": "sgd", "params": {"bogus": 1}}]:
        rid, r = srv.send(0, ops.SET_OPTIMIZER, optimizer=cfg)
        expect_error(only(r), peer(0), rid, "ConfigError", "set_optimizer")
    assert srv.state.updater is None
    rid, r = srv.push(0, {A: vec(1)})
    expect_error(only(r), peer(0), rid, "InvalidArgumentError", "set_optimizer")


# -- regressions (bugs found by these tests, fixed while they were written) --------------------

@pytest.mark.parametrize("src", [2, -1, 1 << 40])
def test_src_outside_the_workers_is_rejected(src):
    # a src outside [0, num_workers) used to count as a worker and complete the round
    srv = Server(num_workers=2, init={A: vec(0)})
    id0, r = srv.push(0, {A: vec(1)})
    rid, r = srv.push(src, {A: vec(100)})
    expect_error(only(r), peer(src), rid, "ProtocolError", "'src'")
    np.testing.assert_array_equal(srv.value(A, src=1), vec(0))
    rid, r = srv.pull(src, [A])
    expect_error(only(r), peer(src), rid, "ProtocolError", "'src'")
    id1, r = srv.push(1, {A: vec(2)})
    assert set(by_id(r)) == {id0, id1}
    np.testing.assert_array_equal(srv.value(A), vec(3))


@pytest.mark.parametrize("op", [ops.INIT, ops.PUSH, ops.CONFIGURE])
def test_request_without_id_changes_nothing(op):
    # the id used to be read only after the change was made: the change stayed, and
    # replies made ready for other workers were lost with the exception
    if op == ops.CONFIGURE:
        s = ServerState()
        r = s.handle(b"w0", {"op": "configure", "src": 0, "mode": "async", "num_workers": 2}, [])
        assert only(r).header["op"] == ops.ERROR and only(r).header["id"] is None
        assert s.mode is None
        return
    srv = Server(num_workers=2, init={A: vec(0)})
    if op == ops.INIT:
        r = srv.raw(0, {"op": "init", "src": 0, "chunks": [["x", 0]]}, [vec(1)])
        assert only(r).header["op"] == ops.ERROR
        srv.init({("x", 0): vec(2)})
        np.testing.assert_array_equal(srv.value(("x", 0)), vec(2))
    else:
        id0, _ = srv.push(0, {A: vec(1)})
        r = srv.raw(1, {"op": "push", "src": 1, "chunks": [["w", 0]]}, [vec(100)])
        assert only(r).header["op"] == ops.ERROR and only(r).peer == peer(1)
        id1, r = srv.push(1, {A: vec(2)})
        assert set(by_id(r)) == {id0, id1}, "worker 0's push was never acknowledged"
        np.testing.assert_array_equal(srv.value(A), vec(3))


@pytest.mark.parametrize("case", ["chunk-index", "num-workers", "src", "id"])
def test_booleans_are_not_ints(case):
    # isinstance(True, int): chunk index true used to alias index 1, num_workers true meant 1
    if case == "chunk-index":
        srv = Server(num_workers=1, init={B: vec(1)})
        r = srv.raw(0, {"op": "pull", "id": 5, "src": 0, "chunks": [["w", True]]})
        expect_error(only(r), peer(0), 5, "ProtocolError")
    elif case == "num-workers":
        s = ServerState()
        r = s.handle(b"w0", {"op": "configure", "id": 3, "src": 0, "mode": "sync", "num_workers": True}, [])
        assert only(r).header["op"] == ops.ERROR
        assert s.mode is None
    elif case == "src":
        srv = Server(num_workers=2, init={A: vec(0)})
        r = srv.raw(1, {"op": "push", "id": 5, "src": True, "chunks": [["w", 0]]}, [vec(1)])
        expect_error(only(r), peer(1), 5, "ProtocolError", "'src'")
    else:
        srv = Server(num_workers=1, init={A: vec(0)})
        r = srv.raw(0, {"op": "push", "id": True, "src": 0, "chunks": [["w", 0]]}, [vec(1)])
        assert only(r).header["op"] == ops.ERROR
        np.testing.assert_array_equal(srv.value(A), vec(0))
