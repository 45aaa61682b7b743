"""The scheduler's state machine without sockets, threads or clocks.

``Job`` drives a ``tracker.control.scheduler_state.SchedulerState`` the way the
socket loop in ``tracker.control.rendezvous`` does: one encoded control frame at
a time from a peer identity, launcher events and ticks, each with a time that
the test moves by hand; every call returns the messages to send, which the
tests check (``to``, ``only``). Node ``worker-1`` talks from the identity
``b"worker-1"`` and sends its heartbeats from ``b"hb:worker-1"``, as a node's
two sockets do.
"""

from __future__ import annotations

import itertools

import pytest

from tracker.control import wire
from tracker.control.records import Send
from tracker.control.scheduler_state import FINISH_GRACE, SchedulerState

TIMEOUT, INTERVAL, HB_TIMEOUT = 30.0, 1.0, 5.0


class Job:
    """A SchedulerState and a clock; node ``role-rank`` has pid 100 + its index."""

    def __init__(self, workers=2, servers=1):
        self.now = 0.0
        self.state = SchedulerState(workers, servers, now=self.now, timeout=TIMEOUT,
                                    heartbeat_interval=INTERVAL, heartbeat_timeout=HB_TIMEOUT)
        self.ids = itertools.count(1)
        self.workers, self.servers = workers, servers

    def frame(self, ident: bytes, frame: bytes) -> list[Send]:
        return self.state.receive(ident, frame, self.now)

    def request(self, node: str, op: str, **fields) -> tuple[int, list[Send]]:
        """``op`` from ``node``'s control socket; (its id, the messages to send)."""
        req_id = next(self.ids)
        return req_id, self.frame(node.encode(), wire.encode(op, id=req_id, node=node, **fields))

    def register(self, role: str, rank: int | None, node: str | None = None, **fields):
        node = node or f"{role}-{rank}"
        msg = {"role": role, "rank": rank, "host": "h", "addr": f"tcp://{node}", "pid": 100 + (rank or 0)}
        return self.request(node, "register", **{**msg, **fields})

    def beat(self, node: str) -> list[Send]:
        return self.frame(b"hb:" + node.encode(), wire.encode("heartbeat", node=node))

    def tick(self, seconds: float) -> list[Send]:
        self.now += seconds
        return self.state.tick(self.now)

    def form(self) -> list[str]:
        """Register every node (explicit ranks) and start its heartbeats; their names."""
        nodes = [f"server-{r}" for r in range(self.servers)] + [f"worker-{r}" for r in range(self.workers)]
        for node in nodes:
            self.beat(node)
            role, rank = node.split("-")
            _, sends = self.register(role, int(rank))
        assert {s.op for s in sends} == {"registered"}, sends
        return nodes


def to(sends: list[Send], ident: bytes) -> list[Send]:
    return [s for s in sends if s.ident == ident]


def only(sends: list[Send]) -> Send:
    assert len(sends) == 1, sends
    return sends[0]


def error(sends: list[Send], kind: str, text: str, req_id=None) -> None:
    send = only(sends)
    assert (send.op, send.fields["kind"]) == ("error", kind), send
    assert text in send.fields["message"], send
    assert send.fields["id"] == req_id, send


# -- registration ----------------------------------------------------------------------------
def test_registration_answers_everyone_at_once_with_ranks_and_the_address_book():
    job = Job(workers=2, servers=2)
    for role, rank in (("worker", 1), ("server", 1), ("worker", 0)):
        assert job.register(role, rank)[1] == []      # nobody is answered before the job formed
    req_id, sends = job.register("server", 0)
    assert len(sends) == 4 and {s.op for s in sends} == {"registered"}
    reply = only(to(sends, b"worker-1")).fields
    assert reply["rank"] == 1 and (reply["num_workers"], reply["num_servers"]) == (2, 2)
    assert reply["servers"] == ["tcp://server-0", "tcp://server-1"]      # by rank, not arrival
    assert reply["workers"] == ["h:100", "h:101"]
    # the workers' own endpoints, by rank (host groups: kvstore.hostgroup.group)
    assert reply["worker_addrs"] == ["tcp://worker-0", "tcp://worker-1"]
    assert only(to(sends, b"server-0")).fields["id"] == req_id


def test_without_launcher_ranks_registration_order_decides():
    job = Job(workers=2, servers=1)
    job.register("worker", None, node="late-is-first")
    job.register("server", None, node="s")
    _, sends = job.register("worker", None, node="second")
    assert only(to(sends, b"late-is-first")).fields["rank"] == 0
    assert only(to(sends, b"second")).fields["rank"] == 1


@pytest.mark.parametrize("first, second, text", [
    (("worker", 0), ("worker", 0), "two processes claim worker rank 0"),
    (("worker", 0), ("worker", None), "some workers set KVSTORE_RANK and some do not"),
    (("server", 0), ("server", 1), "server rank 1 is out of range: this job has 1 servers"),
    (("server", 0), ("scheduler", 0), "cannot register role 'scheduler'"),
])
def test_conflicting_registrations_are_refused_and_the_job_goes_on(first, second, text):
    job = Job(workers=2, servers=1)
    job.register(*first)
    req_id, sends = job.register(*second, node="intruder")
    error(sends, "invalid", text, req_id)
    assert job.state.failure is None


def test_a_registration_after_the_job_formed_is_one_too_many():
    job = Job(workers=1, servers=1)
    job.form()
    req_id, sends = job.register("worker", None, node="extra")
    error(sends, "invalid", "already has all its nodes; worker None is one too many", req_id)


def test_malformed_and_unknown_requests_get_an_error_naming_the_problem():
    job = Job()
    req_id, sends = job.register("worker", 0, pid="100")
    error(sends, "invalid", "an integer 'pid'", req_id)
    req_id, sends = job.request("worker-0", "registered")
    error(sends, "invalid", "unknown control op 'registered'", req_id)
    error(job.frame(b"x", b"\xc1"), "invalid", "undecodable control message")
    req_id, sends = job.request("never-registered", "barrier", token="t")
    error(sends, "invalid", "has not registered", req_id)
    assert job.state.failure is None


def test_registration_that_does_not_complete_in_time_aborts_naming_the_missing():
    job = Job(workers=2, servers=1)
    job.beat("worker-0")
    req_id, _ = job.register("worker", 0)
    for _ in range(int(TIMEOUT)):                         # alive, but alone until the deadline
        assert job.tick(INTERVAL) == []
        job.beat("worker-0")
    sends = job.tick(0.5)
    assert job.state.failure == ("registration did not complete within 30s (KVSTORE_TIMEOUT): "
                                 "1 of 2 workers registered (missing ranks 1); 0 of 1 servers registered")
    assert only(to(sends, b"hb:worker-0")).op == "abort"
    error(to(sends, b"worker-0"), "aborted", "registration did not complete", req_id)


# -- barriers --------------------------------------------------------------------------------
def test_a_barrier_releases_every_worker_once_all_arrived_with_one_token():
    job = Job(workers=2)
    job.form()
    first, sends = job.request("worker-0", "barrier", token="init")
    assert sends == []
    second, sends = job.request("worker-1", "barrier", token="init")
    assert {(s.ident, s.op, s.fields["id"]) for s in sends} == {
        (b"worker-0", "barrier_done", first), (b"worker-1", "barrier_done", second)}


def test_workers_that_disagree_at_a_barrier_all_get_each_others_tokens():
    job = Job(workers=2)
    job.form()
    job.request("worker-1", "barrier", token="init b")
    _, sends = job.request("worker-0", "barrier", token="init a")
    assert len(sends) == 2
    for send in sends:
        assert send.fields["kind"] == "mismatch"
        assert send.fields["message"] == ("workers disagree at a collective call: worker 1 differs from worker 0: "
                                          "worker 0: 'init a'; worker 1: 'init b'")


def test_a_barrier_deadline_fails_every_waiter_naming_the_absent_worker():
    job = Job(workers=3)
    nodes = job.form()
    for node in ("worker-0", "worker-2"):
        job.request(node, "barrier", token="step", timeout=2.0)
    assert job.tick(1.0) == []
    for node in nodes:                                    # everyone is alive, just not there
        job.beat(node)
    sends = job.tick(1.5)
    assert {s.ident for s in sends} == {b"worker-0", b"worker-2"}
    for send in sends:
        assert send.fields["kind"] == "timeout"
        assert "worker 1 (pid 101 on h) did not arrive (workers 0, 2 waited)" in send.fields["message"]
    assert job.state.failure is None                      # a barrier timeout is not an abort


def test_a_barrier_cannot_complete_once_a_worker_finished():
    job = Job(workers=2)
    job.form()
    req_id, _ = job.request("worker-0", "barrier", token="t")
    _, sends = job.request("worker-1", "finish")
    assert only(to(sends, b"worker-1")).op == "finished"
    error(to(sends, b"worker-0"), "invalid", "worker 1 (pid 101 on h) finished (called close())", req_id)
    req_id, sends = job.request("worker-0", "barrier", token="t")
    error(sends, "invalid", "already finished", req_id)


def test_servers_take_no_part_in_barriers():
    job = Job()
    job.form()
    req_id, sends = job.request("server-0", "barrier", token="t")
    error(sends, "invalid", "only workers take part in barriers", req_id)


# -- liveness --------------------------------------------------------------------------------
def test_heartbeats_keep_nodes_alive_and_a_missed_deadline_aborts_naming_the_node():
    job = Job(workers=2)
    nodes = job.form()
    for _ in range(10):                                   # 10 s of regular heartbeats
        assert job.tick(INTERVAL) == []
        for node in nodes:
            job.beat(node)
    for _ in range(5):                                    # worker 1 goes silent
        job.tick(INTERVAL)
        for node in nodes:
            if node != "worker-1":
                job.beat(node)
    sends = job.tick(0.5)
    assert job.state.failure.startswith("worker 1 (pid 101 on h) sent no heartbeat for 5.5s")
    assert "KVSTORE_HEARTBEAT_TIMEOUT=5" in job.state.failure
    assert {s.ident for s in sends if s.op == "abort"} == {b"hb:" + n.encode() for n in nodes}
    assert only(job.beat("worker-0")).op == "abort"       # late heartbeats hear it too
    req_id, sends = job.request("worker-0", "barrier", token="t")
    error(sends, "aborted", "sent no heartbeat", req_id)


def test_after_an_abort_the_loop_may_stop_once_the_nodes_had_time_to_hear_it():
    job = Job()
    job.form()
    job.state.abort("the launcher stopped the job", job.now)
    job.tick(2 * INTERVAL)
    assert not job.state.over
    job.tick(1.5)
    assert job.state.over


# -- finish and shutdown ---------------------------------------------------------------------
def test_when_every_worker_finished_the_servers_shut_down_and_the_job_is_over():
    job = Job(workers=2, servers=1)
    job.form()
    job.request("worker-0", "finish")
    assert job.tick(FINISH_GRACE + 0.1) == [Send(b"hb:server-0", "workers_finished", {"ranks": [0]})]
    assert only(job.beat("server-0")).fields == {"workers_finished": [0], "incarnation": job.state.incarnation}
    _, sends = job.request("worker-1", "finish")
    assert Send(b"hb:server-0", "shutdown", {}) in sends
    assert only(job.beat("server-0")).op == "shutdown"
    job.request("server-0", "finish")
    job.tick(0.1)
    assert job.state.over and job.state.failure is None


def test_a_server_that_dies_after_the_shutdown_still_ends_the_job():
    job = Job(workers=1, servers=1)
    job.form()
    job.request("worker-0", "finish")
    job.tick(HB_TIMEOUT + 0.5)
    assert "server 0 (pid 100 on h) sent no heartbeat for 5.5s after it was told to shut down" \
        in job.state.failure


# -- failures reported by nodes and launchers ------------------------------------------------
def test_a_node_that_fails_aborts_the_job_and_the_first_failure_stays():
    job = Job(workers=2)
    job.form()
    req_id, sends = job.request("worker-1", "fail", reason="boom")
    assert job.state.failure == "worker 1 (pid 101 on h) failed: boom"
    assert Send(b"worker-1", "finished", {"id": req_id}) in sends
    assert {s.ident for s in sends if s.op == "abort"} == {b"hb:worker-0", b"hb:server-0"}
    job.request("worker-0", "fail", reason="a consequence")
    assert job.state.failure == "worker 1 (pid 101 on h) failed: boom"


@pytest.mark.parametrize("role, rank, code, text", [
    ("worker", 1, 3, "worker 1 (pid 101 on h) exited with status 3"),
    ("server", 0, -9, "server 0 (pid 100 on h) was killed by SIGKILL"),
    ("server", 0, 0, "server 0 (pid 100 on h) exited while workers were still running"),
])
def test_a_launcher_reporting_an_exit_aborts_naming_the_process(role, rank, code, text):
    job = Job(workers=2)
    job.form()
    job.state.node_exited(role, rank, code, job.now)
    assert job.state.failure == text


def test_an_exit_before_the_job_formed_aborts_and_a_clean_exit_after_finish_does_not():
    job = Job(workers=1)
    job.state.node_exited("worker", 0, 0, job.now)
    assert job.state.failure == "worker 0 exited with status 0 before the job formed"
    job = Job(workers=1)
    job.form()
    job.request("worker-0", "finish")
    job.state.node_exited("worker", 0, 0, job.now)
    assert job.state.failure is None


def test_an_empty_job_is_refused():
    with pytest.raises(ValueError, match="at least one worker and one server"):
        SchedulerState(0, 1, now=0.0, timeout=1, heartbeat_interval=1, heartbeat_timeout=1)


def test_a_job_that_has_not_formed_is_told_to_its_waiting_nodes_after_the_notice_not_the_timeout():
    from tracker.control.scheduler_state import FORMING_NOTICE
    job = Job(workers=2, servers=1)
    for rank in range(2):
        job.register("worker", rank)
    for _ in range(int(FORMING_NOTICE) - 1):              # alive (heartbeats), waiting
        job.tick(1.0)
        assert "forming" not in only(job.beat("worker-0")).fields
        job.beat("worker-1")
    job.tick(1.5)
    said = only(job.beat("worker-1")).fields["forming"]
    assert said.startswith(f"the job has not formed {FORMING_NOTICE + 0.5:.0f}s after the scheduler started: "
                           "2 of 2 workers registered; 0 of 1 servers registered. ")
    assert "KVSTORE_NUM_SERVERS" in said and "(KVSTORE_TIMEOUT)" in said
    assert job.state.failure is None                      # only said: the job goes on waiting
    _, sends = job.register("server", 0)                  # a late server forms it
    assert {s.op for s in sends} == {"registered"} and len(sends) == 3
    assert "forming" not in only(job.beat("worker-0")).fields
