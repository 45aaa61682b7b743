"""kvstore.transport.links.write_in on its own: the :class:`Writer` of a real
:class:`~kvstore.transport.links.shm_link.ShmLink` (a worker's client and in-process
servers on this host, tests/worker/client_job.py, shared memory between them),
called the way the exchange calls it for a sync pushpull's message.

Pinned from its docstring: only arrays of at least ``zero_copy_bytes`` that are not
in our own shared memory are written, and only when they come to
``write_in_bytes``; otherwise nothing is sent and the call returns None; a write's
grant is handled when the worker next waits and sends ``written``, whose reply
brings the round's values into ``into``; the first writer of a round copies and
the next adds (the round's value is the sum); what is written counts as sent.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvstore.protocol import ops
from kvstore.transport import shm
from kvstore.transport.links import RequestOptions
from kvstore.transport.links.write_in import Writer

from worker.client_job import jobs      # tests/worker/client_job.py: clients of a real job

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not shm.available(), reason="no POSIX shared memory on this machine")]

F32 = np.float32
BIG = 4096                  # values: 16 KiB, at the zero-copy threshold below
SETTINGS = {"zero_copy_bytes": 16384, "write_in_bytes": 16384}


@pytest.fixture
def job(make_cluster):
    yield from jobs(make_cluster)


def start(job, workers: int = 1):
    j = job(workers, 1, transport="shm", client=SETTINGS, **SETTINGS)
    init = [np.zeros(BIG, F32), np.zeros(16, F32)]
    rid, _ = j.clients[0].request(0, ops.INIT, "init", init, chunks=[["w", 0], ["b", 0]])
    j.clients[0].wait([rid], "init")
    return j


def writer(client) -> Writer:
    w = client.links[0].writer
    assert isinstance(w, Writer), "the shm link to a co-located server has no writer"
    return w


def write(client, grad: np.ndarray, out: np.ndarray) -> None:
    """A whole write, as the exchange waits for it: the grant, then ``written``'s reply."""
    writing = writer(client).write("pushpull of w", [["w", 0]], [grad], [out])
    assert writing is not None and writing.chosen == [0]
    assert writing.requests()[0] == writing.request     # (`written` too if its grant was in already)
    client.wait([writing.request], "pushpull of w")
    assert writing.written is not None and writing.requests() == [writing.request, writing.written]
    client.wait([writing.written], "pushpull of w")


def test_a_write_goes_into_the_servers_sum_and_written_brings_the_rounds_value(job):
    client = start(job).clients[0]
    grad, out = np.arange(BIG, dtype=F32), np.full(BIG, np.nan, F32)
    before = client.traffic.by_transport()["shm"]["sent"]
    write(client, grad, out)
    np.testing.assert_array_equal(out, grad)            # one worker, no optimizer: the value is its push
    assert client.traffic.by_transport()["shm"]["sent"] - before >= grad.nbytes    # written counts as sent
    pulled = np.zeros(BIG, F32)
    rid, _ = client.request(0, ops.PULL, "pull of w", (), RequestOptions(into=[pulled]), chunks=[["w", 0]])
    client.wait([rid], "pull of w")
    np.testing.assert_array_equal(pulled, grad)


def test_the_first_writer_of_a_round_copies_and_the_next_adds(job):
    j = start(job, workers=2)

    def round_of(grads):
        outs = [np.full(BIG, np.nan, F32) for _ in grads]
        threads = [threading.Thread(target=write, args=(j.clients[r], grads[r], outs[r])) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return outs
    grads = [np.full(BIG, 1, F32), np.arange(BIG, dtype=F32)]
    for out in round_of(grads):
        np.testing.assert_array_equal(out, grads[0] + grads[1])
    for out in round_of([grads[1], grads[1]]):          # the next round starts from nothing again
        np.testing.assert_array_equal(out, 2 * grads[1])


def test_small_arrays_and_arrays_in_our_shared_memory_are_left_to_push(job):
    client = start(job).clients[0]
    w = writer(client)
    small = np.ones(BIG - 1, F32)                       # below zero_copy_bytes
    assert w.write("pushpull", [["w", 0]], [small], [np.empty_like(small)]) is None
    ours = client.links[0].empty(BIG, F32)              # kv.empty(): the server reads it in place
    ours[:] = 1
    assert w.write("pushpull", [["w", 0]], [ours], [np.empty(BIG, F32)]) is None
    # two arrays: only the large one, from ordinary memory, is written
    grad, out = np.full(BIG, 3, F32), np.full(BIG, np.nan, F32)
    writing = w.write("pushpull", [["b", 0], ["w", 0]], [np.ones(16, F32), grad], [np.empty(16, F32), out])
    assert writing is not None and writing.chosen == [1]
    client.wait([writing.request], "pushpull")
    client.wait([writing.written], "pushpull")
    np.testing.assert_array_equal(out, 3)


def test_nothing_is_written_below_write_in_bytes_in_all(job):
    j = job(1, 1, transport="shm", client={**SETTINGS, "write_in_bytes": 2 * BIG * 4}, **SETTINGS)
    w = writer(j.clients[0])
    assert w.write("pushpull", [["w", 0]], [np.ones(BIG, F32)], [np.empty(BIG, F32)]) is None
