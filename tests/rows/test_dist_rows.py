"""kvstore.rows.dist on its own: :class:`DistRows` over real
:class:`~kvstore.worker.client.Client` objects and in-process servers
(tests/worker/client_job.py: real ServerNodes and scheduler, ZeroMQ tcp on
127.0.0.1), made the way DistStore makes it (the job member's collective call,
``leads`` = rank 0); and the pure :func:`gather_states` / :func:`split_states`.

What each request carried is read from the client's :class:`kvstore.timeline.Timeline`
(the "request" events: op, server, bytes), the public record of what a worker sent.

Pinned from its docstring: row ``r`` lives on server ``r % S``; a pull asks only the
servers that own its rows and carries only those; an async push does the same, a
sync push also sends a header with no rows to every other server; init is
collective (rank 0 sends, nobody returns before the servers hold the rows); a key
of dynamic rows goes the same way with its own ops, its ids placed by hash; assign
goes to the owners only; stats come from every server.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from kvstore import optimizer
from kvstore.modes import ASYNC, SYNC
from kvstore.protocol import ops
from kvstore.rows.dist import DistRows, gather_states, split_states
from kvstore.rows.dynamic import DynamicRows, owner
from kvstore.timeline import Timeline
from kvstore.worker.arguments import KeyInfo

from worker.client_job import Job      # tests/worker/client_job.py: clients of a real job

pytestmark = pytest.mark.timeout(60)

F32, I64 = np.float32, np.int64


class Rows:
    """Worker ``rank``'s DistRows, its client traced."""

    def __init__(self, job: Job, rank: int, mode, tmp_path):
        self.client = job.clients[rank]
        self.timeline = self.client.timeline = Timeline(str(tmp_path / f"w{rank}"), "worker", rank)
        member = job.members[rank]
        self.rows = DistRows(self.client, mode, lambda token, items=(): member.collective(token, items=items),
                             lambda: rank == 0)
        self._seen = 0

    def requests(self) -> list[tuple]:
        """(op, server, bytes) of the requests answered since the last call, in the order sent."""
        self.timeline.flush()
        with open(self.timeline.path) as f:
            lines = f.read().splitlines()[1:]
        events = [json.loads(line.rstrip(",")) for line in lines if line.strip()]
        sent = sorted((e for e in events if e.get("cat") == "request" and e["name"] != "queued"),
                      key=lambda e: e["ts"])
        new, self._seen = sent[self._seen:], len(sent)
        return [(e["name"], e["args"]["server"], e["args"]["bytes"]) for e in new]


@pytest.fixture
def start(make_cluster, tmp_path):
    """``start(workers, mode)`` -> [Rows per rank] of a job of 2 servers configured in
    ``mode`` (async: with SGD at learning rate 1)."""
    started: list = []

    def make(workers: int = 1, mode=SYNC) -> list[Rows]:
        job = Job(make_cluster(workers, 2, transport="tcp", data_channel=False), {})
        started.append(job)
        job.clients[0].request_all(ops.CONFIGURE, "configuring the servers", mode=mode.name, num_workers=workers)
        if mode is ASYNC:
            job.clients[0].request_all(ops.SET_OPTIMIZER, "set_optimizer",
                                       optimizer=optimizer.SGD(learning_rate=1.0).to_config())
        return [Rows(job, rank, mode, tmp_path) for rank in range(workers)]
    yield make
    for job in started:
        job.close()


TABLE = np.arange(12, dtype=F32).reshape(6, 2)      # row r holds [2r, 2r + 1]


def init(w: Rows, key="e", rows=range(6), data=TABLE) -> None:
    w.rows.init([(key, (6, 2), F32, None, np.array(list(rows), I64), np.asarray(data, F32))])


def test_init_sends_each_server_its_rows_and_a_pull_asks_only_the_owners_of_its_rows(start):
    [w] = start(1)
    init(w)
    assert sorted(w.requests()) == [(ops.INIT_ROWS, 0, 3 * 8 + 3 * 8), (ops.INIT_ROWS, 1, 3 * 8 + 3 * 8)]
    np.testing.assert_array_equal(w.rows.pull("e", np.array([1, 4, 5], I64), (2,), F32), TABLE[[1, 4, 5]])
    assert sorted(w.requests()) == [(ops.PULL_ROWS, 0, 8), (ops.PULL_ROWS, 1, 16)]
    np.testing.assert_array_equal(w.rows.pull("e", np.array([1, 5], I64), (2,), F32), TABLE[[1, 5]])
    assert w.requests() == [(ops.PULL_ROWS, 1, 16)]              # rows 1 and 5 live on server 1 only
    assert w.rows.chunks("e") == [["e", 0], ["e", 1]] and w.rows.servers == 2


def test_a_sync_push_reaches_every_server_and_an_async_push_only_the_owners(start):
    [w] = start(1, SYNC)
    init(w)
    w.requests()
    w.rows.push([("e", np.array([0, 2], I64), np.ones((2, 2), F32))])
    w.client.flush("push")
    assert sorted(w.requests()) == [(ops.PUSH_ROWS, 0, 16 + 16), (ops.PUSH_ROWS, 1, 0)]   # server 1: no rows
    got = w.rows.pull("e", np.arange(6, dtype=I64), (2,), F32)
    np.testing.assert_array_equal(got[[0, 2]], 1)                # one worker, no optimizer: assigned
    np.testing.assert_array_equal(got[[1, 3, 4, 5]], TABLE[[1, 3, 4, 5]])
    [a] = start(1, ASYNC)
    init(a)
    a.requests()
    a.rows.push([("e", np.array([0, 2], I64), np.ones((2, 2), F32))])
    a.client.flush("push")
    assert a.requests() == [(ops.PUSH_ROWS, 0, 32)]
    np.testing.assert_array_equal(a.rows.pull("e", np.array([0, 2], I64), (2,), F32), TABLE[[0, 2]] - 1)


def test_assign_goes_to_the_owners_of_its_rows_only(start):
    [w] = start(1)
    init(w)
    w.requests()
    w.rows.assign("e", np.array([3, 5], I64), np.full((2, 2), 9, F32))
    assert w.requests() == [(ops.SET_ROWS, 1, 32)]
    np.testing.assert_array_equal(w.rows.pull("e", np.array([2, 3, 5], I64), (2,), F32),
                                  [[4, 5], [9, 9], [9, 9]])


def test_init_is_collective_rank_0_sends_and_every_worker_returns_once_the_servers_hold_the_rows(start):
    w0, w1 = start(2)
    done = threading.Event()

    def other():
        init(w1, data=np.zeros((6, 2)))                          # its data is not sent: rank 0's wins
        np.testing.assert_array_equal(w1.rows.pull("e", np.array([5], I64), (2,), F32), TABLE[[5]])
        done.set()
    t = threading.Thread(target=other)
    t.start()
    init(w0)
    t.join(30)
    assert done.is_set()
    assert [op for op, _, _ in w1.requests()] == [ops.PULL_ROWS]  # worker 1 sent no init
    assert sorted(op for op, _, _ in w0.requests()) == [ops.INIT_ROWS, ops.INIT_ROWS]


def test_dynamic_rows_use_their_own_ops_and_their_ids_go_where_they_hash(start):
    [w] = start(1)
    w.rows.init([("d", (1 << 63, 2), F32, DynamicRows(2), None, None)])
    assert sorted(w.requests()) == [(ops.INIT_DYN, 0, 0), (ops.INIT_DYN, 1, 0)]
    ids = np.array([3, 17, 40, 1000], I64)
    where = owner(ids, 2)
    w.rows.push([("d", ids, np.ones((4, 2), F32))])
    w.client.flush("push")
    sent = sorted(w.requests())
    assert sent == [(ops.PUSH_DYN, s, 16 * int((where == s).sum())) for s in (0, 1)]
    np.testing.assert_array_equal(w.rows.pull("d", np.array([3, 17, 99], I64), (2,), F32),
                                  [[1, 1], [1, 1], [0, 0]])      # 99 has no row: its initial value
    stats = w.rows.stats("d")
    assert [s["rows"] for s in stats] == [int((where == s).sum()) for s in (0, 1)]


# -- optimizer states of a row-sparse key ------------------------------------------------------
def test_a_states_shards_joined_and_cut_again_are_the_same():
    info = KeyInfo("e", (5, 2), np.dtype(F32))
    whole = np.arange(10, dtype=F32).reshape(5, 2)
    shards = split_states(info, 7, [whole.reshape(-1)], 2)
    assert [s[0] for s in shards.values()] == [["e", 0, 7, 1], ["e", 1, 7, 1]]
    np.testing.assert_array_equal(shards[1][1][0], whole[1::2].reshape(-1))     # rows 1 and 3
    found = {("e", s): (7, arrays) for s, (_, arrays) in shards.items()}
    joined = gather_states(info, found, 2, fresh=lambda s: [])
    assert joined["t"] == 7
    np.testing.assert_array_equal(joined["state"][0], whole)
    assert gather_states(info, {}, 2, fresh=lambda s: []) is None               # no shard has any


def test_a_shard_without_state_yet_is_made_fresh():
    info = KeyInfo("e", (4, 1), np.dtype(F32))
    found = {("e", 0): (3, [np.array([1, 2], F32)])}
    joined = gather_states(info, found, 2, fresh=lambda s: [np.full(2, -1, F32)])
    assert joined["t"] == 3
    assert joined["state"][0].reshape(-1).tolist() == [1, -1, 2, -1]
