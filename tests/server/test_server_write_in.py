"""ServerState: workers writing into the server's sums (``write``/``written``).

A co-located worker asks to write its chunks; the server grants, per chunk, the
round's accumulator and whether to copy (it opens the round) or add (the round has
a sum); one writer per round at a time; a request gets all its chunks or waits;
``written`` counts the worker as having pushed and is answered like a pushpull.
Here the "worker" writes into the granted arrays itself, as the client does.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.protocol import ops
from state_driver import A, B, Server, by_id, expect_error, expect_ok, only, peer, sgd, vec


def write(srv, src, chunks):
    return srv.send(src, ops.WRITE, list(chunks), values=True)


def do(grant, grads):
    """What the client does with a grant: copy or add each gradient, in place."""
    assert grant.header["write_in"] is True
    for mode, target, g in zip(grant.header["modes"], grant.arrays, grads):
        if mode == "copy":
            np.copyto(target, g)
        else:
            target += g
    return grant.header["modes"]


def written(srv, src, grant_id):
    return srv.send(src, ops.WRITTEN, grant=grant_id)


@pytest.mark.parametrize("opt", [None, sgd(learning_rate=0.5)], ids=["assign", "sgd"])
def test_writers_take_turns_and_the_round_completes_with_the_last(opt):
    w0 = vec(10, 20, 30)
    srv = Server(num_workers=2, opt=opt, init={A: w0}, write_in=True)
    g0, g1 = vec(1, 2, 3), vec(4, 5, 6)
    id0, r0 = write(srv, 0, [A])
    id1, r1 = write(srv, 1, [A])
    assert r1 == []                          # worker 0 writes: worker 1 waits its turn
    assert do(expect_ok(only(r0), peer(0), id0, nvalues=1), [g0]) == ["copy"]
    done0, r = written(srv, 0, id0)
    grant1 = expect_ok(only(r), peer(1), id1, nvalues=1)   # worker 1's turn now
    assert do(grant1, [g1]) == ["add"]
    done1, r = written(srv, 1, id1)
    replies = by_id(r)
    assert set(replies) == {done0, done1}    # both answered, as pushpulls, when the round is
    expected = g0 + g1 if opt is None else w0 - 0.5 * (g0 + g1)
    for rid, src in ((done0, 0), (done1, 1)):
        np.testing.assert_array_equal(expect_ok(replies[rid], peer(src), rid, nvalues=1).arrays[0],
                                      expected)


def test_a_push_during_a_write_is_added_after_it_and_a_push_before_it_is_copied_in():
    srv = Server(num_workers=3, init={A: vec(0, 0)}, write_in=True)
    pid, r = srv.push(2, {A: vec(100, 200)}, op=ops.PUSHPULL)     # opens the round as a message
    assert r == []
    id0, r = write(srv, 0, [A])
    assert do(only(r), [vec(1, 2)]) == ["add"]                    # onto the message's values
    pid1, r = srv.push(1, {A: vec(10, 20)}, op=ops.PUSHPULL)      # while worker 0 writes
    assert r == []
    done0, r = written(srv, 0, id0)
    replies = by_id(r)
    assert set(replies) == {pid, pid1, done0}
    for reply in replies.values():
        np.testing.assert_array_equal(reply.arrays[0], vec(111, 222))


def test_a_request_is_granted_all_its_chunks_at_once_or_waits():
    srv = Server(num_workers=2, init={A: vec(0), B: vec(0)}, write_in=True)
    id1, r = write(srv, 1, [B])
    do(only(r), [vec(5)])
    id0, r = write(srv, 0, [A, B])            # A is free, B is being written: nothing granted
    assert r == []
    id1b, r = write(srv, 1, [A])              # a later request whose chunks are free goes first
    assert do(only(r), [vec(7)]) == ["copy"]
    _, r = written(srv, 1, id1)
    assert r == []                            # worker 0's request still needs A
    _, r = written(srv, 1, id1b)
    grant = expect_ok(only(r), peer(0), id0, nvalues=2)
    assert do(grant, [vec(1), vec(2)]) == ["add", "add"]
    _, r = written(srv, 0, id0)
    assert len(r) == 3                        # worker 1's two requests and worker 0's
    np.testing.assert_array_equal(srv.value(A), vec(8))
    np.testing.assert_array_equal(srv.value(B), vec(7))


def test_a_worker_writing_ahead_opens_the_next_round():
    srv = Server(num_workers=2, init={A: vec(0)}, write_in=True)
    first, r = write(srv, 0, [A])
    do(only(r), [vec(1)])
    done, r = written(srv, 0, first)
    assert r == []
    second, r = write(srv, 0, [A])            # round 1 still waits for worker 1
    assert do(only(r), [vec(10)]) == ["copy"]
    _, r = written(srv, 0, second)
    _, r = srv.push(1, {A: vec(2)}, op=ops.PUSHPULL)
    assert len(r) == 2                        # round 1 done: worker 0's first and worker 1's
    np.testing.assert_array_equal(r[0].arrays[0], vec(3))
    _, r = srv.push(1, {A: vec(20)}, op=ops.PUSHPULL)
    assert len(r) == 2
    np.testing.assert_array_equal(r[0].arrays[0], vec(30))


@pytest.mark.parametrize("server, header, arrays, kind, fragment", [
    (dict(write_in=False), {"op": "write", "chunks": [["w", 0]]}, [], "InvalidArgumentError",
     "private memory"),
    (dict(write_in=True, mode="async"), {"op": "write", "chunks": [["w", 0]]}, [],
     "InvalidArgumentError", "dist_sync"),
    (dict(write_in=True), {"op": "write", "chunks": [["w", 0]]}, [vec(1)], "ProtocolError",
     "no buffers"),
    (dict(write_in=True), {"op": "write", "chunks": [["w", 0]], "values": 1}, [], "ProtocolError",
     "'values'"),
    (dict(write_in=True), {"op": "write", "chunks": [["w", 9]]}, [], "InvalidArgumentError",
     "not initialised"),
    (dict(write_in=True), {"op": "written", "grant": 12345}, [], "ProtocolError", "no write granted"),
    (dict(write_in=True), {"op": "written", "grant": "x"}, [], "ProtocolError", "no write granted"),
])
def test_invalid_writes_are_refused_and_change_nothing(server, header, arrays, kind, fragment):
    srv = Server(num_workers=2, init={A: vec(3)}, **server)
    r = srv.raw(0, {**header, "id": 77, "src": 0}, arrays)
    expect_error(only(r), peer(0), 77, kind, fragment)
    if server.get("mode") != "async":
        np.testing.assert_array_equal(srv.value(A, src=1), vec(3))


def test_a_grant_is_ended_once_and_only_by_its_worker():
    srv = Server(num_workers=2, init={A: vec(0)}, write_in=True)
    gid, r = write(srv, 0, [A])
    do(only(r), [vec(1)])
    _, r = written(srv, 1, gid)               # worker 1 cannot end worker 0's grant
    expect_error(only(r), peer(1), r[0].header["id"], "ProtocolError", "no write granted")
    _, r = written(srv, 0, gid)
    assert r == []
    _, r = written(srv, 0, gid)               # ended already
    expect_error(only(r), peer(0), r[0].header["id"], "ProtocolError", "no write granted")
    r = srv.raw(0, {"op": "write", "id": 500, "src": 0, "chunks": [["w", 0]]})
    r2 = srv.raw(0, {"op": "write", "id": 500, "src": 0, "chunks": [["w", 0]]})
    expect_error(only(r2), peer(0), 500, "ProtocolError", "already open")


def test_integer_chunks_cannot_be_written_under_an_optimizer():
    srv = Server(num_workers=2, opt=sgd(), init={A: np.array([1, 2], np.int64)}, write_in=True)
    rid, r = write(srv, 0, [A])
    expect_error(only(r), peer(0), rid, "InvalidArgumentError", "floating-point")


def test_a_stalled_round_names_the_worker_holding_a_write_grant():
    srv = Server(num_workers=3, init={A: vec(0)}, write_in=True)
    _, r = write(srv, 1, [A])
    do(only(r), [vec(1)])
    assert srv.state.stalled(0.0, 10) == []
    (line,) = srv.state.stalled(20.0, 10)
    assert "worker(s) 0, 1, 2 to push" in line and "worker 1 was granted its sum" in line


class Pool:
    """An allocator over one buffer, standing in for the shared-memory arena."""

    def __init__(self, nbytes=1 << 16):
        self.buffer, self.used = np.zeros(nbytes, np.uint8), 0

    def alloc(self, size, dtype):
        n = size * np.dtype(dtype).itemsize
        a = self.buffer[self.used:self.used + n].view(dtype)
        self.used += -(-n // 64) * 64
        return a

    def shared(self, a):
        return np.shares_memory(a, self.buffer)


def test_a_write_into_a_sum_outside_shared_memory_is_refused_and_changes_nothing():
    srv = Server(num_workers=2, init={A: vec(1, 2)}, write_in=True, shared=lambda a: False)
    rid, r = write(srv, 0, [A])
    expect_error(only(r), peer(0), rid, "InternalError", "worker 0", "key 'w' (chunk 0)",
                 "not in shared memory", "KVSTORE_WRITE_IN=0")
    # no grant stays open: both workers can push the round instead
    p0, r = srv.push(0, {A: vec(1, 1)}, op=ops.PUSHPULL)
    assert r == []
    p1, r = srv.push(1, {A: vec(2, 2)}, op=ops.PUSHPULL)
    for reply in r:
        np.testing.assert_array_equal(reply.arrays[0], vec(3, 3))
    assert set(by_id(r)) == {p0, p1}


def test_restored_values_lie_in_shared_memory_so_writes_keep_working_after_a_resume():
    before = Server(num_workers=2, init={A: vec(1, 2), B: vec(3, 4)})
    pool = Pool()
    srv = Server(num_workers=2, write_in=True, alloc=pool.alloc, shared=pool.shared)
    srv.state.restore(before.state.snapshot({}))
    assert all(pool.shared(c.value) for c in srv.state.chunks.values())
    srv.init({A: vec(0, 0), B: vec(0, 0)})                  # keeps the restored values
    for step in range(3):                                   # the sum and the value swap each round
        ids, done = {}, {}
        for src in (0, 1):
            ids[src], r = write(srv, src, [A, B])
            if r:
                do(only(r), [vec(src + 1, src + 1)] * 2)
        for src in (0, 1):
            done[src], r = written(srv, src, ids[src])
            if src == 0:
                do(expect_ok(only(r), peer(1), ids[1], nvalues=2), [vec(2, 2)] * 2)
        for reply in r:
            assert [a.tolist() for a in reply.arrays] == [[3, 3], [3, 3]]
        assert set(by_id(r)) == set(done.values())


# -- a write counts as its worker's push from the moment it arrives -------------------

def test_a_pull_after_a_granted_write_waits_for_the_round_of_that_write():
    srv = Server(num_workers=2, init={A: vec(0, 0)}, write_in=True)
    gid, r = write(srv, 0, [A])
    do(only(r), [vec(1, 2)])                  # granted and written into, `written` not sent yet
    pull, r = srv.pull(0, [A])
    assert r == []                            # reads its own last push's round: not the old value
    done0, r = written(srv, 0, gid)
    assert r == []                            # the round still needs worker 1
    p1, r = srv.push(1, {A: vec(10, 20)}, op=ops.PUSHPULL)
    replies = by_id(r)
    assert set(replies) == {done0, p1, pull}
    np.testing.assert_array_equal(replies[pull].arrays[0], vec(11, 22))


def test_a_pull_after_a_queued_write_waits_for_it_too():
    srv = Server(num_workers=2, init={A: vec(0)}, write_in=True)
    g1, r = write(srv, 1, [A])
    do(only(r), [vec(5)])                     # worker 1 writes into round 1...
    g0, r = write(srv, 0, [A])
    assert r == []                            # ...so worker 0's write waits its turn
    pull, r = srv.pull(0, [A])
    assert r == []                            # and so does worker 0's pull behind it
    done1, r = written(srv, 1, g1)
    do(expect_ok(only(r), peer(0), g0, nvalues=1), [vec(7)])
    done0, r = written(srv, 0, g0)
    replies = by_id(r)
    assert set(replies) == {done1, done0, pull}
    np.testing.assert_array_equal(replies[pull].arrays[0], vec(12))


def test_a_push_after_a_queued_write_of_the_same_worker_takes_the_next_round():
    srv = Server(num_workers=2, init={A: vec(0)}, write_in=True)
    g1, r = write(srv, 1, [A])
    do(only(r), [vec(1)])                     # round 1: worker 1 writes
    g0, r = write(srv, 0, [A])                # worker 0's round-1 write waits its turn...
    assert r == []
    p0, r = srv.push(0, {A: vec(100)})        # ...and its next push must not take round 1
    assert r == []
    done1, r = written(srv, 1, g1)
    assert do(expect_ok(only(r), peer(0), g0, nvalues=1), [vec(10)]) == ["add"]
    done0, r = written(srv, 0, g0)
    replies = by_id(r)
    assert set(replies) == {done1, done0}
    for rid in (done1, done0):
        np.testing.assert_array_equal(replies[rid].arrays[0], vec(11))    # round 1 = 1 + 10
    p1, r = srv.push(1, {A: vec(1000)}, op=ops.PUSHPULL)
    replies = by_id(r)
    assert set(replies) == {p0, p1}
    np.testing.assert_array_equal(replies[p1].arrays[0], vec(1100))      # round 2 = 100 + 1000


def test_a_later_write_of_the_same_worker_does_not_overtake_its_queued_one():
    srv = Server(num_workers=2, init={A: vec(0), B: vec(0)}, write_in=True)
    g1, r = write(srv, 1, [B])
    do(only(r), [vec(1)])                     # worker 1 writes B
    first, r = write(srv, 0, [A, B])          # waits for B
    assert r == []
    second, r = write(srv, 0, [A])            # A is free, but worker 0's first write goes first
    assert r == []
    done1, r = written(srv, 1, g1)
    grants = by_id(r)                         # both granted now, in the order they came:
    assert set(grants) == {first, second}
    assert do(grants[first], [vec(2), vec(2)]) == ["copy", "add"]    # round 1 of A (and B)
    assert do(grants[second], [vec(50)]) == ["copy"]                 # round 2 of A
    written(srv, 0, first)
    written(srv, 0, second)
    p1, r = srv.push(1, {A: vec(3)}, op=ops.PUSHPULL)          # round 1 of A: 2 + 3
    np.testing.assert_array_equal(by_id(r)[p1].arrays[0], vec(5))
    p1, r = srv.push(1, {A: vec(7)}, op=ops.PUSHPULL)          # round 2 of A: 50 + 7
    np.testing.assert_array_equal(by_id(r)[p1].arrays[0], vec(57))


def test_a_worker_finishing_fails_queued_writes_and_ends_open_grants_with_its_reason():
    srv = Server(num_workers=3, init={A: vec(0)}, write_in=True)
    g0, r = write(srv, 0, [A])
    do(only(r), [vec(1)])
    g2, r = write(srv, 2, [A])
    assert r == []
    replies = by_id(srv.state.workers_finished({1}))
    expect_error(replies[g2], peer(2), g2, "InvalidArgumentError", "worker 1 closed its store")
    done, r = written(srv, 0, g0)
    expect_error(only(r), peer(0), done, "InvalidArgumentError", "worker 1 closed its store while round 1")
