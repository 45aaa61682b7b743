"""The ``rows`` field of a dense push (kvstore.rows.lazy): a row-sparse push to a dense
key names its rows, and the server's optimizer updates only them (MXNet's
lazy_update), on the ServerState: a sync round takes the union of its pushes' rows, a
dense push or a write into the round names every value, a push held behind its
worker's write keeps its rows, async applies a push's rows on arrival, and a malformed
field is refused naming the chunk, changing nothing."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import optimizer
from kvstore.errors import ProtocolError
from kvstore.protocol import ops
from kvstore.rows import lazy
from state_driver import A, Server, by_id, expect_error, expect_ok, only, peer

LR, WD = 0.5, 0.1
W0 = np.linspace(1.0, 2.0, 8, dtype=np.float32)      # chunk A: a key of 4 rows of width 2


def sgd(**params):
    return optimizer.SGD(learning_rate=LR, wd=WD, **params)


def grad(worker: int) -> np.ndarray:
    return np.full(8, worker + 1.0, np.float32)


def rows_field(*rows, width=2, start=0, stop=8) -> list:
    return lazy.chunk_field(np.array(rows, np.int64), width, start, stop)


def lazy_push(srv, worker, rows, g=None, op=ops.PUSH):
    return srv.send(worker, op, [A], [grad(worker) if g is None else g], rows=[rows])


def stepped(values: np.ndarray, total: np.ndarray, named: np.ndarray) -> np.ndarray:
    """SGD (no momentum) on the named values only."""
    out = values.copy()
    out[named] = values[named] - np.float32(LR) * (total[named] + np.float32(WD) * values[named])
    return out


def value(srv) -> np.ndarray:
    return srv.state.chunks[A].value.copy()


def test_a_sync_round_updates_the_union_of_its_pushes_rows():
    srv = Server(num_workers=2, opt=sgd(), init={A: W0})
    p0, r = lazy_push(srv, 0, rows_field(1))
    assert r == []
    p1, r = lazy_push(srv, 1, rows_field(3))
    by_id(r)
    named = np.array([2, 3, 6, 7])                      # rows 1 and 3
    np.testing.assert_allclose(value(srv), stepped(W0, grad(0) + grad(1), named), rtol=1e-6)
    assert value(srv)[0] == W0[0] and value(srv)[4] == W0[4]


def test_a_dense_push_in_the_round_names_every_value():
    srv = Server(num_workers=2, opt=sgd(), init={A: W0})
    lazy_push(srv, 0, rows_field(1))
    srv.push(1, {A: grad(1)})                           # no rows: every value
    np.testing.assert_allclose(value(srv), stepped(W0, grad(0) + grad(1), np.arange(8)), rtol=1e-6)


def test_an_optimizer_without_lazy_update_updates_every_value():
    srv = Server(num_workers=1, opt=sgd(lazy_update=False), init={A: W0})
    lazy_push(srv, 0, rows_field(1))
    np.testing.assert_allclose(value(srv), stepped(W0, grad(0), np.arange(8)), rtol=1e-6)


def test_without_an_optimizer_the_sum_is_assigned_whole():
    srv = Server(num_workers=1, init={A: W0})
    lazy_push(srv, 0, rows_field(1))
    np.testing.assert_array_equal(value(srv), grad(0))


def test_a_chunk_cut_inside_rows_names_the_values_of_its_rows():
    # chunk A as values 3..10 of a key of rows 3 wide: phase 0 of row 1 ... row 3's first value
    srv = Server(num_workers=1, opt=sgd(), init={A: W0})
    field = lazy.chunk_field(np.array([1, 3]), 3, 3, 11)
    assert field[:2] == [3, 0]
    lazy_push(srv, 0, field)
    np.testing.assert_allclose(value(srv), stepped(W0, grad(0), np.array([0, 1, 2, 6, 7])), rtol=1e-6)
    field = lazy.chunk_field(np.array([0, 2]), 3, 2, 10)             # phase 2: row 0's last value
    np.testing.assert_array_equal(np.flatnonzero(lazy.parse(field, 8, "A")), [0, 4, 5, 6])


def test_a_write_into_the_round_names_every_value():
    for first in ("write", "lazy"):
        srv = Server(num_workers=2, opt=sgd(), init={A: W0}, write_in=True)
        if first == "lazy":
            lazy_push(srv, 0, rows_field(1))
        w1, r = srv.send(1, ops.WRITE, [A], values=True)
        grant = expect_ok(only(r), peer(1), w1, nvalues=1)
        if grant.header["modes"] == ["copy"]:
            np.copyto(grant.arrays[0], grad(1))
        else:
            grant.arrays[0] += grad(1)
        _, r = srv.send(1, ops.WRITTEN, grant=w1)
        if first == "write":
            lazy_push(srv, 0, rows_field(1))
        np.testing.assert_allclose(value(srv), stepped(W0, grad(0) + grad(1), np.arange(8)), rtol=1e-6,
                                   err_msg=first)


def test_a_push_held_behind_its_workers_write_keeps_its_rows():
    srv = Server(num_workers=2, opt=sgd(), init={A: W0}, write_in=True)
    w0, r = srv.send(0, ops.WRITE, [A], values=True)
    np.copyto(only(r).arrays[0], grad(0))
    w1, r = srv.send(1, ops.WRITE, [A], values=True)
    assert r == []                                      # queued behind worker 0's grant
    h1, r = lazy_push(srv, 1, rows_field(2))
    assert r == []                                      # held behind worker 1's own write
    _, r = srv.send(0, ops.WRITTEN, grant=w0)
    grant = next(x for x in r if x.header.get("id") == w1)
    grant.arrays[0] += grad(1)
    srv.send(1, ops.WRITTEN, grant=w1)                 # round 1: written, dense
    after_one = stepped(W0, grad(0) + grad(1), np.arange(8))
    np.testing.assert_allclose(value(srv), after_one, rtol=1e-6)
    lazy_push(srv, 0, rows_field(0))                   # round 2: the held push's row 2, and row 0
    np.testing.assert_allclose(value(srv), stepped(after_one, grad(0) + grad(1), np.array([0, 1, 4, 5])),
                               rtol=1e-6)


def test_async_applies_a_push_to_its_rows():
    srv = Server(mode="async", num_workers=2, opt=sgd(), init={A: W0})
    lazy_push(srv, 1, rows_field(0, 2), op=ops.PUSHPULL)
    np.testing.assert_allclose(value(srv), stepped(W0, grad(1), np.array([0, 1, 4, 5])), rtol=1e-6)


@pytest.mark.parametrize("field, message", [
    ("rows", "'rows' must be a list"),
    ([None, None], "one entry"),
    ([[2, 0]], "key 'w' (chunk 0): a 'rows' entry must be [width, phase, bitmap bytes]"),
    ([[0, 0, b""]], "key 'w' (chunk 0): 'rows' has width 0"),
    ([[2, 2, b"\x01"]], "phase 2"),
    ([[2, 0, b"\x01\x00"]], "bitmap has 2 bytes"),
    ([[2, 0, 1]], "[width, phase, bitmap bytes]"),
])
def test_a_malformed_rows_field_is_refused_naming_the_chunk(field, message):
    srv = Server(num_workers=1, opt=sgd(), init={A: W0})
    rid, r = srv.send(0, ops.PUSH, [A], [grad(0)], rows=field)
    expect_error(only(r), peer(0), rid, "ProtocolError", message)
    np.testing.assert_array_equal(value(srv), W0)
    with pytest.raises(ProtocolError, match="chunk A"):
        lazy.parse([2, 0, b""], 8, "chunk A")


def test_ssp_applies_a_push_to_its_rows():
    from kvstore.server.state import ServerState
    state = ServerState(name="server 0")
    for rid, (op, fields, arrays) in enumerate([
            (ops.CONFIGURE, {"mode": "ssp", "num_workers": 2, "staleness": 1}, []),
            (ops.SET_OPTIMIZER, {"optimizer": sgd().to_config()}, []),
            (ops.INIT, {"chunks": [list(A)]}, [W0]),
            (ops.PUSH, {"chunks": [list(A)], "rows": [rows_field(3)]}, [grad(0)])], 1):
        (reply,) = state.handle(peer(0), {"op": op, "id": rid, "src": 0, **fields}, arrays)
        expect_ok(reply, peer(0), rid)
    np.testing.assert_allclose(state.chunks[A].value, stepped(W0, grad(0), np.array([6, 7])), rtol=1e-6)
