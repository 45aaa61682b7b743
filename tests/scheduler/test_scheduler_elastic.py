"""Elastic jobs in the scheduler's state machine, without sockets or clocks.

Driven like tests/scheduler/test_scheduler_state.py (its ``Job``: node ``worker-1`` talks from
identity ``b"worker-1"``, heartbeats from ``b"hb:worker-1"``, pid 100 + rank; time
moves by hand), with ``elastic=(MIN, MAX)``: workers that fail, go silent, exit or
finish *leave* while MIN remain, and workers that register later *join* a vacant
rank, answered once every server acknowledged the epoch that lists their process.
A joiner is *pending* (no member: no barrier or round waits for it) until a
barrier of every member finds it waiting with their token: there it becomes a
member in a new epoch, and that barrier ends once every server holds the epoch.
"""

from __future__ import annotations

import logging

import pytest

from test_scheduler_state import HB_TIMEOUT, INTERVAL, TIMEOUT, Job, error, only, to
from tracker.control import env, wire
from tracker.control.elastic import PROGRESS_BYTES
from tracker.control.records import Send
from tracker.control.rendezvous import Scheduler
from tracker.control.scheduler_state import FINISH_GRACE, SchedulerState

KILLED = -9


class Elastic(Job):
    """A Job whose state is elastic; :meth:`form` leaves every node beating."""

    def __init__(self, workers=2, servers=1, elastic=(1, 4)):
        super().__init__(workers, servers)
        self.state = SchedulerState(workers, servers, now=self.now, timeout=TIMEOUT,
                                    heartbeat_interval=INTERVAL, heartbeat_timeout=HB_TIMEOUT,
                                    elastic=elastic)

    def server_beat(self, node="server-0", epoch=None) -> list[Send]:
        fields = {} if epoch is None else {"epoch": epoch}
        return self.frame(b"hb:" + node.encode(), wire.encode("heartbeat", node=node, **fields))

    def join(self, node: str, rank=None, pid=500) -> tuple[int, list[Send]]:
        """``node`` (not yet beating) registers with the running job."""
        self.beat(node)
        return self.request(node, "register", role="worker", rank=rank, host="h",
                            addr="", pid=pid)

    def joined(self, node: str, rank=None, pid=500) -> Send:
        """``node`` joins and every server acknowledges: its ``registered``."""
        _, sends = self.join(node, rank, pid)
        return only(to(sends + self.servers_hold(), node.encode()))

    def servers_hold(self, epoch=None) -> list[Send]:
        """A heartbeat of every server carrying ``epoch`` (default: the scheduler's)."""
        epoch = self.state.epoch if epoch is None else epoch
        return [s for r in range(self.servers) for s in self.server_beat(f"server-{r}", epoch=epoch)]

    def wait(self, nodes, token="b", **fields) -> dict[bytes, int]:
        """``nodes`` wait at a barrier, in this order, none answered yet: their request ids."""
        ids = {}
        for node in nodes:
            ids[node.encode()], sends = self.request(node, "barrier", token=token, **fields)
            assert not [s for s in sends if s.op != "members"], sends
        return ids

    def meet(self, nodes, token="b") -> list[Send]:
        """``nodes`` (a joiner among them) wait at a barrier, then every server holds
        the new epoch: the ``barrier_done`` sends, by identity."""
        self.wait(nodes, token)
        return by_ident(s for s in self.servers_hold() if s.op == "barrier_done")


def by_ident(sends) -> list[Send]:
    return sorted(sends, key=lambda s: s.ident)


def done(ids: dict[bytes, int], **fields) -> list[Send]:
    """The ``barrier_done`` to each waiter of ``ids`` with ``fields``, by identity."""
    return by_ident(Send(ident, "barrier_done", {"id": req_id, **fields}) for ident, req_id in ids.items())


def members_sent(sends, epoch, members, workers) -> None:
    """``sends`` hold exactly one ``members`` message, to server 0's heartbeat socket."""
    told = [s for s in sends if s.op == "members"]
    assert told == [Send(b"hb:server-0", "members",
                         {"epoch": epoch, "members": members, "workers": workers})], sends


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# -- configuration ---------------------------------------------------------------------------
def test_kvstore_elastic_is_min_colon_max_or_unset():
    assert env.read({"KVSTORE_ELASTIC": "2:4"}).elastic == (2, 4)
    assert env.read({}).elastic is None and env.Settings().elastic is None
    for text, why in (("4:2", "must have 1 <= MIN <= MAX"), ("0:3", "must have 1 <= MIN <= MAX"),
                      ("3", "must be MIN:MAX, two integers"), ("1:x", "must be MIN:MAX, two integers")):
        with pytest.raises(env.EnvError, match=f"KVSTORE_ELASTIC='{text}' is invalid: {why}"):
            env.read({"KVSTORE_ELASTIC": text})


def test_the_scheduler_of_a_job_takes_its_elastic_setting():
    settings = env.read({"KVSTORE_ELASTIC": "2:3"})
    sched = Scheduler.for_job(settings, 2, 1)
    try:
        assert sched.elastic == (2, 3)
    finally:
        sched.close()
    with pytest.raises(ValueError, match="--elastic 2:3 does not fit a job of 4 workers"):
        Scheduler.for_job(settings, 4, 1)


@pytest.mark.parametrize("workers, elastic", [(1, (2, 4)), (5, (2, 4)), (2, (0, 4)), (2, ("1", 4))])
def test_the_initial_workers_must_lie_within_min_and_max(workers, elastic):
    with pytest.raises(ValueError, match=f"--elastic {elastic[0]}:{elastic[1]} does not fit a job of "
                                         f"{workers} workers: it needs 1 <= MIN <="):
        SchedulerState(workers, 1, now=0.0, timeout=1, heartbeat_interval=1, heartbeat_timeout=1,
                       elastic=elastic)


# -- registration ----------------------------------------------------------------------------
def test_registered_tells_worker_ranks_members_epoch_progress_and_the_elastic_bounds():
    job = Elastic(workers=2, servers=1, elastic=(1, 4))
    job.register("server", 0)
    job.register("worker", 1)
    req_id, sends = job.register("worker", 0)
    assert only(to(sends, b"worker-0")).fields == {
        "id": req_id, "rank": 0, "num_workers": 2, "num_servers": 1, "servers": ["tcp://server-0"],
        "workers": ["h:100", "h:101", "", ""], "worker_ranks": 4, "members": [0, 1], "epoch": 0,
        "joined": False, "progress": {}, "elastic": [1, 4],
        "worker_addrs": ["tcp://worker-0", "tcp://worker-1", "", ""], "incarnation": job.state.incarnation,
        "barriers": 0, "restartable": False}
    assert (job.state.members, job.state.epoch) == ([0, 1], 0)


def test_without_elastic_registered_has_the_same_fields_with_every_worker_a_member():
    job = Job(workers=2, servers=1)
    assert job.state.members == []
    job.register("server", 0)
    req_id, _ = job.register("worker", 1)
    _, sends = job.register("worker", 0)
    assert only(to(sends, b"worker-1")).fields == {
        "id": req_id, "rank": 1, "num_workers": 2, "num_servers": 1, "servers": ["tcp://server-0"],
        "workers": ["h:100", "h:101"], "worker_ranks": 2, "members": [0, 1], "epoch": 0,
        "joined": False, "progress": {}, "elastic": None,
        "worker_addrs": ["tcp://worker-0", "tcp://worker-1"], "incarnation": job.state.incarnation,
        "barriers": 0, "restartable": False}
    assert (job.state.members, job.state.epoch) == ([0, 1], 0)


# -- joins -----------------------------------------------------------------------------------
def test_a_joiner_takes_the_lowest_vacant_rank_and_is_answered_once_the_server_acknowledged(caplog):
    caplog.set_level(logging.INFO, logger="tracker.control")
    job = Elastic(workers=2, elastic=(1, 4))
    job.form()
    req_id, sends = job.join("worker-new")
    # the servers learn its process (it may map their memory), but it is no member yet
    members_sent(sends, 1, [0, 1], ["h:100", "h:101", "h:500", ""])
    assert not to(sends, b"worker-new")                    # not before the servers hold epoch 1
    assert (job.state.members, job.state.epoch) == ([0, 1], 1)
    assert only(job.server_beat(epoch=0)) == Send(b"hb:server-0", "ack", {
        "incarnation": job.state.incarnation, "epoch": 1, "members": [0, 1], "workers": ["h:100", "h:101", "h:500", ""]})
    sends = job.server_beat(epoch=1)
    reply = only(to(sends, b"worker-new")).fields
    assert reply == {"id": req_id, "rank": 2, "num_workers": 2, "num_servers": 1,
                     "servers": ["tcp://server-0"], "workers": ["h:100", "h:101", "h:500", ""],
                     "worker_ranks": 4, "members": [0, 1], "epoch": 1, "joined": True, "progress": {},
                     "elastic": [1, 4], "worker_addrs": ["tcp://worker-0", "tcp://worker-1", "", ""],
                     "incarnation": job.state.incarnation, "barriers": 0, "restartable": False}
    assert ("worker 2 (pid 500 on h) joins the job (members 0, 1, epoch 1); it becomes a member at "
            "its first barrier") in caplog.text
    assert "worker 2 (pid 500 on h) joined the job: every server holds epoch 1" in caplog.text
    assert [s.op for s in job.server_beat(epoch=1)] == ["ack"]         # answered only once


def test_a_joiner_waits_for_every_server():
    job = Elastic(workers=1, servers=2, elastic=(1, 2))
    job.form()
    _, sends = job.join("worker-new")
    assert {s.ident for s in sends if s.op == "members"} == {b"hb:server-0", b"hb:server-1"}
    assert not to(job.server_beat("server-1", epoch=1), b"worker-new")
    assert only(to(job.server_beat("server-0", epoch=1), b"worker-new")).fields["rank"] == 1


def test_a_joiner_gets_its_requested_rank_when_that_rank_is_vacant():
    job = Elastic(workers=2, elastic=(1, 4))
    job.form()
    reply = job.joined("worker-new", rank=3).fields
    assert (reply["rank"], reply["workers"]) == (3, ["h:100", "h:101", "", "h:500"])
    assert job.state.members == [0, 1]                    # pending: it holds rank 3, no member
    reply = job.joined("worker-other", pid=501).fields    # the lowest rank neither holds
    assert (reply["rank"], reply["workers"]) == (2, ["h:100", "h:101", "h:501", "h:500"])
    req_id, sends = job.join("worker-third", rank=3, pid=502)
    error(sends, "invalid", "worker rank 3 is taken by worker 3 (pid 500 on h): a joining worker "
                            "needs a vacant rank (none is vacant) or none", req_id)


@pytest.mark.parametrize("rank, text", [
    (1, "worker rank 1 is taken by worker 1 (pid 101 on h): a joining worker needs a vacant rank "
        "(vacant: 2) or none"),
    (3, "worker rank 3 is out of range: this elastic job has 3 worker ranks (--elastic 1:3)"),
    ("2", "worker rank '2' is out of range"),
])
def test_a_joiner_that_asks_for_a_rank_it_cannot_have_is_refused(rank, text):
    job = Elastic(workers=2, elastic=(1, 3))
    job.form()
    req_id, sends = job.join("worker-new", rank=rank)
    error(sends, "invalid", text, req_id)
    assert (job.state.members, job.state.epoch, job.state.failure) == ([0, 1], 0, None)


def test_a_joiner_finds_the_job_full():
    job = Elastic(workers=2, elastic=(1, 2))
    job.form()
    req_id, sends = job.join("worker-new")
    error(sends, "invalid", "the elastic job is full: all 2 worker ranks are in use (--elastic 1:2); "
                            "this worker cannot join", req_id)


def test_a_joiner_the_servers_do_not_acknowledge_in_time_gets_an_error_naming_them(caplog):
    job = Elastic(workers=1, servers=2, elastic=(1, 3))
    job.form()
    req_id, _ = job.join("worker-new")
    for _ in range(int(TIMEOUT)):
        job.tick(INTERVAL)
        job.beat("worker-0")
        job.beat("worker-new")
        job.server_beat("server-0", epoch=1)
        job.server_beat("server-1", epoch=0)                # holds the old membership
    sends = job.tick(0.5)
    error(to(sends, b"worker-new"), "timeout",
          "worker 1 (pid 500 on h) could not join: server 1 (pid 101 on h) (at epoch 0) did not "
          "acknowledge membership epoch 1 within 30s (KVSTORE_TIMEOUT)", req_id)
    assert (job.state.members, job.state.epoch, job.state.failure) == ([0], 1, None)
    assert warnings(caplog) == [
        "worker 1 (pid 500 on h) left before it became a member: the servers did not acknowledge "
        "its join in time; the members stay 0"]
    assert only(job.beat("worker-new")) == Send(b"hb:worker-new", "abort", {
        "reason": "worker 1 was removed from the job: the servers did not acknowledge its join in time"})


def test_a_registration_after_the_job_ended_cannot_join():
    job = Elastic(workers=1, elastic=(1, 2))
    job.form()
    job.request("worker-0", "finish")
    req_id, sends = job.join("worker-new")
    error(sends, "invalid", "the job is ending (every worker finished or left): no worker can "
                            "join it now", req_id)


def test_servers_still_join_only_at_formation():
    job = Elastic(workers=1, elastic=(1, 2))
    job.form()
    req_id, sends = job.register("server", 0, node="server-extra")
    error(sends, "invalid", "the job already has all its nodes; server 0 is one too many", req_id)


def test_an_abort_answers_a_held_barrier_and_a_waiting_joiner():
    job = Elastic(workers=1, elastic=(1, 3))
    job.form()
    job.joined("worker-new")
    ids = job.wait(["worker-new", "worker-0"])            # held: the server holds epoch 1
    ids[b"worker-late"], sends = job.join("worker-late", pid=501)
    assert not to(sends, b"worker-late")
    reason = "the launcher stopped the job"
    sends = job.state.abort(reason, job.now)
    assert by_ident(s for s in sends if s.op == "error") == by_ident(
        Send(ident, "error", {"id": req_id, "kind": "aborted", "message": reason})
        for ident, req_id in ids.items())
    assert {s.ident for s in sends if s.op == "abort"} == {
        b"hb:server-0", b"hb:worker-0", b"hb:worker-new", b"hb:worker-late"}
    assert not [s for s in job.servers_hold(3) if s.op != "abort"]   # nothing held is sent later


# -- leaves ----------------------------------------------------------------------------------
LEAVES = {
    "killed": (lambda job: job.state.node_exited("worker", 1, KILLED, job.now), "was killed by SIGKILL"),
    "fail": (lambda job: job.request("worker-1", "fail", reason="boom")[1], "failed: boom"),
    "silent": (lambda job: silence(job, "worker-1"),
               "sent no heartbeat for 5.5s (KVSTORE_HEARTBEAT_TIMEOUT=5); it is dead or stuck"),
}


def silence(job: Job, quiet: str) -> list[Send]:
    """Every node but ``quiet`` beats until ``quiet`` was silent too long."""
    sends = []
    for _ in range(5):
        sends += job.tick(INTERVAL)
        for node in ("server-0", "worker-0", "worker-1", "worker-2"):
            if node != quiet:
                sends += job.beat(node)
    return sends + job.tick(0.5)


@pytest.mark.parametrize("how", sorted(LEAVES))
def test_a_failing_worker_leaves_and_the_job_goes_on(how, caplog):
    job = Elastic(workers=3, elastic=(2, 4))
    job.form()
    leave, why = LEAVES[how]
    sends = leave(job)
    assert job.state.failure is None
    assert (job.state.members, job.state.epoch) == ([0, 2], 1)
    members_sent(sends, 1, [0, 2], ["h:100", "", "h:102", ""])
    assert warnings(caplog) == [
        f"worker 1 (pid 101 on h) left the job: {why}; 2 workers remain (members 0, 2, epoch 1): "
        "sync rounds now complete without it and the effective batch size changes"]
    # it was removed: what it still sends is answered with the reason, to it alone
    removed = f"worker 1 was removed from the job: {why}"
    assert only(job.beat("worker-1")) == Send(b"hb:worker-1", "abort", {"reason": removed})
    req_id, sends = job.request("worker-1", "barrier", token="t")
    error(sends, "aborted", removed, req_id)


@pytest.mark.parametrize("how", sorted(LEAVES))
def test_a_failure_that_leaves_fewer_than_min_workers_aborts_naming_it(how):
    job = Elastic(workers=2, elastic=(2, 4))
    job.form()
    leave, why = LEAVES[how]
    sends = leave(job)
    reason = (f"worker 1 (pid 101 on h) {why}; 1 worker remains, fewer than the elastic minimum 2 "
              "(--elastic 2:4)")
    assert job.state.failure == reason
    assert {s.ident for s in sends if s.op == "abort"} == {b"hb:worker-0", b"hb:server-0"}


@pytest.mark.parametrize("how", ["finish", "exit 0"])
def test_a_clean_leave_never_aborts_even_below_min(how, caplog):
    caplog.set_level(logging.INFO)
    job = Elastic(workers=2, elastic=(2, 4))
    job.form()
    if how == "finish":
        req_id, sends = job.request("worker-1", "finish")
        assert Send(b"worker-1", "finished", {"id": req_id}) in sends
        why = "finished (called close())"
    else:
        sends = job.state.node_exited("worker", 1, 0, job.now)
        why = "exited with status 0 without finishing (close())"
    assert job.state.failure is None and job.state.members == [0]
    members_sent(sends, 1, [0], ["h:100", "", "", ""])
    assert warnings(caplog) == []          # no failure: news, not a warning
    assert f"worker 1 (pid 101 on h) left the job: {why}; 1 worker remains (members 0, epoch 1): " \
        "sync rounds now complete without it and the effective batch size changes" in \
        [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]


def test_a_finished_worker_is_acknowledged_not_told_it_was_removed():
    job = Elastic(workers=2, elastic=(1, 4))
    job.form()
    job.request("worker-1", "finish")
    assert only(job.beat("worker-1")) == Send(b"hb:worker-1", "ack", {"incarnation": job.state.incarnation})
    _, sends = job.request("worker-1", "fail", reason="an error at exit")   # it left already
    assert [s.op for s in sends] == ["finished"]
    assert (job.state.members, job.state.epoch, job.state.failure) == ([0], 1, None)
    assert only(job.beat("worker-1")) == Send(b"hb:worker-1", "ack", {"incarnation": job.state.incarnation})
    req_id, sends = job.request("worker-1", "barrier", token="t")
    error(sends, "invalid", "worker 1 (pid 101 on h) left the job (it finished): it takes no part "
                            "in its barriers", req_id)


def test_a_launcher_reads_which_workers_closed_and_how_many_exits_were_handled():
    """What tracker.launcher judges a failed worker's exit by: the workers that said
    ``finish`` from close() (not from an exit handler) and the count of exits handled (each exit, even one that
    changes nothing, counts: the launcher waits for its own exit's number)."""
    job = Elastic(workers=3, elastic=(1, 4))
    job.form()
    assert (job.state.exits_heard, job.state.closed_workers) == (0, frozenset())
    job.request("worker-2", "finish", closed=False)      # an exit handler's: judged by its status
    job.request("worker-1", "finish", closed=True)
    assert job.state.closed_workers == {1}
    job.state.node_exited("worker", 1, 3, job.now)      # it failed after close(): no member any more
    job.state.node_exited("worker", 2, 9, job.now)      # failed without close()
    assert (job.state.exits_heard, job.state.closed_workers) == (2, frozenset({1}))
    assert job.state.members == [0] and job.state.failure is None


def test_servers_hear_members_never_workers_finished():
    job = Elastic(workers=2, elastic=(1, 4))
    job.form()
    job.request("worker-1", "finish")
    assert [s for s in job.tick(FINISH_GRACE + 0.1) if s.op == "workers_finished"] == []
    assert only(job.server_beat(epoch=1)) == Send(b"hb:server-0", "ack", {
        "incarnation": job.state.incarnation, "epoch": 1, "members": [0], "workers": ["h:100", "", "", ""]})


def test_when_every_worker_finished_or_left_the_servers_shut_down(caplog):
    caplog.set_level(logging.INFO, logger="tracker.control")
    job = Elastic(workers=2, elastic=(1, 4))
    job.form()
    job.state.node_exited("worker", 0, 3, job.now)
    _, sends = job.request("worker-1", "finish")
    assert Send(b"hb:server-0", "shutdown", {}) in sends
    assert "worker 1 (pid 101 on h) left the job: finished (called close()); no worker remains" \
        in caplog.text
    assert "all workers finished or left; shutting down the servers" in caplog.text
    job.request("server-0", "finish")
    job.tick(0.1)
    assert job.state.over and job.state.failure is None


def test_a_server_failure_still_aborts_an_elastic_job():
    job = Elastic(workers=2, elastic=(1, 4))
    job.form()
    job.state.node_exited("server", 0, 1, job.now)
    assert job.state.failure == "server 0 (pid 100 on h) exited with status 1"


def test_an_exit_is_charged_to_the_worker_holding_the_rank_now(caplog):
    """A replacement holds the rank of the worker that left; the launcher reports
    exits by rank: a second exit of rank 1 is the replacement's."""
    job = Elastic(workers=3, elastic=(1, 4))
    job.form()
    job.state.node_exited("worker", 1, KILLED, job.now)                       # epoch 1
    assert job.joined("worker-replacement", rank=1, pid=777).fields["rank"] == 1   # epoch 2
    assert len(job.meet(["worker-replacement", "worker-0", "worker-2"])) == 3      # a member: 3
    job.state.node_exited("worker", 1, 3, job.now)
    assert warnings(caplog)[-1].startswith("worker 1 (pid 777 on h) left the job: exited with status 3; "
                                           "2 workers remain (members 0, 2, epoch 4)")
    job.state.node_exited("worker", 1, 1, job.now)     # an exit of no member: nothing changes
    assert warnings(caplog)[-1] == ("worker 1 (pid 777 on h) exited with status 1; it was no member "
                                    "(it had left, or never joined)")
    assert (job.state.epoch, job.state.failure) == (4, None)


# -- barriers --------------------------------------------------------------------------------
def test_barrier_done_carries_the_epoch_members_and_progress_elastic_or_not():
    job = Job(workers=2)
    job.form()
    first, _ = job.request("worker-0", "barrier", token="t")
    second, sends = job.request("worker-1", "barrier", token="t")
    assert sorted(sends, key=lambda s: s.ident) == [
        Send(b"worker-0", "barrier_done", {"id": first, "epoch": 0, "members": [0, 1], "progress": {}, "barrier": 1}),
        Send(b"worker-1", "barrier_done", {"id": second, "epoch": 0, "members": [0, 1], "progress": {}, "barrier": 1})]


def test_a_leave_completes_the_barrier_the_others_wait_at():
    job = Elastic(workers=3, elastic=(1, 4))
    job.form()
    first, _ = job.request("worker-0", "barrier", token="step")
    second, _ = job.request("worker-2", "barrier", token="step")
    sends = job.state.node_exited("worker", 1, KILLED, job.now)
    done = {(s.ident, s.fields["id"]): s.fields for s in sends if s.op == "barrier_done"}
    assert done == {(b"worker-0", first): {"id": first, "epoch": 1, "members": [0, 2], "progress": {}, "barrier": 1},
                    (b"worker-2", second): {"id": second, "epoch": 1, "members": [0, 2], "progress": {}, "barrier": 1}}


def test_a_finished_worker_does_not_fail_the_barrier_of_the_others():
    job = Elastic(workers=2, elastic=(1, 4))
    job.form()
    job.request("worker-1", "finish")
    req_id, sends = job.request("worker-0", "barrier", token="t")
    assert only(sends) == Send(b"worker-0", "barrier_done",
                               {"id": req_id, "epoch": 1, "members": [0], "progress": {}, "barrier": 1})


def test_a_pending_joiner_is_no_member_and_the_members_barrier_does_not_wait_for_it():
    job = Elastic(workers=2, elastic=(1, 4))
    job.form()
    reply = job.joined("worker-new").fields
    assert (reply["members"], reply["num_workers"], job.state.members, job.state.epoch) == (
        [0, 1], 2, [0, 1], 1)
    ids = job.wait(["worker-0"])
    ids[b"worker-1"], sends = job.request("worker-1", "barrier", token="b")
    assert by_ident(sends) == done(ids, epoch=1, members=[0, 1], progress={}, barrier=1)   # at once: no epoch


def test_a_joiner_at_the_members_barrier_becomes_a_member_once_every_server_holds_the_epoch(caplog):
    caplog.set_level(logging.INFO, logger="tracker.control")
    job = Elastic(workers=2, servers=2, elastic=(1, 4))
    job.form()
    job.joined("worker-new")                                           # rank 2, epoch 1
    ids = job.wait(["worker-new", "worker-0"])
    ids[b"worker-1"], sends = job.request("worker-1", "barrier", token="b")
    news = {"epoch": 2, "members": [0, 1, 2], "workers": ["h:100", "h:101", "h:500", ""]}
    assert sends == [Send(b"hb:server-0", "members", news), Send(b"hb:server-1", "members", news)]
    assert (job.state.members, job.state.epoch) == ([0, 1, 2], 2)
    assert ("worker 2 (pid 500 on h) met the others at a barrier: member from epoch 2 "
            "(members 0, 1, 2)") in caplog.text
    # held until every server holds epoch 2: no push after it may reach a server whose
    # rounds do not wait for the new member (an old epoch's ack repairs a lost `members`)
    assert job.server_beat("server-0", epoch=1) == [Send(b"hb:server-0", "ack", {**news, "incarnation": job.state.incarnation})]
    assert job.server_beat("server-0", epoch=2) == [Send(b"hb:server-0", "ack", {**news, "incarnation": job.state.incarnation})]
    assert job.tick(INTERVAL) == []
    sends = job.server_beat("server-1", epoch=2)
    assert sends[0] == Send(b"hb:server-1", "ack", {**news, "incarnation": job.state.incarnation})
    assert by_ident(sends[1:]) == done(ids, epoch=2, members=[0, 1, 2], progress={}, barrier=1)
    assert job.servers_hold() == [Send(b"hb:server-0", "ack", {**news, "incarnation": job.state.incarnation}), Send(b"hb:server-1", "ack", {**news, "incarnation": job.state.incarnation})]
    # a member now: the next barrier waits for it, and ends at once (nobody joins)
    ids = job.wait(["worker-0", "worker-1"])
    ids[b"worker-new"], sends = job.request("worker-new", "barrier", token="b")
    assert by_ident(sends) == done(ids, epoch=2, members=[0, 1, 2], progress={}, barrier=2)


def test_a_barrier_the_servers_never_acknowledge_aborts_the_job_naming_them():
    job = Elastic(workers=1, servers=2, elastic=(1, 2))
    job.form()
    job.joined("worker-new")                                           # rank 1, epoch 1
    ids = job.wait(["worker-new", "worker-0"])                         # epoch 2, held
    for _ in range(int(TIMEOUT)):                                      # KVSTORE_TIMEOUT passes
        sends = job.tick(INTERVAL)
        for node in ("worker-0", "worker-new"):
            sends += job.beat(node)
        sends += job.server_beat("server-0", epoch=2) + job.server_beat("server-1", epoch=1)
        assert {s.op for s in sends} == {"ack"} and job.state.failure is None, sends
    sends = job.tick(0.5)
    reason = ("server 1 (pid 101 on h) did not acknowledge membership epoch 2 within 30s "
              "(KVSTORE_TIMEOUT): the workers that joined cannot start")
    assert job.state.failure == reason
    assert by_ident(s for s in sends if s.op == "error") == by_ident(
        Send(ident, "error", {"id": req_id, "kind": "aborted", "message": reason})
        for ident, req_id in ids.items())
    assert {s.ident for s in sends if s.op == "abort"} == {
        b"hb:server-0", b"hb:server-1", b"hb:worker-0", b"hb:worker-new"}


def test_a_joiner_at_another_barrier_than_the_members_stays_pending_and_waits_for_their_next():
    job = Elastic(workers=2, elastic=(1, 4))
    job.form()
    job.joined("worker-new")
    joiner = job.wait(["worker-new"], token="init", timeout=20.0)
    ids = job.wait(["worker-0"], token="step 3")
    ids[b"worker-1"], sends = job.request("worker-1", "barrier", token="step 3")
    assert by_ident(sends) == done(ids, epoch=1, members=[0, 1], progress={}, barrier=1)
    assert (job.state.members, job.state.epoch) == ([0, 1], 1)
    ids = job.wait(["worker-0", "worker-1"], token="init")            # it still waits: it joins
    assert (job.state.members, job.state.epoch) == ([0, 1, 2], 2)
    assert by_ident(s for s in job.servers_hold() if s.op == "barrier_done") == done(
        {**ids, **joiner}, epoch=2, members=[0, 1, 2], progress={}, barrier=2)


def test_a_joiner_that_waits_on_keeps_its_deadline():
    job = Elastic(workers=2, elastic=(1, 4))
    job.form()
    job.joined("worker-new")
    joiner = job.wait(["worker-new"], token="init", timeout=2.0)
    job.wait(["worker-0"], token="step 3")
    assert len(job.request("worker-1", "barrier", token="step 3")[1]) == 2   # passes without it
    assert job.tick(1.5) == []
    error(job.tick(1.0), "timeout", "a barrier ('init') timed out after 2s: worker 0 (pid 100 on h), "
                                    "worker 1 (pid 101 on h) did not arrive (worker 2 waited)",
          joiner[b"worker-new"])


def test_members_that_disagree_fail_the_barrier_of_a_waiting_joiner_which_stays_pending():
    job = Elastic(workers=2, elastic=(1, 4))
    job.form()
    job.joined("worker-new")
    ids = job.wait(["worker-new", "worker-0"], token="b")
    ids[b"worker-1"], sends = job.request("worker-1", "barrier", token="c")
    text = "workers disagree at a collective call: worker 1 differs from worker 0: worker 0: 'b'; worker 1: 'c'; worker 2: 'b'"
    assert by_ident(sends) == by_ident(Send(ident, "error", {"id": req_id, "kind": "mismatch",
                                                             "message": text})
                                       for ident, req_id in ids.items())
    assert (job.state.members, job.state.epoch) == ([0, 1], 1)


def test_a_joiner_alone_at_a_barrier_after_every_member_finished_becomes_the_member():
    job = Elastic(workers=1, elastic=(1, 2))
    job.form()
    job.joined("worker-new")                                           # rank 1, epoch 1
    _, sends = job.request("worker-0", "finish")                       # no member left: epoch 2
    assert not [s for s in sends if s.op == "shutdown"]               # a worker is still in
    ids = job.wait(["worker-new"])
    assert (job.state.members, job.state.epoch) == ([1], 3)
    assert job.meet([]) == done(ids, epoch=3, members=[1], progress={}, barrier=1)


JOINER_DIES = {
    "killed": (lambda job: job.state.node_exited("worker", 2, KILLED, job.now), "was killed by SIGKILL"),
    "fail": (lambda job: job.request("worker-2", "fail", reason="boom")[1], "failed: boom"),
    "silent": (lambda job: silence(job, "worker-2"),
               "sent no heartbeat for 5.5s (KVSTORE_HEARTBEAT_TIMEOUT=5); it is dead or stuck"),
}


@pytest.mark.parametrize("how", sorted(JOINER_DIES))
def test_a_pending_joiner_that_dies_drops_out_and_the_others_barrier_proceeds(how, caplog):
    """Even below MIN (a member finished): it was no member, so nothing changes."""
    job = Elastic(workers=2, elastic=(2, 4))
    job.form()
    job.request("worker-1", "finish")                                  # members [0], epoch 1
    job.joined("worker-2", rank=2)                                     # epoch 2
    job.wait(["worker-2"])
    die, why = JOINER_DIES[how]
    sends = die(job)
    assert not [s for s in sends if s.op in ("members", "abort", "error", "barrier_done")], sends
    assert (job.state.members, job.state.epoch, job.state.failure) == ([0], 2, None)
    assert warnings(caplog) == [          # (worker 1 finishing was news, not a warning)
        f"worker 2 (pid 500 on h) left before it became a member: {why}; the members stay 0"]
    assert only(job.beat("worker-2")) == Send(b"hb:worker-2", "abort", {
        "reason": f"worker 2 was removed from the job: {why}"})
    ids = {}
    ids[b"worker-0"], sends = job.request("worker-0", "barrier", token="b")
    assert sends == done(ids, epoch=2, members=[0], progress={}, barrier=1)


def test_a_barrier_deadline_names_only_the_absent_members():
    job = Elastic(workers=3, elastic=(1, 4))
    job.form()
    job.request("worker-2", "finish")
    job.request("worker-0", "barrier", token="step", timeout=2.0)
    sends = job.tick(2.5)
    send = only(to(sends, b"worker-0"))
    assert send.fields["kind"] == "timeout"
    assert "worker 1 (pid 101 on h) did not arrive (worker 0 waited)" in send.fields["message"]


# -- progress --------------------------------------------------------------------------------
def test_saved_progress_reaches_barriers_and_joiners():
    job = Elastic(workers=2, elastic=(1, 4))
    job.form()
    req_id, sends = job.request("worker-1", "progress", progress={"epoch": 3, "file": "ckpt-3"})
    assert sends == [Send(b"worker-1", "progress_saved", {"id": req_id})]
    assert job.joined("worker-new").fields["progress"] == {"epoch": 3, "file": "ckpt-3"}
    sends = job.meet(["worker-new", "worker-0", "worker-1"])
    assert [s.fields["progress"] for s in sends] == [{"epoch": 3, "file": "ckpt-3"}] * 3


@pytest.mark.parametrize("node, progress, text", [
    ("worker-0", {"blob": "x" * PROGRESS_BYTES},
     f"progress of {PROGRESS_BYTES + 11} bytes (msgpack) exceeds {PROGRESS_BYTES}"),
    ("worker-0", [1, 2], "progress must be a map, not list"),
    ("server-0", {"epoch": 1}, "only workers save progress"),
], ids=["too-big", "no-map", "from-a-server"])
def test_progress_that_is_too_big_or_no_map_or_not_from_a_worker_is_invalid(node, progress, text):
    job = Job(workers=1)
    job.form()
    req_id, sends = job.request(node, "progress", progress=progress)
    error(sends, "invalid", text, req_id)
    at_the_limit = {"blob": "x" * (PROGRESS_BYTES - 11)}        # 64 KiB exactly, as msgpack
    _, sends = job.request("worker-0", "progress", progress=at_the_limit)
    assert only(sends).op == "progress_saved"
    _, sends = job.request("worker-0", "barrier", token="t")
    assert only(sends).fields["progress"] == at_the_limit


def test_a_joiner_on_the_rank_of_a_worker_that_left_hears_the_barrier_count_and_is_never_replayed_an_old_release():
    """Worker 1 passed barrier 1 and left; a joiner takes rank 1 and hears that 1 barrier
    was released. Its first barrier (sent with that count) makes it a member as usual:
    the release kept for a restarted scheduler (Barrier.replay) is not for it."""
    job = Elastic(workers=2, elastic=(1, 4))
    job.form()
    ids = job.wait(["worker-0"])
    ids[b"worker-1"], sends = job.request("worker-1", "barrier", token="b", after=0)
    assert by_ident(sends) == done(ids, epoch=0, members=[0, 1], progress={}, barrier=1)
    job.request("worker-1", "finish")                                  # members [0], epoch 1
    reply = job.joined("worker-new", rank=1).fields
    assert (reply["rank"], reply["barriers"]) == (1, 1)
    ids = job.wait(["worker-new"], after=reply["barriers"])
    ids.update(job.wait(["worker-0"], after=1))
    assert (job.state.members, job.state.epoch) == ([0, 1], 3)
    assert by_ident(s for s in job.servers_hold() if s.op == "barrier_done") == done(
        ids, epoch=3, members=[0, 1], progress={}, barrier=2)
