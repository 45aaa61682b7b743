"""Row-sparse tables in the server's state machine (kvstore.server.tables), driven
without sockets: rounds merge rows, pulls wait for the sender's rounds, finished
workers fail the rounds they will never join, bad rows change nothing, and a
checkpoint carries the table."""

import numpy as np
import pytest

from kvstore import optimizer
from kvstore.protocol import ops

from state_driver import Server, expect_ok, only, peer

# every test also runs the GPU server's code path on the device layer's host device
pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("server_backend")]

E = ["e", 1]                 # the chunk of key "e" held by server 1 (of 2): odd rows
I64 = np.int64


def rows_server(num_workers=2, mode="sync", opt=None):
    s = Server(mode=mode, num_workers=num_workers, opt=opt)
    data = np.arange(6, dtype=np.float32).reshape(3, 2)       # rows 1, 3, 5 hold 0..5
    _, r = s.send(0, ops.INIT_ROWS, arrays=[np.array([1, 3, 5], I64), data], chunk=E,
                  shape=[7, 2], dtype="float32", servers=2, init=None)
    expect_ok(only(r), peer(0))
    return s


def refused(reply, fragment):
    assert reply.header["op"] == ops.ERROR and fragment in reply.header["message"], reply.header


def push(s, src, rows, values):
    return s.send(src, ops.PUSH_ROWS, arrays=[np.array(rows, I64), np.array(values, np.float32)], chunk=E)


def pull(s, src, rows):
    return s.send(src, ops.PULL_ROWS, arrays=[np.array(rows, I64)], chunk=E)


def test_a_round_merges_the_rows_of_every_worker_and_pulls_wait_for_it():
    s = rows_server()
    id0, r = push(s, 0, [1, 5], [[1, 1], [5, 5]])
    assert r == []                                          # waits for worker 1
    idp, r = pull(s, 0, [1, 3, 5])
    assert r == []                                          # worker 0 has a push pending
    _, r = pull(s, 1, [5])
    assert only(r).arrays[0].tolist() == [[4, 5]]           # worker 1 has none: the old value
    id1, r = push(s, 1, [5], [[10, 10]])
    by = {rep.header["id"]: rep for rep in r}
    assert set(by) == {id0, id1, idp}
    assert by[idp].arrays[0].tolist() == [[1, 1], [2, 3], [15, 15]]   # no optimizer: merged rows assigned


def test_a_row_pull_reply_is_its_own_and_the_next_pull_leaves_it_alone():
    """A pull's rows are a fresh gather; on the GPU path the pool hands the same
    address to the next gather, so its reply must not go to a mirror cached by
    address, which the next reply would overwrite while a worker reads this one."""
    s = rows_server()
    _, r = pull(s, 0, [1, 5])
    first = only(r).arrays[0]
    for rows in ([3, 5], [1, 3], [3, 5]) * 4:      # gathers of the same size
        _, r = pull(s, 1, rows)
        assert only(r).arrays[0].tolist() == [[rows[0] - 1, rows[0]], [rows[1] - 1, rows[1]]]
    assert first.tolist() == [[0, 1], [4, 5]]


def test_an_empty_push_counts_for_the_round_and_the_optimizer_is_lazy():
    s = rows_server(opt=optimizer.SGD(learning_rate=1.0, momentum=0.5))
    for step in range(2):
        push(s, 0, [3], [[1, 1]])
        _, r = push(s, 1, [], np.zeros((0, 2)))
        assert len(r) == 2
    _, r = pull(s, 0, [1, 3])
    # row 3: m1 = -1, w = 2-1 = 1; m2 = 0.5*-1 - 1 = -1.5, w = 1-1.5 = -0.5; row 1 untouched
    np.testing.assert_allclose(only(r).arrays[0], [[0, 1], [-0.5, 0.5]])
    state = s.state.updater.get_states()[("e", 1)]["state"][0].reshape(3, 2)
    assert state[0].tolist() == [0, 0] and state[2].tolist() == [0, 0]    # untouched rows' momentum


@pytest.mark.parametrize("rows, values, match", [
    ([2], [[1, 1]], "row id 2 is not one of this server's rows"),
    ([7], [[1, 1]], "row id 7"),
    ([3, 1], [[1, 1], [1, 1]], "unique and sorted"),
    ([1], [[1, 1, 1]], "each row holds 2 x float32"),
])
def test_bad_rows_are_refused_and_change_nothing(rows, values, match):
    s = rows_server()
    _, r = push(s, 0, rows, values)
    refused(only(r), match)
    assert s.state.rows.tables[("e", 1)].rounds == []
    _, r = pull(s, 0, [1, 3, 5])
    assert only(r).arrays[0].tolist() == [[0, 1], [2, 3], [4, 5]]


def set_rows(s, src, rows, values):
    return s.send(src, ops.SET_ROWS, arrays=[np.array(rows, I64), np.array(values, np.float32)], chunk=E)


def test_set_rows_assigns_between_rounds_keeps_the_optimizer_state_and_refuses_during_one():
    """kv.assign_rows (a table loaded from a file): the rows take the values, other
    rows and the optimizer's state stay; while a round is open it is refused naming
    who pushed, and changes nothing; bad rows are refused as pushes are."""
    s = rows_server(opt=optimizer.SGD(learning_rate=1.0, momentum=0.5))
    push(s, 0, [3], [[1, 1]])
    push(s, 1, [], np.zeros((0, 2)))                     # row 3: m = -1, w = [1, 2]
    _, r = set_rows(s, 0, [1, 3], [[10, 10], [20, 20]])
    expect_ok(only(r), peer(0))
    push(s, 0, [3], [[1, 1]])                             # a round is open: worker 0 pushed
    _, r = set_rows(s, 1, [5], [[9, 9]])
    refused(only(r), "a round of pushes is still open (from worker(s) 0)")
    for rows, values, match in (([2], [[1, 1]], "not one of this server's rows"),
                                ([3, 1], [[1, 1], [1, 1]], "unique and sorted"),
                                ([1], [[1, 1, 1]], "each row holds 2 x float32")):
        refused(only(set_rows(s, 1, rows, values)[1]), match)
    _, r = push(s, 1, [], np.zeros((0, 2)))
    assert len(r) == 2
    _, r = pull(s, 0, [1, 3, 5])
    # row 3: m = 0.5 * -1 - 1 = -1.5 (the momentum kept), w = 20 - 1.5; row 5 never set
    np.testing.assert_allclose(only(r).arrays[0], [[10, 10], [18.5, 18.5], [4, 5]])


def test_dense_and_row_operations_do_not_mix():
    s = rows_server()
    _, r = s.send(0, ops.PULL, chunks=[tuple(E)])
    refused(only(r), "row-sparse key")
    _, r = s.send(0, ops.INIT, chunks=[("d", 0)], arrays=[np.zeros(4, np.float32)])
    expect_ok(only(r), peer(0))
    _, r = s.send(0, ops.PULL_ROWS, arrays=[np.array([1], I64)], chunk=["d", 0])
    refused(only(r), "dense key")


def test_a_finished_worker_fails_the_rounds_it_will_never_join():
    s = rows_server()
    pid, _ = push(s, 0, [1], [[1, 1]])
    lid, _ = pull(s, 0, [1])
    replies = s.state.workers_finished([1])
    assert {rep.header["id"] for rep in replies} == {pid, lid}
    assert all("closed their store" in rep.header["message"] for rep in replies)
    _, r = push(s, 0, [1], [[1, 1]])
    refused(only(r), "worker(s) 1")


def test_async_updates_rows_on_arrival_and_a_checkpoint_carries_the_table():
    s = rows_server(mode="async", opt=optimizer.SGD(learning_rate=0.5))
    _, r = push(s, 1, [3], [[2, 2]])
    expect_ok(only(r), peer(1))
    snap = s.state.snapshot({"epoch": 1})
    t = Server(mode="async", num_workers=2)
    t.state.restore(snap)
    _, r = t.send(0, ops.INIT_ROWS, arrays=[np.zeros(0, I64), np.zeros((0, 2), np.float32)], chunk=E,
                  shape=[7, 2], dtype="float32", servers=2, init=None)
    expect_ok(only(r), peer(0))                              # resumed: the checkpoint's rows win
    _, r = pull(t, 0, [1, 3])
    assert only(r).arrays[0].tolist() == [[0, 1], [1, 2]]
