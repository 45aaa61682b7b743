"""Replicated servers in the scheduler (KVSTORE_REPLICAS=1; tracker.control.failover):
the servers' book (who serves each share, who holds its replica) and what the
scheduler does when a server dies: a new epoch to every node, or, for a chain's
second failure, an abort naming both servers. The state machine alone, with a
made-up clock (the real job: tests/faults/test_replicated_servers.py)."""

from __future__ import annotations

import itertools

import pytest

from tracker.control import wire
from tracker.control.failover import ServerBook
from tracker.control.scheduler_state import SchedulerState

INTERVAL, HB_TIMEOUT = 1.0, 5.0


def test_a_backup_is_the_next_server_on_another_host_where_there_is_one():
    assert ServerBook(3, ["h", "h", "h"]).backups == [1, 2, 0]
    assert ServerBook(4, ["a", "a", "b", "b"]).backups == [2, 2, 0, 0]
    assert ServerBook(2, ["a", "b"]).backups == [1, 0]
    with pytest.raises(ValueError, match="at least 2 servers"):
        ServerBook(1, ["a"])


def test_a_death_promotes_the_backup_and_a_second_in_the_chain_names_both():
    book = ServerBook(3, ["h"] * 3)
    assert book.server_died(1, "was killed by SIGKILL") is None
    assert (book.epoch, book.owners, book.backups) == (1, [0, 2, 2], [None, None, 0])
    assert book.promoted(2) == [1]
    lost = book.server_died(2, "sent no heartbeat for 3.1s")
    assert lost is not None and "servers 1 and 2" in lost and "was killed by SIGKILL" in lost
    assert book.epoch == 1, "a lost share changes nothing"
    again = ServerBook(3, ["h"] * 3)
    again.server_died(1, "was killed")
    lost = again.server_died(0, "was killed")      # server 0's replica lived on server 1
    assert lost is not None and "servers 1 and 0" in lost and "server 0's share" in lost


def test_failures_in_different_chains_are_survived():
    book = ServerBook(4, ["h"] * 4)
    assert book.server_died(0, "was killed") is None
    assert book.server_died(2, "was killed") is None
    assert book.owners == [1, 1, 3, 3] and book.backups == [None, None, None, None]


class Job:
    def __init__(self, workers=2, servers=3):
        self.now = 0.0
        self.state = SchedulerState(workers, servers, now=0.0, timeout=30.0, heartbeat_interval=INTERVAL,
                                    heartbeat_timeout=HB_TIMEOUT, replicas=1)
        self.ids = itertools.count(1)
        self.nodes = [f"server-{r}" for r in range(servers)] + [f"worker-{r}" for r in range(workers)]
        for node in self.nodes:
            self.beat(node)
            role, rank = node.split("-")
            sends = self.state.receive(node.encode(), wire.encode(
                "register", id=next(self.ids), node=node, role=role, rank=int(rank), host="h",
                addr=f"tcp://{node}", pid=100 + int(rank)), self.now)
        self.registered = {s.ident: s.fields for s in sends}

    def beat(self, node: str):
        return self.state.receive(b"hb:" + node.encode(), wire.encode("heartbeat", node=node), self.now)


def test_the_book_comes_with_the_registration_and_a_death_goes_to_every_live_node():
    job = Job()
    reply = job.registered[b"worker-0"]
    assert (reply["book_epoch"], reply["owners"], reply["backups"]) == (0, [0, 1, 2], [1, 2, 0])
    sends = job.state.node_exited("server", 1, -9, now=1.0)
    assert job.state.failure is None
    told = {s.ident for s in sends if s.op == wire.SERVERS}
    assert told == {b"hb:" + n.encode() for n in job.nodes if n != "server-1"}
    assert all(s.fields["owners"] == [0, 2, 2] and s.fields["book_epoch"] == 1 for s in sends)
    ack = [s for s in job.beat("worker-1") if s.op == wire.ACK][0]     # repairs a lost `servers`
    assert ack.fields["owners"] == [0, 2, 2]
    assert [s.op for s in job.beat("server-1")] == [wire.ABORT]        # the dead one, if it was only stuck
    # the launcher reports the same death again (it saw the exit): nothing more happens
    assert job.state.node_exited("server", 1, -9, now=1.1) == [] and job.state.failure is None


def test_a_silent_server_is_failed_over_by_heartbeats():
    job = Job()
    for t in range(1, 7):
        job.now = float(t)
        for node in job.nodes:
            if node != "server-2":
                job.beat(node)
        job.state.tick(job.now)
    assert job.state.failure is None and job.state.servers_book.owners == [0, 1, 0]


def test_a_chains_second_failure_aborts_naming_both_servers():
    job = Job()
    job.state.node_exited("server", 1, -9, now=1.0)
    sends = job.state.node_exited("server", 2, -9, now=2.0)
    assert "servers 1 and 2" in job.state.failure
    assert {s.op for s in sends} == {wire.ABORT}


def test_replicas_need_two_servers():
    with pytest.raises(ValueError, match="at least 2 servers"):
        SchedulerState(2, 1, now=0, timeout=1, heartbeat_interval=1, heartbeat_timeout=1, replicas=1)


def test_a_replacement_backs_up_the_shares_without_a_replica_and_counts_once_rebuilt():
    book = ServerBook(3, ["h"] * 3)
    book.server_died(1, "was killed by SIGKILL")                   # owners [0, 2, 2], backups [None, None, 0]
    with pytest.raises(ValueError, match="as server 3"):
        book.server_joined(4, "tcp://r")
    assert book.server_joined(3, "tcp://r") == [0, 1]
    assert book.fields() == {"book_epoch": 2, "owners": [0, 2, 2], "backups": [3, 3, 0], "added": ["tcp://r"],
                             "rebuilding": [0, 1], "dead": [[1, "was killed by SIGKILL"]], "lost_with": [1, 1, None]}
    assert not book.replica_rebuilt(0, 2) and book.epoch == 2       # not its backup: nothing changes
    assert book.replica_rebuilt(1, 3) and book.epoch == 3 and book.rebuilding == {0: 3}
    assert not book.replica_rebuilt(1, 3)                          # an old report, again
    lost = book.server_died(0, "was killed")                       # share 0's rebuild had not completed
    assert lost is not None and "servers 1 and 0" in lost and "rebuild on server 3 had not completed" in lost
    assert book.server_died(2, "was killed") is None               # share 1's replica was rebuilt
    assert book.owners == [0, 3, 0] and book.backups == [3, None, None]


def test_a_replacement_that_joined_with_nothing_to_back_up_waits_for_the_next_death():
    book = ServerBook(2, ["h"] * 2)
    book.server_died(1, "was killed")
    book.server_joined(2, "tcp://r2")
    assert book.server_joined(3, "tcp://r3") == []                 # a spare: every share has a backup
    book.replica_rebuilt(0, 2), book.replica_rebuilt(1, 2)
    assert book.server_died(0, "was killed") is None
    assert book.owners == [2, 2] and book.backups == [3, 3] and book.rebuilding == {0: 3, 1: 3}


def test_a_replacement_registers_into_the_running_job_and_the_rebuilt_replicas_reach_every_node():
    job = Job()
    job.beat("server-3")
    early = wire.encode("register", id=49, node="server-3", role="server", rank=3, host="h", addr="tcp://server-3",
                        pid=103, replacement=True)
    [refused] = job.state.receive(b"server-3", early, 0.5)         # no server died: nothing to replace
    assert refused.fields["kind"] == wire.INVALID and "in place of a dead one" in refused.fields["message"]
    job.state.node_exited("server", 1, -9, now=1.0)
    register = wire.encode("register", id=50, node="server-3", role="server", rank=4, host="h",
                           addr="tcp://server-3", pid=103, replacement=True)
    assert [s.fields["kind"] for s in job.state.receive(b"server-3", register, 1.5)] == [wire.INVALID]
    sends = job.state.receive(b"server-3", wire.encode(
        "register", id=51, node="server-3", role="server", rank=3, host="h", addr="tcp://server-3", pid=103,
        replacement=True), 2.0)
    reply = [s for s in sends if s.op == wire.REGISTERED][0]
    assert reply.ident == b"server-3" and reply.fields["rank"] == 3 and reply.fields["num_servers"] == 3
    assert reply.fields["servers"] == ["tcp://server-0", "tcp://server-1", "tcp://server-2", "tcp://server-3"]
    assert (reply.fields["book_epoch"], reply.fields["backups"], reply.fields["rebuilding"]) == (2, [3, 3, 0], [0, 1])
    told = {s.ident for s in sends if s.op == wire.SERVERS}
    assert told == {b"hb:" + n.encode() for n in job.nodes + ["server-3"] if n != "server-1"}
    # server 2 reports on its heartbeats that share 1's replica is rebuilt; a report for a
    # share it does not serve changes nothing
    sends = job.state.receive(b"hb:server-2", wire.encode("heartbeat", node="server-2", rebuilt=[[1, 3], [0, 3]]),
                              2.5)
    assert job.state.servers_book.rebuilding == {0: 3}
    assert {s.fields["book_epoch"] for s in sends if s.op == wire.SERVERS} == {3}
    assert job.state.failure is None
    # the replacement dies (its process ended): shares 0 and 1 lose their backup again
    job.state.node_exited("server", 3, -9, now=3.0)
    assert job.state.failure is None and job.state.servers_book.backups == [None, None, 0]


def test_a_replacement_that_never_joined_does_not_end_the_job():
    job = Job()
    job.state.node_exited("server", 1, -9, now=1.0)
    assert job.state.node_exited("server", 3, 1, now=2.0) == [] and job.state.failure is None


def test_a_book_with_replacements_is_restored_from_its_fields_and_bad_fields_are_named():
    book = ServerBook(3, ["h0", "h1", "h2"])
    book.server_died(1, "was killed by SIGKILL")
    book.server_joined(3, "tcp://h1:7000")
    book.replica_rebuilt(1, 3)
    fields = book.fields()
    assert fields["book_epoch"] == 3 and fields["rebuilding"] == [0]
    again = ServerBook.restore(3, fields)
    assert again.fields() == fields and again.ranks == 4 and again.rebuilding == {0: 3}
    assert again.server_died(2, "was killed by SIGKILL") is None and again.owners == [0, 3, 0]
    for name, value in (("book_epoch", 1), ("book_epoch", 99), ("added", [7]), ("owners", [0, 4, 2]),
                        ("backups", [3, 1, 0]), ("rebuilding", [2]), ("dead", [[1, "x"], [1, "y"]])):
        with pytest.raises(ValueError, match=name):
            ServerBook.restore(3, {**fields, name: value})


@pytest.mark.parametrize("how", ["killed", "silent"])
def test_a_server_lost_after_every_worker_finished_ends_the_job_as_it_would_have(how):
    """Every worker finished (the servers were told to shut down), then server 1 dies
    (the launcher saw it) or goes silent: nothing is lost, so no failure; the other
    servers finish and the job is over, as without the loss."""
    job = Job()
    for worker in ("worker-0", "worker-1"):
        sends = job.state.receive(worker.encode(), wire.encode("finish", id=next(job.ids), node=worker), job.now)
    assert {s.ident for s in sends if s.op == "shutdown"} == {b"hb:server-0", b"hb:server-1", b"hb:server-2"}
    job.now = HB_TIMEOUT + 1.0
    if how == "killed":
        job.state.node_exited("server", 1, -9, now=job.now)
    else:
        job.beat("server-0")
        job.beat("server-2")
        job.state.tick(job.now)
    assert job.state.failure is None
    for server in ("server-0", "server-2"):
        job.state.receive(server.encode(), wire.encode("finish", id=next(job.ids), node=server), job.now)
    job.state.tick(job.now + 0.1)
    assert job.state.over and job.state.failure is None
