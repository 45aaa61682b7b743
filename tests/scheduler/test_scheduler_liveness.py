"""The scheduler names who is missing: a barrier that times out names the workers
that did not arrive (on every waiting worker), and a standalone scheduler
(``python -m tracker.scheduler``) whose server dies after the shutdown ends
non-zero naming it instead of waiting for ever; nodes wait for a lost
scheduler's restart only when a launcher restarts it. Nodes are in-process
``Membership`` objects on 127.0.0.1 with random ports."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from tracker.control.errors import RendezvousTimeout
from tracker.control.membership import Membership
from tracker.control.records import absent_at_barrier
from tracker.control.rendezvous import Scheduler
from tracker.scheduler import serve

FAST = {"heartbeat_interval": 0.1, "heartbeat_timeout": 1.5, "timeout": 30.0}


def members(port, workers, servers=1):
    """Register ``servers`` servers and ``workers`` workers (explicit ranks) at once."""
    nodes = [Membership(role="server", rank=r, scheduler=("127.0.0.1", port), **FAST) for r in range(servers)]
    nodes += [Membership(role="worker", rank=r, scheduler=("127.0.0.1", port), **FAST) for r in range(workers)]
    results = run_all([node.register for node in nodes])
    assert not [r for r in results if isinstance(r, BaseException)], results
    return nodes[:servers], nodes[servers:]


def run_all(fns, timeout=30.0):
    """Run each function in its own thread; their results (or exceptions), in order."""
    results = [None] * len(fns)

    def call(i):
        try:
            results[i] = fns[i]()
        except BaseException as e:    # handed back to the test
            results[i] = e
    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a call did not return"
    return results


def test_a_barrier_that_times_out_names_the_absent_worker_on_every_waiter():
    sched = Scheduler(3, 1, **FAST).start()
    servers, workers = members(sched.port, 3)
    try:
        started = time.monotonic()
        outcomes = run_all([lambda: workers[0].barrier("step 7", timeout=1.0),
                            lambda: workers[2].barrier("step 7", timeout=1.0)])
        assert time.monotonic() - started < 10
        for e in outcomes:
            assert isinstance(e, RendezvousTimeout), outcomes
            text = str(e)
            assert "worker 1 (pid" in text and "did not arrive" in text, text
            assert "workers 0, 2 waited" in text and "'step 7'" in text, text
            assert "KVSTORE_TIMEOUT" in text
            assert absent_at_barrier(f"worker 0 (pid 1 on h) failed: {text}") == ["worker 1"]
        # the barrier is clean again: with everybody there it completes
        assert run_all([lambda w=w: w.barrier("again", timeout=20.0) for w in workers]) == [(0, (0, 1, 2))] * 3
        assert sched.failure is None
    finally:
        for node in workers + servers:
            node.close()
        sched.close()


def test_a_barrier_without_a_timeout_field_keeps_the_workers_own_deadline():
    """A node of an older version sends no `timeout`: the scheduler sets no deadline."""
    sched = Scheduler(2, 1, **FAST).start()
    servers, workers = members(sched.port, 2)
    try:
        workers[0].timeout = 0.5
        sent = workers[0]._request
        workers[0]._request = lambda op, what, limit=None, grace=0.0, **fields: sent(
            op, what, limit, 0.0, **{k: v for k, v in fields.items() if k != "timeout"})
        with pytest.raises(RendezvousTimeout, match="worker 0 waited 0.5s for a barrier"):
            workers[0].barrier("x")
    finally:
        for node in workers + servers:
            node.close()
        sched.close()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _standalone(port, workers=1):
    return {"KVSTORE_SCHEDULER_HOST": "127.0.0.1", "KVSTORE_SCHEDULER_PORT": str(port),
            "KVSTORE_NUM_WORKERS": str(workers), "KVSTORE_NUM_SERVERS": "1",
            "KVSTORE_HEARTBEAT_INTERVAL": "0.1", "KVSTORE_HEARTBEAT_TIMEOUT": "1.5",
            "KVSTORE_TIMEOUT": "30"}


@pytest.mark.parametrize("server_dies", [True, False], ids=["server-dies", "server-finishes"])
def test_standalone_scheduler_ends_when_a_server_dies_after_the_shutdown(server_dies, caplog):
    caplog.set_level(logging.ERROR, logger="tracker.scheduler")
    port = _free_port()
    code = []
    runner = threading.Thread(target=lambda: code.append(serve(_standalone(port))))
    runner.start()
    servers, workers = members(port, 1)
    try:
        workers[0].finish()                       # every worker done: the scheduler sends shutdown
        assert servers[0].shutdown.wait(20), "the server was not told to shut down"
        if server_dies:
            servers[0].close()                    # gone before its `finish`: heartbeats stop
        else:
            servers[0].finish()
        runner.join(30)
        assert not runner.is_alive(), "the standalone scheduler waits for ever"
    finally:
        servers[0].close()
        runner.join(30)
    if server_dies:
        assert code == [1]
        assert any("server 0 (pid" in r.getMessage() and "after it was told to shut down" in r.getMessage()
                   for r in caplog.records), caplog.text
    else:
        assert code == [0], caplog.text


def test_a_store_barrier_that_times_out_names_the_absent_worker(make_cluster):
    import numpy as np
    import kvstore
    from kvstore.errors import DeadlineError
    cluster = make_cluster(2, 1, timeout=1.5)
    failed, errors = threading.Event(), {}

    def work(rank):
        with kvstore.create("dist_sync", config=cluster.config("worker", rank)) as kv:
            kv.init("w", np.zeros(2, np.float32))
            if rank == 1:
                assert failed.wait(30)       # reaches no barrier until worker 0 gave up
                return
            try:
                kv.barrier()
            except DeadlineError as e:
                errors[rank] = str(e)
            finally:
                failed.set()
    results = run_all([lambda r=r: work(r) for r in range(2)])
    assert results == [None, None], results
    assert "worker 1 (pid" in errors[0] and "did not arrive (worker 0 waited)" in errors[0], errors


def test_two_failing_workers_give_one_abort_and_no_bad_message_warning(caplog):
    caplog.set_level(logging.INFO, logger="tracker.control.rendezvous")
    sched = Scheduler(2, 1, **FAST).start()
    servers, workers = members(sched.port, 2)
    try:
        workers[0].fail("first failure")
        assert sched.wait(10) is False
        workers[1].fail("second failure, a consequence")
        for node in servers:
            node.close()
        assert "worker 0" in sched.failure and "first failure" in sched.failure
        text = caplog.text
        assert "bad control message" not in text
        assert "scheduler listening on" in text and "for 2 workers and 1 server\n" in text + "\n"
    finally:
        sched.close()


def test_a_node_started_before_the_scheduler_waits_for_it_beyond_the_heartbeat_timeout():
    """Until the scheduler first answers, KVSTORE_TIMEOUT applies, not the heartbeat
    timeout: a mute listener on the port receives the node's heartbeats for longer
    than the heartbeat timeout, then the real scheduler takes the port."""
    import zmq
    ctx = zmq.Context()          # the mute listener's own: terminating it frees the port
    mute = ctx.socket(zmq.ROUTER)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    node = Membership(role="worker", rank=0, scheduler=("127.0.0.1", port),
                      heartbeat_interval=0.1, heartbeat_timeout=0.5, timeout=30.0)
    try:
        started, beats = time.monotonic(), 0
        while time.monotonic() - started < 1.0:          # > twice the heartbeat timeout
            assert mute.poll(5000), "no heartbeat arrived"
            frames = mute.recv_multipart()
            beats += b"heartbeat" in frames[-1]
        assert beats >= 5 and not node.aborted.is_set(), node.abort_reason
        mute.close(linger=0)
        ctx.term()
        sched = Scheduler(1, 1, port=port, **FAST).start()
        server = Membership(role="server", rank=0, scheduler=("127.0.0.1", port), **FAST)
        try:
            registered = run_all([node.register, server.register])
            assert registered[0].rank == 0, registered
        finally:
            server.close()
            sched.close()
    finally:
        node.close()
        if not ctx.closed:
            mute.close(linger=0)
            ctx.term()


def test_a_scheduler_that_cannot_bind_is_a_named_error_with_status_2(caplog):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        code = serve({"KVSTORE_SCHEDULER_PORT": str(port), "KVSTORE_NUM_WORKERS": "1",
                      "KVSTORE_NUM_SERVERS": "1"})
        assert code == 2
        assert f"the scheduler cannot listen on 127.0.0.1:{port}" in caplog.text
    finally:
        taken.close()


def test_an_invalid_log_level_for_the_standalone_scheduler_is_status_2():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-m", "tracker.scheduler"], capture_output=True, text=True,
                       timeout=60, env={"KVSTORE_LOG_LEVEL": "loud", "PYTHONPATH": root})
    assert p.returncode == 2 and "KVSTORE_LOG_LEVEL='loud' is invalid" in p.stderr, p.stderr


@pytest.mark.parametrize("restartable", [False, True], ids=["hand-started", "under-a-launcher"])
def test_a_node_waits_for_a_restart_only_of_a_scheduler_a_launcher_restarts(restartable):
    """The scheduler's `registered` says whether a launcher restarts it: a node that
    lost a hand-started one stops at the heartbeat timeout (1.5 s here); one under a
    launcher keeps trying for KVSTORE_SCHEDULER_RESTART_TIMEOUT (60 s here) more."""
    sched = Scheduler(1, 1, restartable=restartable, **FAST).start()
    nodes = [Membership(role=role, rank=0, scheduler=("127.0.0.1", sched.port), restart_timeout=60.0, **FAST)
             for role in ("server", "worker")]
    try:
        run_all([node.register for node in nodes])
        assert [node.restart_window for node in nodes] == [60.0 if restartable else 0.0] * 2
        sched.close()
        lost = nodes[1].aborted.wait(FAST["heartbeat_timeout"] + 3.0)     # (an event: at 1.5 s if it stops)
        assert lost is not restartable, nodes[1].abort_reason
        if not restartable:
            assert nodes[1].abort_reason.endswith("for 1.5s (KVSTORE_HEARTBEAT_TIMEOUT)"), nodes[1].abort_reason
    finally:
        for node in nodes:
            node.close()
        sched.close()
