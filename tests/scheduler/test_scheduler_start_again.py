"""Servers started again in place before a replicated job formed
(tracker.control.start_again): the scheduler's decisions, on the state machine
alone with a made-up clock. The launcher's side with real processes:
tests/tracker/test_start_again.py; a whole job: tests/faults/test_chaos.py."""

from __future__ import annotations

import itertools

import pytest

from tracker.control import wire
from tracker.control.scheduler_state import SchedulerState
from tracker.control.start_again import StartsAgain

TIMEOUT, HB_TIMEOUT = 20.0, 2.0


class Forming:
    """A job of ``workers`` and ``servers`` whose nodes register when told."""

    def __init__(self, workers=2, servers=2, replicas=1, restartable=True):
        self.now = 0.0
        self.state = SchedulerState(workers, servers, now=0.0, timeout=TIMEOUT, heartbeat_interval=0.4,
                                    heartbeat_timeout=HB_TIMEOUT, replicas=replicas, restartable=restartable)
        self.ids = itertools.count(1)
        self.names = itertools.count()
        self.nodes: list[str] = []     # every node that registered

    def register(self, role: str, rank: int) -> tuple[str, list]:
        node = f"{role}-{rank}-{next(self.names)}"      # a new process: a new node id
        self.nodes.append(node)
        self.beat(node)
        sends = self.state.receive(node.encode(), wire.encode(
            "register", id=next(self.ids), node=node, role=role, rank=rank, host="h",
            addr=f"tcp://{node}", pid=100 + rank), self.now)
        return node, sends

    def beat(self, node: str) -> list:
        return self.state.receive(b"hb:" + node.encode(), wire.encode("heartbeat", node=node), self.now)

    def later(self, now: float, silent: tuple[str, ...] = ()) -> None:
        """Time passes to ``now``; every node but ``silent`` sent a heartbeat."""
        self.now = now
        for node in self.nodes:
            if node not in silent:
                self.beat(node)
        self.state.tick(now)

    def registered(self, sends) -> set[bytes]:
        return {s.ident for s in sends if s.op == wire.REGISTERED}


def test_the_count_per_rank_is_bounded_and_ranks_past_the_jobs_servers_are_refused():
    again = StartsAgain(num_servers=2)
    assert again.take(1) and again.counts == {1: 1} and again.describe(1) == "1 of 1"
    assert not again.take(1) and again.counts == {1: 1}
    assert again.can(0) and not again.can(2) and not again.can(-1) and not again.can("0") and not again.can(None)


def test_a_server_killed_before_it_registered_is_started_again_and_the_job_forms_with_it():
    job = Forming()
    for role, rank in (("worker", 0), ("worker", 1), ("server", 0)):
        job.register(role, rank)
    job.now = 3.0
    job.state.node_exited("server", 1, -9, now=job.now)
    assert job.state.failure is None and job.state.start_again == {1: 1}
    node, sends = job.register("server", 1)                    # the launcher's new process
    assert len(job.registered(sends)) == 4, "the job formed with the server started again"
    assert job.state.failure is None


def test_a_server_that_registered_then_died_before_the_job_formed_is_forgotten_and_its_new_process_takes_the_rank():
    job = Forming()
    job.register("server", 0)
    job.register("server", 1)
    job.register("worker", 0)
    job.state.node_exited("server", 1, -9, now=1.0)
    assert job.state.failure is None and job.state.start_again == {1: 1}
    job.register("server", 1)                                  # no "two processes claim server rank 1"
    _, sends = job.register("worker", 1)
    assert len(job.registered(sends)) == 4 and job.state.failure is None


def test_a_servers_second_loss_before_the_job_formed_ends_it_naming_the_server():
    job = Forming()
    job.state.node_exited("server", 0, -9, now=1.0)
    job.state.node_exited("server", 0, 1, now=2.0)
    assert job.state.failure is not None and "server 0" in job.state.failure, job.state.failure
    assert job.state.start_again == {0: 1}


@pytest.mark.parametrize("replicas, restartable", [(0, True), (1, False)])
def test_without_replicas_or_a_launcher_a_server_lost_before_the_job_formed_ends_it(replicas, restartable):
    job = Forming(replicas=replicas, restartable=restartable)
    job.state.node_exited("server", 1, -9, now=1.0)
    assert job.state.failure is not None and "server 1" in job.state.failure
    assert job.state.start_again == {}


def test_a_server_that_registered_then_went_silent_before_the_job_formed_is_started_again():
    job = Forming()
    node, _ = job.register("server", 1)
    job.register("worker", 0)
    job.later(1.0 + HB_TIMEOUT, silent=(node,))
    assert job.state.failure is None and job.state.start_again == {1: 1}
    assert [s.op for s in job.beat(node)] == [wire.ACK], "forgotten: its stale heartbeat is a stranger's"


def test_servers_still_missing_a_heartbeat_timeout_after_the_last_registration_are_started_again():
    """Stopped (or hung) before they registered: every worker and server 0 registered
    at 0 s; servers 1 and 2 are as late as a silent node after HB_TIMEOUT, started
    again then, with a whole KVSTORE_TIMEOUT from there to register."""
    job = Forming(servers=3)
    job.register("worker", 0)
    job.register("worker", 1)
    job.register("server", 0)
    job.later(HB_TIMEOUT - 0.5)
    assert job.state.start_again == {}
    job.later(HB_TIMEOUT + 0.5)
    assert job.state.failure is None and job.state.start_again == {1: 1, 2: 1}
    for t in range(4, int(HB_TIMEOUT + TIMEOUT), 2):       # past the first deadline (20 s), within the new one
        job.later(float(t))
    assert job.state.failure is None and job.state.start_again == {1: 1, 2: 1}, "once per rank"
    job.register("server", 1)
    _, sends = job.register("server", 2)
    assert len(job.registered(sends)) == 5 and job.state.failure is None


def test_a_server_missing_again_after_its_start_again_ends_the_job_at_the_deadline():
    job = Forming()
    job.register("worker", 0)
    job.register("worker", 1)
    job.register("server", 0)
    job.later(HB_TIMEOUT + 0.5)
    assert job.state.start_again == {1: 1}
    for t in range(4, int(HB_TIMEOUT + TIMEOUT) + 4, 2):     # past the new deadline (22.5 s)
        job.later(float(t))
    assert job.state.failure is not None and "missing ranks 1" in job.state.failure, job.state.failure


def test_a_worker_missing_at_the_registration_deadline_ends_the_job_as_before():
    job = Forming()
    job.register("worker", 0)
    job.register("server", 0)
    for t in (1.5, 3.0, 4.5, 6.0, 7.5, 9.0, 10.5, 12.0, 13.5, 15.0, 16.5, 18.0, 19.5, TIMEOUT + 0.5):
        job.later(t)
        assert job.state.start_again == {}, "a worker is missing: no server is started again"
    assert job.state.failure is not None and "registration did not complete" in job.state.failure
    assert job.state.start_again == {}


def test_after_the_job_formed_a_server_death_is_a_failover_not_a_start_again():
    job = Forming()
    for role, rank in (("worker", 0), ("worker", 1), ("server", 0), ("server", 1)):
        job.register(role, rank)
    job.state.node_exited("server", 1, -9, now=1.0)
    assert job.state.start_again == {} and job.state.failure is None
    assert job.state.servers_book is not None and 1 in job.state.servers_book.dead
