"""Regression tests for the bugs the wire fuzzing (test_fuzz_server.py,
test_fuzz_scheduler.py) found; they were xfail until fixed.

Each sends the one message that used to crash, stall or mislead a server or the
scheduler, mostly to a small 1-worker, 1-server job (``one_worker_job``), and
checks that it is answered with an error while the job keeps working. One checks
a reply on the fuzz tests' live job, one that docs/protocol.md states the limits
the code enforces.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from fuzzing import ROOT, _deep, _with_raw
from kvstore.protocol import codec, decode, encode, ops
from tracker.control import wire
from tracker.control.rendezvous import Scheduler

pytest_plugins = ["fuzzing"]   # the module-scoped ``live`` fixture


# -- regressions: bugs this fuzzing found ---------------------------------------------------
# a server thread dying of the bug is the expected failure, not a warning
CRASHES = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")

@contextlib.contextmanager
def one_worker_job(make_cluster):
    """A 1-worker, 1-server job whose worker holds keys 3 (float32) and 4 (int32)
    and, once released, pulls key 3. Yields (cluster, server address, pull result)."""
    cluster = make_cluster(1, 1, timeout=6.0, heartbeat_interval=0.1, heartbeat_timeout=1.0)
    ready, release, box = threading.Event(), threading.Event(), {}

    def work(kv):
        kv.init([3, 4], [np.arange(4, dtype=np.float32), np.arange(4, dtype=np.int32)])
        box["addr"] = kv._client.servers[0]
        ready.set()
        release.wait(30)
        out = np.zeros(4, np.float32)
        kv.pull(3, out=out)
        return out

    def run():
        try:
            box["result"] = cluster.run(work, timeout=40)[0]
        except BaseException as e:  # the job may die of the bug under test
            box["result"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        assert ready.wait(20), "the job did not start"
        yield cluster, box["addr"], box
    finally:
        release.set()
        t.join(40)


def _send_one(address, frames, wait_ms=1000, alive=lambda: True):
    """One message from a fresh socket; its reply, or None after ``wait_ms`` (or as
    soon as ``alive()`` says the receiving thread died)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart(frames)
        end = time.monotonic() + wait_ms / 1000
        while time.monotonic() < end and alive():
            if sock.poll(50):
                return sock.recv_multipart()
        return None
    finally:
        sock.close(linger=0)
        ctx.term()


def _assert_served(cluster, box, reply):
    assert reply is not None, "no reply: the server died"
    header, _ = decode(reply)
    assert header["op"] == ops.ERROR, header
    assert cluster._threads[0].is_alive(), "the server thread died"


@CRASHES
# Regression (found by this fuzzing, fixed):
def test_zero_sized_buffer_with_huge_dims_is_rejected(make_cluster):
    with one_worker_job(make_cluster) as (cluster, address, box):
        header = {"v": 1, "op": ops.PUSH, "id": 5, "src": 0, "chunks": [[3, 0]],
                  "bufs": [["<f4", [0, 2 ** 39, 2 ** 39]]]}
        reply = _send_one(address, [msgpack.packb(header), b""],
                          alive=cluster._threads[0].is_alive)
        _assert_served(cluster, box, reply)
    assert np.array_equal(box["result"], np.arange(4, dtype=np.float32)), box["result"]


@CRASHES
# Regression (found by this fuzzing, fixed):
def test_error_op_without_id_is_rejected(make_cluster):
    with one_worker_job(make_cluster) as (cluster, address, box):
        reply = _send_one(address, [msgpack.packb({"v": 1, "op": "error", "src": 0, "bufs": []})],
                          alive=cluster._threads[0].is_alive)
        _assert_served(cluster, box, reply)
    assert np.array_equal(box["result"], np.arange(4, dtype=np.float32)), box["result"]


@CRASHES
# Regression (found by this fuzzing, fixed):
def test_compressed_push_to_an_int_chunk_is_rejected(make_cluster):
    with one_worker_job(make_cluster) as (cluster, address, box):
        frames = encode({"op": ops.PUSH, "id": 6, "src": 0, "chunks": [[4, 0]],
                         "compression": {"type": "2bit", "threshold": 1e300}},
                        [np.zeros(1, np.uint8)])
        reply = _send_one(address, frames, alive=cluster._threads[0].is_alive)
        _assert_served(cluster, box, reply)
    assert np.array_equal(box["result"], np.arange(4, dtype=np.float32)), box["result"]


# Regression (found by this fuzzing, fixed):
def test_a_peer_that_never_reads_does_not_stall_the_server(make_cluster):
    with one_worker_job(make_cluster) as (cluster, address, box):
        ctx = zmq.Context()
        flood = ctx.socket(zmq.DEALER)
        flood.setsockopt(zmq.LINGER, 0)
        flood.setsockopt(zmq.RCVHWM, 1)
        flood.setsockopt(zmq.RCVBUF, 4096)
        flood.connect(address)
        try:
            # each request makes a ~6 KB error reply that this socket never reads
            msg = msgpack.packb({"v": 1, "op": ops.PULL, "id": 1, "src": 0, "chunks": [["x" * 6000]],
                                 "bufs": []})
            for _ in range(2500):
                flood.send(msg)
            # the server reaches the stall only after it has worked through ~1500 of them:
            # keep asking (each probe must be answered in time) until it surely has
            probe = encode({"op": ops.PULL, "id": 2, "src": 0, "chunks": [[3, 0]]})
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                reply = _send_one(address, probe, wait_ms=2000)
                assert reply is not None, "the server stopped answering other peers"
                header, arrays = decode(reply)
                assert header["op"] == ops.OK and np.array_equal(arrays[0], np.arange(4, dtype=np.float32))
        finally:
            # read the replies after all, so that a stalled server carries on and the job ends
            end = time.monotonic() + 20
            while time.monotonic() < end and flood.poll(300):
                with contextlib.suppress(zmq.Again):
                    while True:
                        flood.recv(zmq.NOBLOCK)
            flood.close(linger=0)
            ctx.term()


# Regression (issue 40, an outside tester; fixed): a request's declared shape sizes what the
# server allocates; it is checked (no 64-bit wrap) and counted against KVSTORE_SERVER_MEMORY
# before anything is allocated
@CRASHES
@pytest.mark.parametrize("header", [
    {"op": ops.INIT_ROWS, "chunk": ["emb", 0], "shape": [4, 2 ** 32, 2 ** 32], "dtype": "float32",
     "servers": 1, "init": None, "bufs": [["<i8", [0]], ["<f4", [0]]]},
    {"op": ops.INIT_ROWS, "chunk": ["emb", 0], "shape": [2 ** 62, 2 ** 20], "dtype": "float32",
     "servers": 1, "init": None, "bufs": [["<i8", [0]], ["<f4", [0]]]},
    {"op": ops.INIT_DYN, "chunk": ["emb", 0], "servers": 1, "bufs": [],
     "spec": {"row_shape": [2 ** 32, 2 ** 32], "dtype": "float32", "init": ["zeros", 0.0], "seed": 0,
              "budget": None, "evict_after": None, "evict": True}},
], ids=["init_rows-wrapping", "init_rows-huge", "init_dyn-wrapping"])
def test_a_shape_too_large_to_hold_is_refused_naming_key_size_and_setting(make_cluster, header):
    with one_worker_job(make_cluster) as (cluster, address, box):
        body = [b"", b""] if header["bufs"] else []
        reply = _send_one(address, [msgpack.packb({"v": 1, "id": 9, "src": 0, **header}), *body],
                          alive=cluster._threads[0].is_alive)
        _assert_served(cluster, box, reply)
        message = decode(reply)[0]["message"]
        assert "key 'emb'" in message and "bytes" in message and "KVSTORE_SERVER_MEMORY" in message, message
    assert np.array_equal(box["result"], np.arange(4, dtype=np.float32)), box["result"]


# Regression (found by this fuzzing, fixed):
def test_error_reply_to_a_bool_id_carries_null(live):
    """Spec §6: "If the header could not be parsed as a msgpack map with an integer
    id, the server answers with id null"."""
    frames = [msgpack.packb({"v": 1, "op": ops.PULL, "id": True, "src": 0, "chunks": []})]
    reply = _send_one(live.servers[0], frames)
    assert reply is not None
    header = msgpack.unpackb(reply[0])
    assert header["op"] == ops.ERROR
    assert header["id"] is None, f"error reply carries id {header['id']!r}"


@CRASHES
# Regression (found by this fuzzing, fixed):
def test_deeply_nested_chunk_id_is_rejected(make_cluster):
    with one_worker_job(make_cluster) as (cluster, address, box):
        head = _with_raw({"v": 1, "op": ops.PULL, "id": 8, "src": 0, "bufs": []}, "chunks",
                         b"\x91" + _deep(1010))
        assert msgpack.unpackb(head)["id"] == 8       # valid msgpack, just deep
        reply = _send_one(address, [head], alive=cluster._threads[0].is_alive)
        _assert_served(cluster, box, reply)
    assert np.array_equal(box["result"], np.arange(4, dtype=np.float32)), box["result"]


# Regression (found by this fuzzing, fixed):
def test_scheduler_survives_deeply_nested_node_field(make_cluster):
    cluster = make_cluster(1, 1, timeout=6.0, heartbeat_timeout=1.0)
    ready, release, box = threading.Event(), threading.Event(), {}

    def work(kv):
        ready.set()
        release.wait(20)
        kv.barrier()
        return "ok"

    def run():
        try:
            box["result"] = cluster.run(work, timeout=30)[0]
        except BaseException as e:  # the job may die of the bug under test
            box["result"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        assert ready.wait(20)
        frame = _with_raw({"v": 1, "op": "heartbeat"}, "node", _deep(1010))
        reply = _send_one(f"tcp://127.0.0.1:{cluster.scheduler.port}", [frame],
                          alive=cluster.scheduler._thread.is_alive)
        assert reply is not None, "the scheduler did not answer"
        assert wire.decode(reply[0])["op"] in ("ack", "error")
        assert cluster.scheduler.failure is None, cluster.scheduler.failure
    finally:
        release.set()
        t.join(30)
    assert box["result"] == "ok", box["result"]


# Regression (found by this fuzzing, fixed):
def test_scheduler_survives_register_with_infinite_pid():
    sched = Scheduler(1, 1, timeout=10.0).start()
    try:
        frame = msgpack.packb({"v": 1, "op": "register", "id": 1, "node": "worker-x", "role": "worker",
                               "rank": None, "host": "h", "addr": "", "pid": float("inf")})
        reply = _send_one(f"tcp://127.0.0.1:{sched.port}", [frame], alive=sched._thread.is_alive)
        assert sched.failure is None, sched.failure
        assert reply is not None and wire.decode(reply[0])["op"] == "error"
    finally:
        sched.close()


# Regression (found by this fuzzing, fixed):
def test_documented_limits_match_the_code():
    with open(os.path.join(ROOT, "docs", "protocol.md")) as f:
        doc = f.read()
    header = re.search(r"`MAX_HEADER_BYTES` = [^(|]*\(([\d,]+) bytes\)", doc)
    bufs = re.search(r"`MAX_BUFFERS` = ([\d,]+)", doc)
    assert header and bufs, "docs/protocol.md §2.4 no longer states the limits"
    assert codec.MAX_HEADER_BYTES == int(header.group(1).replace(",", ""))
    assert codec.MAX_BUFFERS == int(bufs.group(1).replace(",", ""))
