"""Elastic jobs end to end on the control plane: a real in-process ``Scheduler``
and real ``Membership`` nodes over loopback ZeroMQ (random ports), as in
tests/scheduler/test_scheduler_liveness.py. A joining worker is answered once the servers'
heartbeats acknowledged the epoch that lists its process; it becomes a member at
its first barrier with the members, which ends once every server holds the
epoch that has it. Workers that fail, are killed or finish leave, and the
others' barriers report the new members."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest

from test_scheduler_liveness import FAST, members, run_all
from tracker.control.errors import JobAborted, RendezvousError, RendezvousTimeout
from tracker.control.membership import Membership, Registration
from tracker.control.rendezvous import Scheduler

PID = os.getpid()


def worker(port, rank=None, **settings) -> Membership:
    return Membership(role="worker", rank=rank, scheduler=("127.0.0.1", port), **{**FAST, **settings})


def meet(joiner: Membership, members: list[Membership], token="b") -> list:
    """The joiner waits at a barrier while the members pass barriers until one has
    it (theirs before it arrived end without it, as in a training loop): each
    one's last ``(epoch, members)``, joiner first (or the exception it raised)."""
    def member(node: Membership):
        deadline = time.monotonic() + 20.0
        while time.monotonic() < deadline:
            epoch, ranks = node.barrier(token, timeout=20.0)
            if joiner.registration.rank in ranks:
                return epoch, ranks
        raise AssertionError(f"{node.name} never met worker {joiner.registration.rank} at a barrier")
    return run_all([lambda: joiner.barrier(token, timeout=20.0)] + [lambda m=m: member(m) for m in members])


def killed(sched: Scheduler, node: Membership, rank: int) -> None:
    """The launcher says worker ``rank`` was killed; its process still beats and hears why."""
    sched.node_exited("worker", rank, -9)
    assert node.aborted.wait(10), "the removed worker was not told"
    assert node.abort_reason == f"worker {rank} was removed from the job: was killed by SIGKILL"


def goes_on(sched: Scheduler, node: Membership, server: Membership, barrier: tuple) -> None:
    """``node`` passes a barrier with the result ``barrier``; nothing aborted."""
    assert node.barrier("alone", timeout=20.0) == barrier
    assert not node.aborted.is_set() and not server.aborted.is_set()
    assert sched.failure is None


def two_servers_and_a_joiner():
    """A scheduler (KVSTORE_TIMEOUT 2 s) for servers 0 and 1 and worker 0, and a worker
    that joins later (nothing registered yet)."""
    settings = {**FAST, "timeout": 2.0}
    sched = Scheduler(1, 2, elastic=(1, 2), **settings).start()
    servers = [Membership(role="server", rank=r, scheduler=("127.0.0.1", sched.port), **settings)
               for r in range(2)]
    return sched, servers, worker(sched.port, rank=0, **settings), worker(sched.port, **settings)


def stale(server: Membership) -> None:
    """From now on ``server``'s heartbeats carry no epoch: it never holds a newer membership."""
    server.registration = dataclasses.replace(server.registration, elastic=None)


def close(*nodes, sched) -> None:
    for node in nodes:
        node.close()
    sched.close()


def test_registration_defaults_keep_older_constructions_working():
    reg = Registration(0, 2, 1, ["tcp://s"], ["h:1", "h:2"])
    assert (reg.worker_ranks, reg.members, reg.epoch, reg.joined, reg.progress, reg.elastic) == (
        2, (0, 1), 0, False, {}, None)


def test_without_elastic_every_worker_is_a_member_and_barriers_say_so():
    sched = Scheduler(2, 1, **FAST).start()
    servers, workers = members(sched.port, 2)
    try:
        reg = workers[1].registration
        assert (reg.rank, reg.worker_ranks, reg.members, reg.epoch, reg.joined, reg.elastic) == (
            1, 2, (0, 1), 0, False, None)
        assert servers[0].members == (0, frozenset({0, 1}))
        assert run_all([lambda w=w: w.barrier("b", timeout=20.0) for w in workers]) == [(0, (0, 1))] * 2
    finally:
        close(*workers, *servers, sched=sched)


def test_a_worker_joins_and_becomes_a_member_at_a_barrier_and_reads_the_saved_progress():
    sched = Scheduler(2, 1, elastic=(1, 3), **FAST).start()
    servers, workers = members(sched.port, 2)
    joiner = worker(sched.port)
    try:
        reg = workers[0].registration
        assert (reg.worker_ranks, reg.members, reg.epoch, reg.joined, reg.elastic, reg.progress) == (
            3, (0, 1), 0, False, (1, 3), {})
        assert reg.workers == [f"127.0.0.1:{PID}", f"127.0.0.1:{PID}", ""]
        workers[0].save_progress({"epoch": 3, "step": 1200})
        reg = joiner.register()
        assert (reg.rank, reg.joined, reg.num_workers, reg.members, reg.epoch, reg.progress) == (
            2, True, 2, (0, 1), 1, {"epoch": 3, "step": 1200})
        assert reg.workers == [f"127.0.0.1:{PID}"] * 3
        # answered only after the server's heartbeat acknowledged epoch 1: the server
        # knows the joiner's process, and its rounds do not wait for it (pending)
        assert servers[0].members == (1, frozenset({0, 1}))
        assert servers[0].workers == (f"127.0.0.1:{PID}",) * 3
        assert run_all([lambda w=w: w.barrier("alone", timeout=20.0) for w in workers]) == [(1, (0, 1))] * 2
        everyone = [joiner] + workers
        assert meet(joiner, workers) == [(2, (0, 1, 2))] * 3
        # the barrier ended only after the server's heartbeat acknowledged epoch 2
        assert servers[0].members == (2, frozenset({0, 1, 2}))
        assert [w.members for w in everyone] == [(2, frozenset({0, 1, 2}))] * 3
        assert [w.progress for w in everyone] == [{"epoch": 3, "step": 1200}] * 3
        # a member: the next barrier waits for it
        assert run_all([lambda w=w: w.barrier("c", timeout=20.0) for w in workers + [joiner]]) == [
            (2, (0, 1, 2))] * 3
        assert sched.failure is None
    finally:
        close(joiner, *workers, *servers, sched=sched)


def test_a_server_acknowledges_new_members_at_once_not_at_its_next_heartbeat():
    """The server beats every 60 s; the joiner, and the barrier that makes it a member,
    wait at most 10 s (KVSTORE_TIMEOUT): only the heartbeat the server sends as soon as
    it hears ``members`` gets it in."""
    slow = {"heartbeat_interval": 60.0, "heartbeat_timeout": 180.0, "timeout": 10.0}
    sched = Scheduler(1, 1, elastic=(1, 2), **{**slow, "heartbeat_interval": 0.1}).start()
    server = Membership(role="server", rank=0, scheduler=("127.0.0.1", sched.port), **slow)
    first, joiner = worker(sched.port, rank=0, **slow), worker(sched.port, **slow)
    try:
        assert not [r for r in run_all([server.register, first.register]) if isinstance(r, BaseException)]
        reg = joiner.register()
        assert (reg.rank, reg.members, reg.epoch) == (1, (0,), 1)
        assert server.members == (1, frozenset({0}))
        assert meet(joiner, [first]) == [(2, (0, 1))] * 2
        assert server.members == (2, frozenset({0, 1}))
        assert sched.failure is None
    finally:
        close(joiner, first, server, sched=sched)


def test_a_failing_worker_leaves_the_others_barrier_and_a_replacement_takes_its_rank():
    sched = Scheduler(3, 1, elastic=(2, 3), **FAST).start()
    servers, workers = members(sched.port, 3)
    replacement = worker(sched.port, rank=1)
    try:
        outcomes = run_all([lambda: workers[0].barrier("step 9", timeout=20.0),
                            lambda: workers[2].barrier("step 9", timeout=20.0),
                            lambda: workers[1].fail("CUDA out of memory")])
        assert outcomes == [(1, (0, 2)), (1, (0, 2)), None], outcomes   # it left: they go on
        reg = replacement.register()                                     # its rank is vacant again
        assert (reg.rank, reg.joined, reg.members, reg.epoch) == (1, True, (0, 2), 2)
        assert servers[0].members == (2, frozenset({0, 2}))
        assert meet(replacement, [workers[0], workers[2]]) == [(3, (0, 1, 2))] * 3
        assert servers[0].members == (3, frozenset({0, 1, 2}))
        assert sched.failure is None
    finally:
        close(replacement, *workers, *servers, sched=sched)


def test_a_worker_removed_while_alive_hears_why_and_the_others_do_not():
    sched = Scheduler(2, 1, elastic=(1, 2), **FAST).start()
    servers, workers = members(sched.port, 2)
    try:
        killed(sched, workers[1], 1)
        goes_on(sched, workers[0], servers[0], (1, (0,)))
    finally:
        close(*workers, *servers, sched=sched)


def test_a_failure_below_the_minimum_aborts_every_node_naming_it():
    sched = Scheduler(2, 1, elastic=(2, 4), **FAST).start()
    servers, workers = members(sched.port, 2)
    try:
        workers[1].fail("boom")
        assert sched.wait(10) is False
        reason = (f"worker 1 (pid {PID} on 127.0.0.1) failed: boom; 1 worker remains, fewer than the "
                  "elastic minimum 2 (--elastic 2:4)")
        assert sched.failure == reason
        for node in (workers[0], servers[0]):
            assert node.aborted.wait(10) and node.abort_reason == reason
    finally:
        close(*workers, *servers, sched=sched)


def test_finished_workers_leave_and_the_servers_shut_down_after_the_last():
    sched = Scheduler(2, 1, elastic=(2, 2), **FAST).start()
    servers, workers = members(sched.port, 2)
    try:
        workers[1].finish()                      # a clean leave: no abort below the minimum
        assert workers[0].barrier("b", timeout=20.0) == (1, (0,))
        assert not servers[0].shutdown.is_set()
        workers[0].finish()
        assert servers[0].shutdown.wait(10), "the server was not told to shut down"
        servers[0].finish()
        assert sched.wait(10) is True
    finally:
        close(*workers, *servers, sched=sched)


def test_a_joiner_the_servers_do_not_acknowledge_gets_the_schedulers_error_naming_them():
    """A server whose heartbeats carry no epoch (one that never holds the new
    membership) holds the joiner back; at KVSTORE_TIMEOUT the scheduler's error
    names it, before the joiner's own deadline."""
    sched, servers, first, joiner = two_servers_and_a_joiner()
    try:
        assert not [r for r in run_all([n.register for n in servers + [first]])
                    if isinstance(r, BaseException)]
        stale(servers[1])
        with pytest.raises(RendezvousTimeout) as e:
            joiner.register()
        assert (f"worker 1 (pid {PID} on 127.0.0.1) could not join: server 1 (pid {PID} on 127.0.0.1) "
                "(at epoch 0) did not acknowledge membership epoch 1 within 2s (KVSTORE_TIMEOUT)") \
            in str(e.value)
        assert joiner.aborted.wait(10)           # removed: its heartbeats hear it
        assert "worker 1 was removed from the job" in joiner.abort_reason
        assert first.barrier("b", timeout=20.0) == (1, (0,))     # it was no member: no new epoch
        assert sched.failure is None
    finally:
        close(joiner, first, *servers, sched=sched)


def test_a_barrier_that_makes_a_member_aborts_the_job_when_a_server_never_holds_its_epoch():
    """Server 1 acknowledges the join, then its heartbeats carry no epoch: the barrier
    that makes the joiner a member ends, at KVSTORE_TIMEOUT, in an abort naming it."""
    sched, servers, first, joiner = two_servers_and_a_joiner()
    try:
        assert not [r for r in run_all([n.register for n in servers + [first]])
                    if isinstance(r, BaseException)]
        assert joiner.register().epoch == 1                       # both servers hold epoch 1
        stale(servers[1])
        outcomes = meet(joiner, [first])
        reason = (f"server 1 (pid {PID} on 127.0.0.1) did not acknowledge membership epoch 2 within "
                  "2s (KVSTORE_TIMEOUT): the workers that joined cannot start")
        assert [(type(o), str(o)) for o in outcomes] == [(JobAborted, reason)] * 2, outcomes
        assert sched.wait(10) is False and sched.failure == reason
        for node in servers:
            assert node.aborted.wait(10) and node.abort_reason == reason
    finally:
        close(joiner, first, *servers, sched=sched)


def test_a_pending_joiner_that_is_killed_drops_out_even_below_the_minimum():
    sched = Scheduler(2, 1, elastic=(2, 3), **FAST).start()
    servers, workers = members(sched.port, 2)
    joiner = worker(sched.port)
    try:
        workers[1].finish()                      # a clean leave: 1 member, below the minimum
        assert joiner.register().rank == 1
        killed(sched, joiner, 1)
        goes_on(sched, workers[0], servers[0], (2, (0,)))    # no member changed: no new epoch
    finally:
        close(joiner, *workers, *servers, sched=sched)


def test_progress_too_big_to_save_is_refused_naming_the_limit():
    sched = Scheduler(1, 1, elastic=(1, 1), **FAST).start()
    servers, workers = members(sched.port, 1)
    try:
        with pytest.raises(RendezvousError, match="acknowledgement of saved progress failed: progress "
                                                  "of 70011 bytes"):
            workers[0].save_progress({"blob": "x" * 70000})
        assert workers[0].progress == {}
    finally:
        close(*workers, *servers, sched=sched)
