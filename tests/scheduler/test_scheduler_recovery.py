"""A restarted scheduler's state machine (``SchedulerState(restarted=True)``,
tracker.control.recovery), without sockets or clocks: the job of a scheduler that
died is rebuilt from what its members register again with (``rejoin``) and the
exits the launcher replays. Node ``worker-1`` sends requests from ``b"worker-1"``
and heartbeats (and its registration again) from ``b"hb:worker-1"``, as a node's
two sockets do. Last, live over loopback ZeroMQ: Memberships whose scheduler is
closed and started again on its port (as a launcher restarts it) go on through a
barrier released to one worker only before the restart."""

from __future__ import annotations

import itertools

from test_scheduler_liveness import FAST, members, run_all
from tracker.control import wire
from tracker.control.rendezvous import Scheduler
from tracker.control.records import Send
from tracker.control.scheduler_state import SchedulerState

INTERVAL, HB_TIMEOUT, RESTART = 1.0, 5.0, 10.0
JOB = "6f1c0000aaaa0000"


def scheduler(workers: int, servers: int, restarted: bool, replicas: int = 0,
              elastic: tuple[int, int] | None = None) -> SchedulerState:
    return SchedulerState(workers, servers, now=0.0, timeout=30.0, heartbeat_interval=INTERVAL,
                          heartbeat_timeout=HB_TIMEOUT, replicas=replicas, job=JOB, restarted=restarted,
                          restart_timeout=RESTART, elastic=elastic)


class Nodes:
    """The job's nodes talking to ``state``; each node's request ids grow, as a Membership's."""

    def __init__(self, state: SchedulerState):
        self.state = state
        self.ids = itertools.count(1)
        self.now = 0.0

    def request(self, node: str, op: str, **fields) -> tuple[int, list[Send]]:
        req_id = next(self.ids)
        return req_id, self.state.receive(node.encode(), wire.encode(op, id=req_id, node=node, **fields), self.now)

    def register(self, node: str, rejoin: dict | None = None) -> list[Send]:
        """``node`` registers (again: with ``rejoin``, from its heartbeat socket)."""
        role, rank = node.split("-")
        ident = (b"hb:" if rejoin is not None else b"") + node.encode()
        fields = {"role": role, "rank": int(rank), "host": "h", "addr": f"tcp://{node}", "pid": 100 + int(rank)}
        if rejoin is not None:
            fields["rejoin"] = rejoin
        return self.state.receive(ident, wire.encode("register", id=next(self.ids), node=node, **fields), self.now)

    def beat(self, node: str) -> list[Send]:
        return self.state.receive(b"hb:" + node.encode(), wire.encode("heartbeat", node=node), self.now)


def formed(workers: int, servers: int, replicas: int = 0) -> Nodes:
    nodes = Nodes(scheduler(workers, servers, False, replicas))
    for node in [f"server-{r}" for r in range(servers)] + [f"worker-{r}" for r in range(workers)]:
        nodes.beat(node)
        nodes.register(node)
    assert nodes.state.members == list(range(workers))
    return nodes


def report(old: SchedulerState | None = None, **over) -> dict:
    """What a node of ``old``'s job re-registers with (Membership._rejoin_message)."""
    book = old.servers_book.fields() if old is not None and old.servers_book is not None else None
    return {"job": JOB, "book": book, "epoch": 0, "members": [0, 1], "finished_workers": [],
            "shutdown": False, "progress": {}, **over}


def ops(sends: list[Send], ident: bytes) -> list[str]:
    return [s.op for s in sends if s.ident == ident]


def test_nothing_completes_until_every_member_registered_again_and_the_book_survives():
    """Replicated servers: server 1 died before the restart (book epoch 1). The restarted
    scheduler acknowledges heartbeats with a new incarnation, refuses a barrier
    ('restarting') until both workers and servers 0 and 2 registered again (not the
    dead server 1), then answers all of them and goes on: a barrier completes, and
    server 2's death is the chain's second failure, naming both servers."""
    old = formed(2, 3, replicas=1)
    old.state.node_exited("server", 1, -9, now=1.0)
    assert old.state.servers_book.epoch == 1 and old.state.failure is None
    new = Nodes(scheduler(2, 3, True, replicas=1))
    ack = [s for s in new.beat("worker-0") if s.op == wire.ACK][0]
    assert ack.fields["incarnation"] == new.state.incarnation != old.state.incarnation
    assert new.register("worker-0", report(old.state)) == []
    _, sends = new.request("worker-0", "barrier", token="t", timeout=30.0)
    [error] = sends
    assert error.op == wire.ERROR and error.fields["kind"] == wire.RESTARTING
    assert "server 0, server 2, worker 1" in error.fields["message"], error.fields["message"]
    assert new.register("worker-1", report(old.state)) == []
    assert new.register("server-0", report(old.state)) == []
    sends = new.register("server-2", report(old.state))
    assert sorted(s.ident for s in sends if s.op == wire.REGISTERED) == [
        b"hb:server-0", b"hb:server-2", b"hb:worker-0", b"hb:worker-1"]
    reply = [s for s in sends if s.ident == b"hb:worker-1"][0].fields
    assert reply["incarnation"] == new.state.incarnation and reply["rank"] == 1
    assert reply["restartable"] is True          # a restarted scheduler has a launcher that restarts it
    assert (reply["book_epoch"], reply["owners"], reply["backups"]) == (1, [0, 2, 2], [None, None, 0])
    new.request("worker-0", "barrier", token="t", timeout=30.0)
    _, sends = new.request("worker-1", "barrier", token="t", timeout=30.0)
    assert ops(sends, b"worker-0") == ops(sends, b"worker-1") == [wire.BARRIER_DONE]
    new.state.node_exited("server", 2, -9, now=2.0)
    assert "servers 1 and 2" in new.state.failure and "server 1 died before" in new.state.failure


def test_a_member_that_does_not_register_again_in_time_is_named():
    new = Nodes(scheduler(2, 1, True))
    new.register("server-0", report())
    new.register("worker-0", report())
    assert new.state.tick(HB_TIMEOUT + RESTART - 0.1) == []
    sends = new.state.tick(HB_TIMEOUT + RESTART + 0.1)
    assert "worker 1 did not" in new.state.failure and "KVSTORE_SCHEDULER_RESTART_TIMEOUT" in new.state.failure
    assert {(s.ident, s.op) for s in sends} >= {(b"hb:worker-0", wire.ERROR), (b"hb:server-0", wire.ERROR)}
    assert all(s.fields.get("kind") == wire.ABORTED for s in sends if s.op == wire.ERROR)


def test_finished_workers_and_replayed_exits_are_not_waited_for():
    """Worker 0 finished (the server heard it), worker 1 ended with status 0 (the
    launcher replays it): the restarted scheduler waits for worker 2 and the server
    only, and shuts the server down once worker 2 finishes."""
    new = Nodes(scheduler(3, 1, True))
    new.state.node_exited("worker", 1, 0, now=0.0)
    new.register("server-0", report(members=[0, 1, 2], finished_workers=[0]))
    sends = new.register("worker-2", report(members=[0, 1, 2]))
    assert ops(sends, b"hb:worker-2") == ops(sends, b"hb:server-0") == [wire.REGISTERED]
    _, sends = new.request("worker-2", "finish")
    assert ops(sends, b"worker-2") == [wire.FINISHED] and ops(sends, b"hb:server-0") == [wire.SHUTDOWN]


def test_a_copy_of_a_request_sent_again_is_dropped():
    """A node sends a request again once it registered again; a copy of it held while
    the scheduler was away may arrive too: the second one is dropped, so a barrier
    that completed is not joined again by a phantom."""
    new = Nodes(scheduler(2, 1, True))
    for node in ("server-0", "worker-0", "worker-1"):
        new.register(node, report())
    barrier = wire.encode("barrier", id=500, node="worker-0", token="t", timeout=30.0)
    assert new.state.receive(b"worker-0", barrier, 0.0) == []
    _, sends = new.request("worker-1", "barrier", token="t", timeout=30.0)
    assert ops(sends, b"worker-0") == [wire.BARRIER_DONE]
    assert new.state.receive(b"worker-0", barrier, 0.0) == []          # the copy: no phantom arrival
    new.request("worker-1", "barrier", token="t", timeout=30.0)
    assert new.state.tick(1.0) == []


def test_a_job_that_had_not_formed_forms_with_the_restarted_scheduler():
    """Nobody had registered with the dead scheduler: plain registrations form the job
    (a registration sent again by the same node is answered once)."""
    new = Nodes(scheduler(2, 1, True))
    new.register("server-0")
    first = wire.encode("register", id=77, node="worker-0", role="worker", rank=0, host="h", addr="", pid=1)
    assert new.state.receive(b"worker-0", first, 0.0) == []
    assert new.state.receive(b"worker-0", first, 0.0) == []
    sends = new.register("worker-1")
    assert [s.fields["id"] for s in sends if s.ident == b"worker-0"] == [77]
    assert new.state.members == [0, 1] and new.state.failure is None


def test_a_node_of_another_job_or_taking_a_rank_twice_is_refused():
    new = Nodes(scheduler(2, 1, True))
    [error] = new.register("worker-0", report(job="another"))
    assert error.op == wire.ERROR and "job 'another'" in error.fields["message"]
    new.register("worker-0", report())
    fields = {"role": "worker", "rank": 0, "host": "h", "addr": "", "pid": 9, "rejoin": report()}
    [error] = new.state.receive(b"x", wire.encode("register", id=900, node="worker-0-twin", **fields), 0.0)
    assert error.op == wire.ERROR and "two processes claim worker rank 0" in error.fields["message"]


def test_an_elastic_jobs_membership_is_the_newest_epoch_reported():
    """--elastic 1:3: worker 1 had left (epoch 2, members [0]) when the scheduler died.
    Only worker 0 and the server are waited for; the members and epoch go on from
    there: a barrier of worker 0 alone completes, and a new worker joins at epoch 3."""
    new = Nodes(scheduler(2, 1, True, elastic=(1, 3)))
    new.register("server-0", report(epoch=2, members=[0], progress={"step": 7}))
    sends = new.register("worker-0", report(epoch=1, members=[0, 1]))
    assert ops(sends, b"hb:worker-0") == [wire.REGISTERED]
    assert (new.state.members, new.state.epoch) == ([0], 2)
    _, sends = new.request("worker-0", "barrier", token="t", timeout=30.0)
    [done] = [s for s in sends if s.ident == b"worker-0"]
    assert done.op == wire.BARRIER_DONE and done.fields["members"] == [0] and done.fields["progress"] == {"step": 7}
    sends = new.state.receive(b"worker-9", wire.encode("register", id=1, node="worker-9", role="worker", rank=None,
                                                       host="h", addr="", pid=9), 1.0)
    assert new.state.epoch == 3 and [s.op for s in sends if s.ident == b"hb:server-0"] == [wire.MEMBERS]


def test_a_failed_over_server_that_registers_again_is_told_to_stop():
    """Server 1 was failed over (stopped, then let go: SIGCONT) and registers again:
    the restarted scheduler keeps it dead, and its heartbeats get ``abort``."""
    old = formed(2, 3, replicas=1)
    old.state.node_exited("server", 1, -9, now=1.0)
    new = Nodes(scheduler(2, 3, True, replicas=1))
    for node in ("server-1", "server-0", "server-2", "worker-0", "worker-1"):
        new.register(node, report(old.state))
    assert new.state.failure is None and new.state.servers_book.owners == [0, 2, 2]
    assert [s.op for s in new.beat("server-1")] == [wire.ABORT]
    assert [s.op for s in new.beat("server-0")] == [wire.ACK]


def test_a_worker_joining_an_elastic_job_is_told_to_come_back_after_the_recovery():
    new = Nodes(scheduler(2, 1, True, elastic=(1, 3)))
    new.register("server-0", report(epoch=0, members=[0, 1]))
    join = wire.encode("register", id=1, node="worker-9", role="worker", rank=None, host="h", addr="", pid=9)
    [error] = new.state.receive(b"worker-9", join, 0.0)
    assert error.op == wire.ERROR and error.fields["kind"] == wire.RESTARTING
    new.register("worker-0", report())
    new.register("worker-1", report())
    sends = new.state.receive(b"worker-9", join, 1.0)     # sent again: a join, at epoch 1
    assert new.state.epoch == 1 and [s.op for s in sends if s.ident == b"hb:server-0"] == [wire.MEMBERS]


def test_a_restart_after_a_replacement_joined_keeps_the_replacement_and_its_rebuilt_replica():
    """Server 1 died, replacement server 3 joined (the backup of shares 0 and 1), and
    server 2 reported share 1's replica rebuilt (book epoch 3) before the scheduler
    died. The restarted scheduler waits for the replacement too (rank 3 >= the job's 3
    servers, listed in the reported book), restores the same book, takes server 0's
    rebuild report after the restart, and then survives server 2's death: share 1's
    rebuilt replica on server 3 takes over."""
    old = formed(2, 3, replicas=1)
    old.state.node_exited("server", 1, -9, now=1.0)
    old.state.receive(b"server-3", wire.encode("register", id=90, node="server-3", role="server", rank=3,
                                               host="h", addr="tcp://server-3", pid=103, replacement=True), 1.5)
    old.state.receive(b"hb:server-2", wire.encode("heartbeat", node="server-2", rebuilt=[[1, 3]]), 2.0)
    before = old.state.servers_book.fields()
    assert (before["book_epoch"], before["backups"], before["added"], before["rebuilding"]) == (
        3, [3, 3, 0], ["tcp://server-3"], [0])
    new = Nodes(scheduler(2, 3, True, replicas=1))
    for node in ("worker-0", "worker-1", "server-0", "server-2"):
        assert new.register(node, report(old.state)) == []
    assert new.state.recovering == "server 3"          # the replacement is expected
    sends = new.register("server-3", report(old.state))
    assert sorted(s.ident for s in sends if s.op == wire.REGISTERED) == [
        b"hb:server-0", b"hb:server-2", b"hb:server-3", b"hb:worker-0", b"hb:worker-1"]
    assert new.state.servers_book.fields() == before
    sends = new.state.receive(b"hb:server-0", wire.encode("heartbeat", node="server-0", rebuilt=[[0, 3]]), 3.0)
    assert {s.fields["book_epoch"] for s in sends if s.op == wire.SERVERS} == {4}
    assert new.state.servers_book.rebuilding == {}
    new.state.node_exited("server", 2, -9, now=4.0)
    assert new.state.failure is None and new.state.servers_book.owners == [0, 3, 0]


def test_a_restarted_scheduler_refuses_a_replacement_the_reported_book_does_not_list():
    """A replacement's rank past the job's servers is valid only when the book it
    reports lists it; its first registration waits ('restarting') for the rebuilt job."""
    old = formed(2, 3, replicas=1)
    old.state.node_exited("server", 1, -9, now=1.0)
    new = Nodes(scheduler(2, 3, True, replicas=1))
    [error] = [s for s in new.register("server-3", report(old.state)) if s.op == wire.ERROR]
    assert error.fields["kind"] == wire.INVALID and "server rank 3 is out of range" in error.fields["message"]
    first = wire.encode("register", id=91, node="server-4", role="server", rank=3, host="h",
                        addr="tcp://server-4", pid=104, replacement=True)
    [error] = new.state.receive(b"server-4", first, 1.0)
    assert error.fields["kind"] == wire.RESTARTING


def released(sends: list[Send], ident: bytes, token: str) -> dict:
    """The release a worker keeps from its ``barrier_done`` (Membership._barrier)."""
    [done] = [s for s in sends if s.ident == ident and s.op == wire.BARRIER_DONE]
    return {"number": done.fields["barrier"], "token": token,
            "fields": {k: v for k, v in done.fields.items() if k != "id"}}


def restarted_mid_release() -> tuple[Nodes, dict]:
    """The old scheduler released barrier 2 ('save_checkpoint') to worker 0 and died
    before its answer reached worker 1, which heard only barrier 1. Both register again
    with the restarted scheduler with what they heard."""
    old = formed(2, 1)
    old.request("worker-0", "barrier", token="init")
    _, first = old.request("worker-1", "barrier", token="init")
    old.request("worker-0", "barrier", token="save_checkpoint")
    _, second = old.request("worker-1", "barrier", token="save_checkpoint")
    heard0, heard1 = released(second, b"worker-0", "save_checkpoint"), released(first, b"worker-1", "init")
    assert (heard0["number"], heard1["number"]) == (2, 1)
    new = Nodes(scheduler(2, 1, True))
    new.register("server-0", report())
    new.register("worker-0", report(barrier=heard0))
    new.register("worker-1", report(barrier=heard1))
    assert new.state.recovering is None
    return new, heard0


def test_a_barrier_released_to_some_workers_before_the_restart_is_released_to_the_others():
    """Chaos seed 1077800662: worker 1 sends the barrier worker 0 passed again; it is
    answered at once with that release, and the next barrier waits for both."""
    new, heard0 = restarted_mid_release()
    req, sends = new.request("worker-0", "barrier", token="save_checkpoint done", after=2)
    assert sends == []                               # waits for worker 1
    late, sends = new.request("worker-1", "barrier", token="save_checkpoint", after=1)
    assert sends == [Send(b"worker-1", wire.BARRIER_DONE, {"id": late, **heard0["fields"]})]
    nxt, sends = new.request("worker-1", "barrier", token="save_checkpoint done", after=2)
    assert sorted((s.ident, s.op, s.fields["id"], s.fields["barrier"]) for s in sends) == [
        (b"worker-0", wire.BARRIER_DONE, req, 3), (b"worker-1", wire.BARRIER_DONE, nxt, 3)]


def test_a_worker_that_calls_another_barrier_than_the_one_released_before_the_restart_is_told_so():
    new, _ = restarted_mid_release()
    late, sends = new.request("worker-1", "barrier", token="set_optimizer", after=1)
    assert [(s.ident, s.op, s.fields["kind"]) for s in sends] == [(b"worker-1", wire.ERROR, wire.MISMATCH)]
    assert sends[0].fields["message"] == (
        "workers disagree at a collective call: worker 1 differs from worker 0: worker 0: 'save_checkpoint'; "
        "worker 1: 'set_optimizer' (barrier 2, released to the others before the scheduler's restart)")
    assert new.state.failure is None


def test_a_rejoin_reports_barrier_is_checked_field_by_field():
    """A report's release is replayed to other workers: each field is validated."""
    new = Nodes(scheduler(2, 1, True))
    good = {"number": 2, "token": "t", "fields": {"epoch": 0, "members": [0, 1], "progress": {}, "barrier": 2}}
    for bad, why in [("x", "must be a map or nil"),
                     ({**good, "number": 0}, "positive integer 'number'"),
                     ({**good, "token": 3}, "string 'token'"),
                     ({**good, "fields": {**good["fields"], "barrier": 3}}, "barrier_done 'fields'"),
                     ({**good, "fields": {**good["fields"], "members": [0, 7]}}, "worker ranks below 2"),
                     ({**good, "fields": {**good["fields"], "data": [b"a"]}}, "one bytes payload per member")]:
        [error] = new.register("worker-0", report(barrier=bad))
        assert error.op == wire.ERROR and why in error.fields["message"], (bad, error.fields)
    assert new.register("worker-0", report(barrier=good)) == []


def test_live_a_barrier_released_to_one_worker_before_the_restart_reaches_the_other():
    """Real Memberships and schedulers: both workers pass 'init' and 'save_checkpoint';
    worker 1 is made to have heard only 'init' (the reply the old scheduler did not
    send before it died), the scheduler is closed and a restarted one started on its
    port. Worker 1 calls 'save_checkpoint' again and is answered with the release
    worker 0 got; both then pass 'save_checkpoint done' (the next release, 3)."""
    old = Scheduler(2, 1, job=JOB, restart_timeout=RESTART, restartable=True, **FAST).start()
    port, new = old.port, None
    servers, workers = members(port, 2)
    try:
        assert run_all([lambda: workers[0].barrier("init"), lambda: workers[1].barrier("init")]) == [(0, (0, 1))] * 2
        heard_init = workers[1].last_barrier
        assert run_all([lambda: workers[0].barrier("save_checkpoint"),
                        lambda: workers[1].barrier("save_checkpoint")]) == [(0, (0, 1))] * 2
        assert [w.last_barrier.number for w in workers] == [2, 2]
        # its answer to barrier 2 was lost with the old scheduler
        workers[1].last_barrier, workers[1].barriers_heard = heard_init, 1
        old.close()
        new = Scheduler(2, 1, port=port, job=JOB, restarted=True, restart_timeout=RESTART, **FAST).start()

        def late_worker():
            workers[1].barrier("save_checkpoint")             # answered with the old release
            assert workers[1].last_barrier.number == 2
            return workers[1].barrier("save_checkpoint done")
        assert run_all([lambda: workers[0].barrier("save_checkpoint done"), late_worker]) == [(0, (0, 1))] * 2
        assert [w.last_barrier.number for w in workers] == [3, 3] and new.failure is None
    finally:
        for node in servers + workers:
            node.close()
        (new or old).close()


def test_a_server_that_died_before_the_restart_keeps_its_address_in_the_rebuilt_book():
    """Its address comes from the reports (it registers no more): the restarted
    scheduler's `registered` lists every server's, as the old one did, not ''."""
    old = formed(2, 3, replicas=1)
    old.state.node_exited("server", 1, -9, now=1.0)
    addresses = [f"tcp://server-{r}" for r in range(3)]
    new = Nodes(scheduler(2, 3, True, replicas=1))
    for node in ("worker-0", "worker-1", "server-0"):
        new.register(node, report(old.state, servers=addresses))
    sends = new.register("server-2", report(old.state, servers=addresses))
    replies = [s.fields for s in sends if s.op == wire.REGISTERED]
    assert len(replies) == 4 and all(r["servers"] == addresses for r in replies), replies


def test_a_rejoin_reports_server_addresses_are_checked():
    new = Nodes(scheduler(2, 2, True))
    for bad in (["tcp://a"], "tcp://a", ["tcp://a", 7], ["tcp://a", "x" * 2000]):
        [error] = new.register("worker-0", report(servers=bad))
        assert error.op == wire.ERROR and "rejoin's 'servers' must list the 2 servers' addresses" in \
            error.fields["message"], (bad, error.fields)
