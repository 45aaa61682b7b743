"""Issue 40, findings 6 and 7: every request's cost is bounded before the server
allocates anything (kvstore.server.budget, KVSTORE_SERVER_MEMORY), and early
requests held by the sequencer are bounded per connection and let go when their
worker has given up (kvstore.server.sequencer).

The state machine and the sequencer are driven without sockets; one test runs a
live server (real ZeroMQ on loopback) that a peer floods with requests out of
sequence. A refusal names the key (or the request), the bytes and the setting,
changes nothing and leaves the server serving."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq

from kvstore.protocol import decode, encode, ops
from kvstore.rows.dynamic import DynamicRows
from kvstore.server.budget import SETTING, MemoryBudget
from kvstore.server.sequencer import Sequencer, received_bytes

from state_driver import Server, expect_ok, only, peer

pytestmark = pytest.mark.timeout(120)

I64, F32 = np.int64, np.float32


def refused(reply, *fragments):
    h = reply.header
    assert h["op"] == ops.ERROR and h["kind"] == "InvalidArgumentError", h
    for fragment in fragments:
        assert fragment in h["message"], (fragment, h["message"])
    return h["message"]


def init_rows(s, key, shape, dtype="float32", servers=1):
    return s.send(0, ops.INIT_ROWS, arrays=[np.zeros(0, I64), np.zeros(0, dtype)], chunk=[key, 0],
                  shape=shape, dtype=dtype, servers=servers, init=None)


def init_dyn(s, key, spec: DynamicRows):
    return s.send(0, ops.INIT_DYN, chunk=[key, 0], servers=1, spec=spec.to_wire())


# -- finding 6: declared shapes ------------------------------------------------------------

def test_init_rows_whose_row_width_wraps_64_bits_is_refused_naming_key_size_and_setting():
    """shape [4, 2**32, 2**32]: its rows hold 2**64 values each, which numpy's int64
    product wrapped to 0 (a table of width 0 was made). Refused whatever the budget
    (here none), and nothing changes: the key can be initialised properly after."""
    s = Server(num_workers=1)
    rid, r = init_rows(s, "emb", [4, 2**32, 2**32])
    message = refused(only(r), "key 'emb'", "73,786,976,294,838,206,464 values", SETTING)
    assert "bytes" in message
    assert ("emb", 0) not in s.state.chunks and s.state.budget.held == 0
    rid, r = init_rows(s, "emb", [4, 2, 2])
    expect_ok(only(r), peer(0), rid)
    assert s.state.chunks[("emb", 0)].value.size == 16


def test_a_table_past_the_budget_is_refused_and_the_server_keeps_serving():
    budget = MemoryBudget(1 << 20)
    s = Server(num_workers=1, budget=budget)
    _, r = init_rows(s, "big", [1024, 1024])                  # 4 MiB of float32
    refused(only(r), "key 'big'", "4,194,304 bytes", "1,048,576 bytes", SETTING)
    assert ("big", 0) not in s.state.chunks and budget.held == 0
    s.init({("w", 0): np.ones(1000, F32)})                    # 4,000 bytes: fits
    rid, r = init_rows(s, "small", [64, 16])                  # 4,096 bytes: fits
    expect_ok(only(r), peer(0), rid)
    assert budget.held == 4000 + 4096
    rid, r = s.send(0, ops.INIT, [("v", 0)], [np.zeros(300_000, F32)])   # 1.2 MB: does not
    refused(only(r), "key 'v' (chunk 0)", "1,200,000 bytes", SETTING)
    assert ("v", 0) not in s.state.chunks and budget.held == 8096
    rid, r = s.push(0, {("w", 0): np.ones(1000, F32)})        # the server goes on serving
    expect_ok(only(r), peer(0), rid)
    np.testing.assert_array_equal(s.value(("w", 0)), 1)


def test_a_gpu_servers_table_counts_its_host_staging_too(server_backend):
    """On a device backend the rows are built in host memory, then uploaded: both count."""
    budget = MemoryBudget(6000)
    s = Server(num_workers=1, budget=budget)
    rid, r = init_rows(s, "t", [1000, 1])                     # 4,000 bytes (+ 4,000 staged off the host)
    if server_backend == "host":
        expect_ok(only(r), peer(0), rid)
        assert budget.held == 4000
    else:
        refused(only(r), "key 't'", "8,000 bytes", SETTING)
        assert budget.held == 0


@pytest.mark.parametrize("row_shape, fragment", [
    ((2**32, 2**32), "more than any allocation can hold"),    # width wrapped to 0 before
    ((4096,), "dynamic rows of key 'e'"),                    # 1024 slab rows of 16 KiB: 16 MiB
])
def test_init_dyn_of_a_slab_past_the_budget_is_refused(row_shape, fragment):
    budget = MemoryBudget(1 << 20)
    s = Server(num_workers=1, budget=budget)
    rid, r = init_dyn(s, "e", DynamicRows(row_shape))
    refused(only(r), fragment, SETTING)
    assert budget.held == 0 and not s.state.dyn.tables
    rid, r = init_dyn(s, "e", DynamicRows(4))                 # 1024 slab rows of 16 + 8 bytes: fits
    expect_ok(only(r), peer(0), rid)
    assert budget.held == 1024 * (16 + 8)


def test_a_dynamic_table_that_would_grow_past_the_budget_refuses_the_round_and_changes_nothing():
    width, row = 64, 64 * 4 + 8
    budget = MemoryBudget(1024 * row + 100_000)               # the first slab, not its doubling
    s = Server(num_workers=1, budget=budget)
    expect_ok(only(init_dyn(s, "e", DynamicRows(width))[1]), peer(0))
    ids = np.arange(1025, dtype=I64)
    rid, r = s.send(0, ops.PUSH_DYN, arrays=[ids, np.ones((1025, width), F32)], chunk=["e", 0])
    refused(only(r), "dynamic rows of key 'e'", "270,336 bytes", SETTING)
    stats = s.state.dyn.tables[("e", 0)].rows.stats()
    assert stats["rows"] == 0 and stats["capacity"] == 1024 and budget.held == 1024 * row
    rid, r = s.send(0, ops.PUSH_DYN, arrays=[ids[:1000], np.ones((1000, width), F32)], chunk=["e", 0])
    expect_ok(only(r), peer(0), rid)                          # what fits the slab goes on
    assert s.state.dyn.tables[("e", 0)].rows.stats()["rows"] == 1000


def test_a_dynamic_pull_whose_reply_passes_the_room_left_is_refused():
    """A pull_dyn names any ids (those without a row read their initial value): its
    reply, a row per id, is counted against the room left before it is built."""
    budget = MemoryBudget(300_000)
    s = Server(num_workers=1, budget=budget)
    expect_ok(only(init_dyn(s, "e", DynamicRows(64))[1]), peer(0))     # 1024 x 264 bytes held
    rid, r = s.send(0, ops.PULL_DYN, arrays=[np.arange(1000, dtype=I64)], chunk=["e", 0])
    refused(only(r), "pull_dyn of 1,000 ids of key 'e'", "256,000 bytes", SETTING)
    rid, r = s.send(0, ops.PULL_DYN, arrays=[np.arange(10, dtype=I64)], chunk=["e", 0])
    assert expect_ok(only(r), peer(0), rid).arrays[0].shape == (10, 64)


def test_budgets_come_from_the_setting():
    assert MemoryBudget.from_setting(0).limit is None
    assert MemoryBudget.from_setting(12345).limit == 12345
    auto = MemoryBudget.from_setting("auto").limit
    assert auto is not None and 0 < auto < (1 << 50)


# -- finding 7: early requests held by the sequencer -----------------------------------

def early(seq: int, nbytes: int = 1000, **fields) -> tuple[dict, list]:
    return {"op": ops.PUSH, "id": seq + 1, "src": 1, "seq": seq, **fields}, [np.zeros(nbytes, np.uint8)]


def test_early_requests_are_bounded_per_connection_and_counted_in_the_budget():
    budget = MemoryBudget(None)
    seq = Sequencer("server 0", budget, max_bytes=3000)
    for n in (1, 2, 3):
        assert seq.accept(b"p", *early(n)) == []
    with pytest.raises(ValueError, match=r"3 requests \(3,000 bytes\) from worker 1 wait for sequence 0.*3,000 bytes"):
        seq.accept(b"p", *early(4))
    assert seq.accept(b"q", *early(1)) == []               # another connection has its own bound
    assert seq.held_bytes(b"p") == 3000 and seq.held_bytes() == budget.held == 4000
    assert [h["seq"] for h, _ in seq.accept(b"p", *early(0))] == [0, 1, 2, 3]
    assert seq.held_bytes(b"p") == 0 and budget.held == 1000
    counted = Sequencer("server 0", budget, max_held=2)
    counted.accept(b"r", *early(1, 10))
    counted.accept(b"r", *early(2, 10))
    with pytest.raises(ValueError, match="at most 2 are held per connection"):
        counted.accept(b"r", *early(3, 10))


def test_early_requests_past_the_servers_budget_are_refused_naming_the_setting():
    budget = MemoryBudget(2500)
    seq = Sequencer("server 0", budget)
    seq.accept(b"p", *early(1))
    seq.accept(b"q", *early(1))
    with pytest.raises(ValueError, match=f"wait for sequence 0.*{SETTING}"):
        seq.accept(b"r", *early(1))
    assert budget.held == 2000


def test_held_requests_are_dropped_once_their_connection_made_no_progress_for_the_timeout():
    budget = MemoryBudget(None)
    seq = Sequencer("server 0", budget)
    seq.accept(b"p", *early(2))
    assert seq.expire(100.0, 10.0) == 0                    # first seen holding now
    assert seq.expire(109.0, 10.0) == 0
    seq.accept(b"p", *early(0))                            # progress (1 still missing): counts again
    assert seq.expire(111.0, 10.0) == 0 and seq.held_bytes() == 1000
    assert seq.expire(120.0, 10.0) == 0
    assert seq.expire(121.0, 10.0) == 1                    # 10 s without progress
    assert seq.held_bytes() == 0 and budget.held == 0 and seq.expired == 1
    assert seq.accept(b"p", *early(1)) != []               # the connection itself still works


def test_buffers_passed_by_reference_are_not_counted_as_held():
    header, arrays = early(1, 100)
    header["shm"] = {"segs": [[1, 2, 4096]], "refs": [[0, 0], None]}
    assert received_bytes(header, arrays + [np.zeros(7, np.uint8)]) == 7


# -- finding 7 on a live server ----------------------------------------------------------

def test_a_peer_flooding_a_server_out_of_sequence_is_bounded_and_let_go_when_it_leaves(make_cluster):
    """200 pushes of 1 MiB, none of them sequence 0, from one connection: the server
    holds what its 16 MiB budget allows and refuses the rest (each answered, naming
    the setting); once the peer is gone and KVSTORE_TIMEOUT passed without progress,
    the memory is free again. The job's worker is served all along."""
    cluster = make_cluster(1, 1, timeout=3.0, server_memory=16 << 20)
    ready, release, box = threading.Event(), threading.Event(), {}

    def work(kv):
        kv.init(3, np.arange(4, dtype=F32))
        box["addr"] = kv._client.servers[0]
        ready.set()
        assert release.wait(60)
        out = np.zeros(4, F32)
        kv.pull(3, out=out)
        return out

    runner = threading.Thread(target=lambda: box.setdefault("result", cluster.run(work, timeout=90)[0]),
                              daemon=True)
    runner.start()
    assert ready.wait(30), "the job did not start"
    node = cluster.nodes[0]
    baseline = node._live.budget.held
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(box["addr"])
    errors = []
    try:
        for n in range(1, 201):
            sock.send_multipart(encode({"op": ops.PUSH, "id": n, "src": 0, "seq": n, "chunks": [[3, 0]]},
                                       [np.zeros(1 << 18, F32)]))
        deadline = time.monotonic() + 30
        while len(errors) < 185 and time.monotonic() < deadline:
            if sock.poll(500):
                header, _ = decode(sock.recv_multipart())
                errors.append(header)
    finally:
        sock.close(linger=0)
        ctx.term()
    held = node.sequencer.held_bytes()
    assert 0 < held <= 16 << 20 and len(errors) == 200 - held // (1 << 20), (held, len(errors))
    assert all(e["op"] == ops.ERROR and SETTING in e["message"] for e in errors), errors[0]
    deadline = time.monotonic() + 30                        # KVSTORE_TIMEOUT (3 s) without progress
    while node.sequencer.held_bytes() and time.monotonic() < deadline:
        time.sleep(0.1)   # polling the server's counters: no event tells a test when they change
    assert node.sequencer.held_bytes() == 0 and node._live.budget.held == baseline
    release.set()
    runner.join(60)
    np.testing.assert_array_equal(box["result"], np.arange(4, dtype=F32))
