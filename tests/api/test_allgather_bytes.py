"""``kv.allgather_bytes``: every worker's bytes in member order, through the job's
scheduler (in-process cluster: real sockets, the job's secret), in one round or
several; the servers' values are untouched even while they run an optimizer (the
Lightning strategy's case); bad arguments and an absent worker are named errors;
a store of one process returns its own bytes."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import kvstore
from kvstore.errors import ArgumentTypeError, DeadlineError, InvalidArgumentError
from tracker.control.records import gather_budget
from tracker.control.security import new_secret


def test_every_workers_bytes_come_back_in_rank_order_and_the_servers_values_stay(make_cluster):
    cluster = make_cluster(3, 2, secret=new_secret())
    big = bytes(range(256)) * (gather_budget(3) // 256 + 7)          # more than one round carries

    def job(kv):
        kv.init("w", np.ones(4, np.float32))
        kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.5))
        mine = [big, b"", b"two"][kv.rank]
        first = kv.allgather_bytes(mine)
        second = kv.allgather_bytes(bytearray(f"rank {kv.rank}".encode()), timeout=20)
        out = np.empty(4, np.float32)
        kv.pull("w", out=out)
        return first, second, out, kv.members

    for first, second, out, members in cluster.run(job):
        assert first == [big, b"", b"two"]
        assert second == [b"rank 0", b"rank 1", b"rank 2"]
        np.testing.assert_array_equal(out, 1)       # no gather went through the servers' optimizer
        assert members == (0, 1, 2)


def test_a_worker_that_does_not_come_is_named_and_bad_arguments_are_refused(make_cluster):
    cluster = make_cluster(2, 1)
    failed = threading.Event()

    def job(kv):
        with pytest.raises(ArgumentTypeError, match="allgather_bytes: data must be bytes, got str"):
            kv.allgather_bytes("text")
        with pytest.raises(InvalidArgumentError, match="timeout must be a number of seconds > 0, got 0"):
            kv.allgather_bytes(b"x", timeout=0)
        if kv.rank == 1:
            assert failed.wait(30), "worker 0's gather did not fail"
            return None
        try:
            with pytest.raises(DeadlineError, match=r"worker 1 \(pid \d+ on .*\) did not arrive"):
                kv.allgather_bytes(b"alone", timeout=1.0)
        finally:
            failed.set()

    cluster.run(job)


def test_a_store_of_one_process_returns_its_own_bytes():
    with kvstore.create("local") as kv:
        assert kv.allgather_bytes(memoryview(b"mine")) == [b"mine"]
        with pytest.raises(ArgumentTypeError):
            kv.allgather_bytes(None)
    with pytest.raises(InvalidArgumentError, match="the store is closed"):
        kv.allgather_bytes(b"late")
