"""A new consistency mode is a strategy class plus its ConsistencyMode and its line
in MODES (docs/architecture.md, "Adding a piece"), and what its mode does not list
is refused (issue 41, item 1).

``Toy`` is such a mode, registered with one line here: pushes replace the value
(the last one wins), reads are answered at once. Its mode lists nothing, so
writing in, layer-wise norms, a host's sums, row-sparse keys, deterministic sums
and a staleness bound are each refused, by the state's questions to the mode and
by the face's default hooks, without a line about ``toy`` anywhere in kvstore.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.errors import InvalidArgumentError, ProtocolError
from kvstore.modes import ConsistencyMode
from kvstore.protocol import ops
from kvstore.rows.dynamic import DynamicRows
from kvstore.server.consistency import Consistency
from kvstore.server.modes import MODES
from kvstore.server.requests import reply_values
from kvstore.server.state import ServerState

from state_driver import A, Server, expect_error, expect_ok, only, peer, vec

pytestmark = pytest.mark.timeout(60)

TOY = ConsistencyMode("toy")        # allows nothing: every flag left at its default


class Toy(Consistency):
    """The last push wins; reads are answered at once."""

    mode = TOY

    def push(self, peer, req_id, worker, ids, chunks, arrays, want_values, group, norms=False):
        for chunk, grad in zip(chunks, arrays):
            chunk.value[...] = grad.reshape(-1)
        return [reply_values(peer, req_id, self.table.backend, chunks, want_values, copy=True)]

    def pull(self, peer, req_id, worker, ids, chunks):
        return [reply_values(peer, req_id, self.table.backend, chunks, True, copy=True)]


@pytest.fixture(autouse=True)
def toy_registered(monkeypatch):
    monkeypatch.setitem(MODES, TOY.name, Toy)          # the one line in MODES


def toy_server(**args):
    return Server(mode="toy", num_workers=2, init={A: vec(1, 2)}, write_in=True, **args)


def test_a_registered_mode_runs_pushes_and_pulls():
    srv = toy_server()
    assert srv.state.mode is TOY and isinstance(srv.state.consistency, Toy)
    rid, r = srv.push(1, {A: vec(5, 6)}, op=ops.PUSHPULL)
    expect_ok(only(r), peer(1), rid)
    np.testing.assert_array_equal(only(r).arrays[0], vec(5, 6))
    np.testing.assert_array_equal(srv.value(A), vec(5, 6))
    assert srv.state.stalled(100.0, 0.0) == [] and srv.state.workers_finished({0}) == []
    assert srv.state.set_members(1, {1}) == []


@pytest.mark.parametrize("request_, kind, fragment", [
    ({"op": ops.WRITE, "chunks": [list(A)]}, "InvalidArgumentError", "writing in is for uncompressed dist_sync"),
    ({"op": ops.WRITTEN, "grant": 1}, "ProtocolError", "'written' names no write granted: server 0 runs dist_toy"),
    ({"op": ops.PUSH, "chunks": [list(A)], "norms": True, "bufs": [vec(1, 1)]}, "InvalidArgumentError",
     "norms across servers are for dist_sync; server 0 runs dist_toy"),
    ({"op": ops.APPLY_NORMS, "chunks": [list(A)], "sums": [[1.0]], "rounds": [1]}, "InvalidArgumentError",
     "norms across servers are for dist_sync; server 0 runs dist_toy"),
    ({"op": ops.PUSH, "chunks": [list(A)], "group": [0, 1], "bufs": [vec(1, 1)]}, "InvalidArgumentError",
     "is for dist_sync only; this server runs dist_toy"),
    ({"op": ops.INIT_ROWS, "chunk": ["r", 0], "shape": [4, 2], "dtype": "float32", "servers": 1, "init": None,
      "bufs": [np.zeros(0, np.int64), np.zeros(0, np.float32)]},
     "InvalidArgumentError", "row-sparse keys do not work with dist_toy"),
    ({"op": ops.INIT_DYN, "chunk": ["d", 0], "servers": 1, "spec": DynamicRows((2,)).to_wire()},
     "InvalidArgumentError", "row-sparse keys do not work with dist_toy"),
])
def test_what_the_mode_does_not_list_is_refused(request_, kind, fragment):
    srv = toy_server()
    header = {k: v for k, v in request_.items() if k != "bufs"}
    r = srv.raw(0, {**header, "id": 77, "src": 0}, request_.get("bufs", []))
    expect_error(only(r), peer(0), 77, kind, fragment)
    np.testing.assert_array_equal(srv.value(A), vec(1, 2))


@pytest.mark.parametrize("fields, fragment", [
    ({"deterministic": True}, "deterministic sums need dist_sync"),
    ({"staleness": 2}, "bad configuration"),
])
def test_configure_refuses_what_the_mode_does_not_list(fields, fragment):
    state = ServerState(name="server 0")
    r = state.handle(peer(0), {"op": ops.CONFIGURE, "id": 3, "src": 0, "mode": "toy", "num_workers": 2,
                               **fields}, [])
    expect_error(only(r), peer(0), 3, "InvalidArgumentError", fragment)
    assert state.mode is None and state.consistency is None


def test_the_face_refuses_the_optional_hooks_by_default():
    strategy = toy_server().state.consistency
    with pytest.raises(InvalidArgumentError, match="dist_toy"):
        strategy.write(peer(0), {"id": 1, "src": 0, "chunks": [list(A)]})
    with pytest.raises(ProtocolError, match="dist_toy"):
        strategy.written(peer(0), {"id": 1, "src": 0, "grant": 1})
    with pytest.raises(InvalidArgumentError, match="dist_toy"):
        strategy.apply_norms(peer(0), 1, [A], [], [[1.0]], [1], False)
    assert TOY.configure_fields(None) == {"mode": "toy"}
