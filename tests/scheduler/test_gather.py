"""The all-gather that rides on the scheduler's barrier (what ``kv.allgather_bytes``
and the Lightning strategy's collectives use): a barrier request may carry a
payload, and ``barrier_done`` hands every waiter all of them in rank order.

On the pure state machine: the order, the bounds (what one payload and one
barrier's payloads may take, checked before anything is kept, and always true
under random payloads), and that a barrier without payloads is answered as before.
Live, over loopback ZeroMQ with the job's secret: data larger than one barrier
carries comes back whole after several rounds, and a peer without the secret
(no credentials, another secret, the other mechanism) gets nothing from the
channel, nor can it put a payload into a gather as one of the workers."""

from __future__ import annotations

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_scheduler_liveness import FAST, run_all
from test_scheduler_state import Job, error, only, to
from tracker.control import wire
from tracker.control.errors import RendezvousError
from tracker.control.membership import Membership
from tracker.control.records import GATHER_BYTES, GATHER_SEND_BYTES, gather_budget
from tracker.control.rendezvous import Scheduler
from tracker.control.security import Security, new_secret

DEADLINE = 20.0   # seconds for any live wait


# -- the state machine -----------------------------------------------------------------------
def test_a_barrier_with_payloads_gives_every_waiter_all_of_them_in_rank_order():
    job = Job(workers=3)
    job.form()
    for rank in (2, 0):
        assert job.request(f"worker-{rank}", "barrier", token="t", data=bytes([rank]) * (rank + 1))[1] == []
    _, sends = job.request("worker-1", "barrier", token="t", data=b"")
    assert len(sends) == 3 and {s.op for s in sends} == {"barrier_done"}
    for rank in range(3):
        assert only(to(sends, f"worker-{rank}".encode())).fields["data"] == [b"\0", b"", b"\2\2\2"]
    assert job.state._ranks.barrier.waiting == {}       # nothing kept once answered


def test_a_barrier_without_payloads_is_answered_as_before():
    job = Job(workers=2)
    job.form()
    job.request("worker-0", "barrier", token="t")
    _, sends = job.request("worker-1", "barrier", token="t")
    assert {s.op for s in sends} == {"barrier_done"} and all("data" not in s.fields for s in sends)


@pytest.mark.parametrize("data, text", [
    ("text", "a barrier's data must be bytes, not str"),
    ([b"x"], "a barrier's data must be bytes, not list"),
    (b"x" * (GATHER_BYTES + 1), f"data of {GATHER_BYTES + 1} bytes exceeds the {GATHER_BYTES} bytes"),
])
def test_a_payload_that_is_not_bytes_or_too_large_is_refused_and_the_others_wait_on(data, text):
    job = Job(workers=2)
    job.form()
    job.request("worker-0", "barrier", token="t", data=b"zero")
    req_id, sends = job.request("worker-1", "barrier", token="t", data=data)
    error(sends, "invalid", text, req_id)
    assert list(job.state._ranks.barrier.waiting) == ["worker-0"]     # nothing of worker 1 kept
    _, sends = job.request("worker-1", "barrier", token="t", data=b"one")
    assert only(to(sends, b"worker-0")).fields["data"] == [b"zero", b"one"]
    assert job.state.failure is None


def test_payloads_that_together_exceed_a_barrier_fail_it_for_every_waiter_naming_their_sizes():
    job = Job(workers=3)
    job.form()
    half = GATHER_BYTES // 2 + 1
    job.request("worker-1", "barrier", token="t", data=b"1" * half)
    _, sends = job.request("worker-0", "barrier", token="t", data=b"0" * half)
    assert len(sends) == 2 and {(s.op, s.fields["kind"]) for s in sends} == {("error", "invalid")}
    assert sends[0].fields["message"] == (
        f"a gather's payloads take {2 * half} bytes together, more than the {GATHER_BYTES} bytes one "
        f"barrier may carry (worker 0: {half}, worker 1: {half})")
    assert job.state._ranks.barrier.waiting == {}       # the scheduler holds none of it
    assert job.state.failure is None                    # the job goes on: the next barrier passes
    for rank in range(3):
        _, sends = job.request(f"worker-{rank}", "barrier", token="u", data=b"ok")
    assert {s.op for s in sends} == {"barrier_done"}


def test_the_budget_shrinks_with_the_waiters_so_that_one_barriers_replies_stay_bounded():
    assert gather_budget(1) == gather_budget(2) == GATHER_BYTES
    for waiters in (1, 2, 64, 100, 1000, 5000):
        assert gather_budget(waiters) * waiters <= max(GATHER_SEND_BYTES, GATHER_BYTES)
    assert gather_budget(1000) == GATHER_SEND_BYTES // 1000
    # the scheduler applies it for the members of the job: 100 workers, 671 KiB together
    job = Job(workers=100)
    job.form()
    too_much = gather_budget(100) + 1
    req_id, sends = job.request("worker-0", "barrier", token="t", data=b"x" * too_much)
    error(sends, "invalid", f"data of {too_much} bytes exceeds the {gather_budget(100)} bytes", req_id)


PAYLOADS = st.one_of(st.none(), st.binary(max_size=64), st.integers(0, 3).map(lambda k: b"p" * (GATHER_BYTES // 3 * k)),
                     st.text(max_size=3), st.integers(-2 ** 63, 2 ** 64 - 1), st.lists(st.binary(max_size=2), max_size=2))


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["t", "u"]), PAYLOADS), min_size=1, max_size=12))
def test_random_payloads_never_break_the_scheduler_nor_exceed_its_bound(arrivals):
    job = Job(workers=3)
    job.form()
    for rank, token, data in arrivals:
        fields = {"token": token} if data is None else {"token": token, "data": data}
        _, sends = job.request(f"worker-{rank}", "barrier", **fields)
        assert job.state.failure is None
        for send in sends:
            assert send.op in ("barrier_done", "error"), send
            assert send.op == "barrier_done" or send.fields["kind"] in ("invalid", "mismatch"), send
            if "data" in send.fields:
                assert len(send.fields["data"]) == 3 and sum(map(len, send.fields["data"])) <= GATHER_BYTES
            wire.decode(wire.encode(send.op, **send.fields))     # every answer fits a control frame
        kept = [w[3] for w in job.state._ranks.barrier.waiting.values() if w[3] is not None]
        assert sum(map(len, kept)) <= GATHER_BYTES


# -- live, with the job's secret -------------------------------------------------------------
SECRET = new_secret()


def job_of(workers: int, security: Security):
    """A started scheduler and its registered server and workers (all holding ``security``)."""
    sched = Scheduler(workers, 1, security=security, **FAST).start()
    nodes = [Membership(role="server", rank=0, scheduler=("127.0.0.1", sched.port), security=security, **FAST)]
    nodes += [Membership(role="worker", rank=r, scheduler=("127.0.0.1", sched.port), security=security, **FAST)
              for r in range(workers)]
    results = run_all([node.register for node in nodes], timeout=DEADLINE)
    assert not [r for r in results if isinstance(r, BaseException)], results
    return sched, nodes[0], nodes[1:]


def close(sched, *nodes) -> None:
    for node in nodes:
        node.close()
    sched.close()


@pytest.mark.parametrize("secure", [False, True], ids=["plain-token", "curve"])
def test_data_larger_than_one_barrier_comes_back_whole_after_several_rounds(secure):
    sched, server, workers = job_of(3, Security(SECRET, secure))
    try:
        big = bytes(range(256)) * (GATHER_BYTES // 256) + b"tail"     # three rounds of 1/3 budget each...
        mine = [big, b"", b"x" * (gather_budget(3) // 3)]           # ...and a piece of exactly one round
        results = run_all([lambda w=w, d=d: w.allgather(d, "metrics", timeout=DEADLINE)
                           for w, d in zip(workers, mine)], timeout=DEADLINE)
        assert results == [((0, 1, 2), mine)] * 3
        assert sched.failure is None
    finally:
        close(sched, server, *workers)


def test_workers_that_gather_with_different_tokens_get_an_error_naming_each():
    sched, server, workers = job_of(2, Security(SECRET))
    try:
        results = run_all([lambda: workers[0].allgather(b"a", "loss", timeout=DEADLINE),
                           lambda: workers[1].allgather(b"b", "acc", timeout=DEADLINE)], timeout=DEADLINE)
        for result in results:
            assert isinstance(result, RendezvousError) and "workers disagree at a collective call" in str(result)
            assert "worker 0: 'loss gather" in str(result) and "worker 1: 'acc gather" in str(result)
    finally:
        close(sched, server, *workers)


@pytest.mark.parametrize("secure", [False, True], ids=["plain-token", "curve"])
@pytest.mark.parametrize("outsider", ["no-credentials", "another-secret", "other-mechanism"])
def test_a_peer_without_the_secret_gets_nothing_from_the_gather_and_cannot_add_to_it(secure, outsider):
    """The peer takes a worker's place (its node id, as if it had learned it) and sends
    a barrier with a forged payload while the workers gather: its handshake fails (the
    event ZeroMQ reports on its socket), the workers get their own payloads, and the
    peer never receives a frame."""
    sched, server, workers = job_of(2, Security(SECRET, secure))
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    peer.linger = 0
    try:
        {"no-credentials": Security(), "another-secret": Security(new_secret(), secure),
         "other-mechanism": Security(SECRET, not secure)}[outsider].connect(peer)
        events = peer.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                         | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        peer.connect(f"tcp://127.0.0.1:{sched.port}")
        forged = wire.encode("barrier", id=1, node=workers[0].node_id, token="metrics gather", data=b"forged")
        peer.send(forged)
        assert events.poll(int(DEADLINE * 1000)), "the peer's handshake did not fail"
        results = run_all([lambda w=w, r=r: w.allgather(f"rank {r}".encode(), "metrics", timeout=DEADLINE)
                           for r, w in enumerate(workers)], timeout=DEADLINE)
        assert results == [((0, 1), [b"rank 0", b"rank 1"])] * 2
        assert peer.poll(0) == 0, "the peer received something"
        assert sched.failure is None
        peer.disable_monitor()
        events.close(linger=0)
    finally:
        peer.close(linger=0)
        ctx.term()
        close(sched, server, *workers)
