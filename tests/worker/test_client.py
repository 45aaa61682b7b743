"""kvstore.worker.client on its own: a :class:`Client` made the way DistStore makes
it (a registered :class:`~kvstore.worker.job.JobMember`, the servers' adverts from
the registration) against in-process servers as tests/cluster.py builds them (real
ServerNodes and scheduler, ZeroMQ on 127.0.0.1, random ports), driven through its
own interface: ``request``, ``request_all``, ``wait``, ``replied`` (the job:
tests/worker/client_job.py).

Pinned from its docstring: requests are sent at once and replies collected when a
call waits, each delivered to its own request by id (into its arrays, to its
``on_reply``) whatever order they arrive in; a push's error is raised by the next
call that waits; an error reply names its server; a wait past ``KVSTORE_TIMEOUT``
names the server, what it waited for and the setting; a request that cannot be
encoded is refused before anything is sent and uses up no sequence number; an
aborted job ends a wait with NodeFailedError.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvstore.errors import DeadlineError, InvalidArgumentError, NodeFailedError, RemoteError
from kvstore.protocol import ops
from kvstore.protocol.codec import MAX_HEADER_BYTES
from kvstore.transport import shm
from kvstore.transport.links import RequestOptions
from kvstore.worker.client import Client

from client_job import jobs

pytestmark = pytest.mark.timeout(60)

F32 = np.float32


@pytest.fixture
def job(make_cluster):
    yield from jobs(make_cluster)


def init(client: Client, server: int, key, values) -> None:
    rid, _ = client.request(server, ops.INIT, f"init of key {key}", [np.asarray(values, F32)], chunks=[[key, 0]])
    client.wait([rid], f"init of key {key}")


TRANSPORTS = ["tcp", "ipc"] + (["shm"] if shm.available() else [])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_requests_to_each_server_are_answered_into_their_own_arrays(job, transport):
    client = job(1, 2, transport=transport).clients[0]
    assert client.transports == [transport, transport]
    headers = client.request_all(ops.GET_META, "reading the servers' meta")
    assert [h["op"] for h in headers] == [ops.OK, ops.OK] and all(h["resumed"] is False for h in headers)
    for server in (0, 1):
        init(client, server, 10 + server, np.arange(6) * (server + 1))
    outs = [np.full(6, np.nan, F32), np.full(6, np.nan, F32)]
    ids = [client.request(s, ops.PULL, f"pull of key {10 + s}", (), RequestOptions(into=[outs[s]]),
                          chunks=[[10 + s, 0]])[0]
           for s in (0, 1)]
    client.wait(ids, "pull")
    assert client.replied(ids)
    np.testing.assert_array_equal(outs[0], np.arange(6))
    np.testing.assert_array_equal(outs[1], np.arange(6) * 2)
    traffic = client.traffic.by_transport()
    assert list(traffic) == [transport] and traffic[transport]["sent"] > 0 and traffic[transport]["received"] > 0


def test_replies_reach_their_own_requests_by_id_whatever_order_they_come_in(job):
    j = job(2, 1)
    c0, c1 = j.clients
    init(c0, 0, "a", [0, 0, 0])
    init(c0, 0, "b", [5, 6, 7])
    seen: list = []
    out_a, out_b = np.full(3, np.nan, F32), np.full(3, np.nan, F32)
    push_id, _ = c0.request(0, ops.PUSHPULL, "pushpull of a", [np.ones(3, F32)],
                            RequestOptions(into=[out_a], on_reply=lambda h, a: seen.append(("pushpull", h["id"]))),
                            chunks=[["a", 0]])
    pull_id, _ = c0.request(0, ops.PULL, "pull of b", (),
                            RequestOptions(into=[out_b], on_reply=lambda h, a: seen.append(("pull", h["id"]))),
                            chunks=[["b", 0]])
    c0.wait([pull_id], "pull of b")        # answered first: the pushpull's round waits for worker 1
    assert seen == [("pull", pull_id)] and not c0.replied([push_id])
    np.testing.assert_array_equal(out_b, [5, 6, 7])
    assert np.isnan(out_a).all()           # nothing delivered into the pushpull's outputs yet
    other = np.full(3, np.nan, F32)
    rid, _ = c1.request(0, ops.PUSHPULL, "pushpull of a", [np.full(3, 2, F32)], RequestOptions(into=[other]),
                        chunks=[["a", 0]])
    c1.wait([rid], "pushpull of a")
    c0.wait([push_id], "pushpull of a")
    assert seen == [("pull", pull_id), ("pushpull", push_id)]
    np.testing.assert_array_equal(out_a, 3)
    np.testing.assert_array_equal(other, 3)


def test_a_wait_past_the_deadline_names_the_server_what_it_waited_for_and_the_setting(job):
    j = job(2, 2, client={"timeout": 1.0})
    c0 = j.clients[0]
    for key in (1, 2, 3, 4):
        init(c0, 1, key, [0])
    ids = [c0.request(1, ops.PUSHPULL, f"pushpull of key {key}", [np.ones(1, F32)],
                      RequestOptions(into=[np.empty(1, F32)]), chunks=[[key, 0]])[0] for key in (1, 2, 3, 4)]      # worker 1 never pushes
    started = time.monotonic()
    with pytest.raises(DeadlineError) as caught:
        c0.wait(ids, "a step")
    assert time.monotonic() - started >= 1.0
    message = str(caught.value)
    assert message.startswith(f"a step: no reply from server 1 ({j.servers[1].split()[0]}) within 1s to the "
                              "pushpull of key 1, pushpull of key 2, pushpull of key 3 and 1 more request."), message
    assert "raise KVSTORE_TIMEOUT" in message
    assert c0.failure.startswith("a step: no reply from server 1 (")     # later calls fail at once


def test_an_error_reply_names_its_server_and_a_pushs_error_is_raised_by_the_next_wait(job):
    client = job(1, 2).clients[0]
    init(client, 1, "w", [1, 2])
    rid, _ = client.request(1, ops.PULL, "pull of key 'x'", (), RequestOptions(into=[np.empty(2, F32)]),
                            chunks=[["x", 0]])
    with pytest.raises(RemoteError, match=r"^pull of key 'x': server 1 rejected the request: "
                                          r"InvalidArgumentError: .*not initialised on server 1") as caught:
        client.wait([rid], "pull of key 'x'")
    assert (caught.value.node, caught.value.kind) == ("server 1", "InvalidArgumentError")
    client.request(1, ops.PUSH, "push of key 'x'", [np.ones(2, F32)], chunks=[["x", 0]])   # not waited for
    # (to the same server: its reply comes after the push's error, so that error is in by then)
    ok_id, _ = client.request(1, ops.PULL, "pull of key 'w'", (), RequestOptions(into=[np.empty(2, F32)]),
                              chunks=[["w", 0]])
    with pytest.raises(RemoteError, match="^push of key 'x': server 1 rejected"):
        client.wait([ok_id], "pull of key 'w'")   # the push's error, at the next call that waits
    client.wait([ok_id], "pull of key 'w'")       # raised once
    errors: list = []
    rid, _ = client.request(1, ops.PUSH, "push of key 'x'", [np.ones(2, F32)],
                            RequestOptions(on_error=errors.append), chunks=[["x", 0]])
    client.wait([rid], "push of key 'x'")         # its error went to on_error instead
    assert len(errors) == 1 and isinstance(errors[0], RemoteError)


def test_a_request_that_cannot_be_encoded_is_refused_before_sending_and_uses_up_no_sequence_number(job):
    client = job(1, 1, max_message_bytes=4096, client={"timeout": 5.0}).clients[0]
    init(client, 0, "w", [3, 4])
    with pytest.raises(InvalidArgumentError, match=r"odd pull: the request to server 0 cannot be encoded "
                                                   r"\(TypeError"):
        client.request(0, ops.PULL, "odd pull", chunks=[["w", 0]], extra=object())
    with pytest.raises(InvalidArgumentError, match=rf"long pull: the request's header has \d+ bytes, more than "
                                                   rf"the {MAX_HEADER_BYTES}"):
        client.request(0, ops.PULL, "long pull", chunks=[["w", 0]], pad="x" * MAX_HEADER_BYTES)
    with pytest.raises(InvalidArgumentError, match="big push: a buffer of 8192 bytes exceeds "
                                                   "KVSTORE_MAX_MESSAGE_BYTES=4096"):
        client.request(0, ops.PUSH, "big push", [np.zeros(2048, F32)], chunks=[["w", 0]])
    # the server handles each connection's requests in sequence: a number taken by a
    # request that never went out would hold this one back until the deadline
    out = np.empty(2, F32)
    rid, _ = client.request(0, ops.PULL, "pull of key 'w'", (), RequestOptions(into=[out]), chunks=[["w", 0]])
    client.wait([rid], "pull of key 'w'")
    np.testing.assert_array_equal(out, [3, 4])


def test_an_aborted_job_ends_a_wait_with_node_failed_error_naming_the_reason(job):
    j = job(2, 1)
    c0 = j.clients[0]
    init(c0, 0, "a", [0])
    rid, _ = c0.request(0, ops.PUSHPULL, "pushpull of a", [np.ones(1, F32)], RequestOptions(into=[np.empty(1, F32)]),
                        chunks=[["a", 0]])
    j.fail(1, "worker 1 hit a bug")                       # the scheduler aborts the job
    with pytest.raises(NodeFailedError, match="the job was aborted: .*worker 1 hit a bug"):
        c0.wait([rid], "pushpull of a")                   # long before its 30 s deadline
