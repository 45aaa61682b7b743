"""kvstore.worker.leaving on its own: a :class:`Departure` per worker of a real job
(in-process scheduler and ServerNodes, tests/cluster.py; a registered
:class:`~kvstore.worker.job.JobMember` and a :class:`~kvstore.worker.client.Client`
each, as tests/worker/client_job.py makes them), driven through its interface:
``attach``, ``close``, ``fail``, ``exit_block``.

Pinned from its docstring: ``close`` waits for pushes in flight, tells the scheduler
the worker is done (the servers end with status 0 once every worker did) and
releases; it is idempotent; leaving by an exception, after a call gave up on a
deadline, or when the pushes in flight failed reports a failure instead (the
scheduler aborts the job at once, naming the reason, and the servers end with 1);
a host group is flushed before the client, and left after it, before the finish.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.errors import DeadlineError, RemoteError
from kvstore.protocol import ops
from kvstore.transport.links import RequestOptions
from kvstore.worker.leaving import Departure

from client_job import Job

pytestmark = pytest.mark.timeout(60)

F32 = np.float32


@pytest.fixture
def start(make_cluster):
    """``start(workers, **client settings)`` -> (cluster, job, [Departure per rank]) of a
    job configured in sync mode with one server (tcp); each departure attached. A
    departure a failed test left behind fails at the end (the job ends at once)."""
    made: list = []

    def make(workers: int = 2, **client):
        cluster = make_cluster(workers, 1, transport="tcp", data_channel=False)
        job = Job(cluster, client)
        job.clients[0].request_all(ops.CONFIGURE, "configuring the servers", mode="sync", num_workers=workers)
        departures = [Departure(member) for member in job.members]
        for rank, (d, client_) in enumerate(zip(departures, job.clients)):
            d.attach(client_, None, rank)
        made.extend(departures)
        return cluster, job, departures
    yield make
    for d in made:
        if not d.left:
            d.fail("the test ended")


def init(client, key, values) -> None:
    rid, _ = client.request(0, ops.INIT, f"init of key {key}", [np.asarray(values, F32)], chunks=[[key, 0]])
    client.wait([rid], f"init of key {key}")


def push(client, key, values) -> int:
    return client.request(0, ops.PUSH, f"push of key {key}", [np.asarray(values, F32)], chunks=[[key, 0]])[0]


def wait_servers(cluster) -> list:
    cluster.close()                       # waits for the scheduler and every server thread
    return cluster.server_codes


def test_close_waits_for_pushes_in_flight_and_every_workers_close_ends_the_job_cleanly(start):
    cluster, job, (d0, d1) = start(2)
    init(job.clients[0], "w", [0, 0, 0])
    push(job.clients[0], "w", [1, 2, 3])
    push(job.clients[1], "w", [1, 1, 1])             # the round completes; the acks are still in flight
    d0.close()
    assert d0.left and job.members[0].membership.aborted.is_set() is False
    d0.close()                                        # idempotent
    out = np.zeros(3, F32)
    rid = job.clients[1].request(0, ops.PULL, "pull of w", (), RequestOptions(into=[out]), chunks=[["w", 0]])[0]
    job.clients[1].wait([rid], "pull of w")
    np.testing.assert_array_equal(out, [2, 3, 4])     # worker 0's push was applied before it left
    d1.close()
    assert wait_servers(cluster) == [0]


def test_fail_reports_the_reason_and_the_scheduler_aborts_the_job_at_once(start):
    cluster, job, (d0, d1) = start(2)
    d0.fail("worker 0 ran out of data")
    assert d0.left
    other = job.members[1].membership
    assert other.aborted.wait(10), "the job was not aborted"
    assert "worker 0 ran out of data" in other.abort_reason
    d1.close()                                        # the job is aborted: nothing to wait for
    assert d1.left
    assert wait_servers(cluster) == [1]


def test_leaving_a_with_block_by_an_exception_is_a_failure_naming_it(start):
    cluster, job, (d0, d1) = start(2)
    try:
        raise ValueError("bad batch")
    except ValueError as e:
        d0.exit_block(type(e), e)
    assert job.members[1].membership.aborted.wait(10)
    assert "ValueError: bad batch" in job.members[1].membership.abort_reason
    d1.exit_block(None, None)
    assert wait_servers(cluster) == [1]


def test_close_after_a_call_gave_up_on_its_deadline_reports_that_failure(start):
    cluster, job, (d0, d1) = start(2, timeout=0.5)
    c0 = job.clients[0]
    init(c0, "w", [0, 0])
    push(c0, "w", [1, 1])                             # worker 1 never pushes: the round stays open
    rid = c0.request(0, ops.PULL, "pull of w", (), RequestOptions(into=[np.zeros(2, F32)]), chunks=[["w", 0]])[0]
    with pytest.raises(DeadlineError):
        c0.wait([rid], "pull of w")
    assert c0.failure is not None
    d0.close()                                        # does not wait again: reports the failure
    assert job.members[1].membership.aborted.wait(10)
    reason = job.members[1].membership.abort_reason
    assert reason.startswith("worker 0 (pid ") and "failed: pull of w: no reply from server 0 (tcp://" in reason
    assert reason.endswith("within 0.5s")
    d1.close()
    assert wait_servers(cluster) == [1]


def test_close_whose_pushes_in_flight_failed_raises_their_error_and_fails_the_job(start):
    cluster, job, (d0, d1) = start(2)
    push(job.clients[0], "never initialised", [1.0])
    with pytest.raises(RemoteError, match="never initialised"):
        d0.close()
    assert d0.left
    assert job.members[1].membership.aborted.wait(10)
    assert ("failed: close: RemoteError: push of key never initialised: server 0 rejected the request"
            in job.members[1].membership.abort_reason)
    d1.close()
    assert wait_servers(cluster) == [1]


class RecordingHost:
    """The host group's part of a departure (``flush``, ``leave``, ``close``), recorded."""

    def __init__(self, calls: list):
        self.calls = calls

    def flush(self, what: str) -> None:
        self.calls.append(("host flush", what))

    def leave(self, what: str) -> None:
        self.calls.append(("host leave", what))

    def close(self) -> None:
        self.calls.append(("host close",))


def test_a_host_group_is_flushed_before_the_client_and_left_before_the_finish(start):
    cluster, job, (d0, d1) = start(2)
    calls: list = []
    client, member = job.clients[0], job.members[0]
    client_flush, finish = client.flush, member.finish
    client.flush = lambda what: (calls.append(("client flush", what)), client_flush(what))[1]
    member.finish = lambda closed=True: (calls.append(("finish",)), finish(closed))[1]
    d0.attach(client, RecordingHost(calls), 0)
    d0.close()
    assert calls == [("host flush", "close"), ("client flush", "close"), ("host leave", "close"), ("finish",),
                     ("host close",)]
    d1.close()
    assert wait_servers(cluster) == [0]
