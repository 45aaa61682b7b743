"""Data channels (kvstore.transport.channel): framing, the token handshake, the
reader and writer threads, and their use by a job over tcp."""

from __future__ import annotations

import logging
import os
import random
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import msgpack
import numpy as np
import pytest

from kvstore.errors import DeadlineError, NodeFailedError, ProtocolError
from kvstore.protocol import encode
from kvstore.transport import channel

pytestmark = pytest.mark.timeout(60)


def pair():
    a, b = socket.socketpair()
    return a, b


def message(req_id=7, arrays=()):
    return encode({"op": "ok", "id": req_id}, list(arrays))


def test_a_message_round_trips_into_the_destinations_it_names():
    a, b = pair()
    x = np.arange(1000, dtype=np.float32)
    y = np.arange(10, dtype=np.int64)
    sent = channel.send_message(a, message(3, [x, y]))
    into = [np.empty(1000, np.float32), np.empty(10, np.int64)]
    seen = []
    header, arrays, nbytes = channel.read_message(b, 1 << 20, lambda h: seen.append(h["id"]) or into)
    assert header["op"] == "ok" and seen == [3] and nbytes == sent
    assert arrays[0] is into[0] and arrays[1] is into[1]
    np.testing.assert_array_equal(into[0], x)
    np.testing.assert_array_equal(into[1], y)


@pytest.mark.parametrize("wrong", [np.empty(1000, np.float64), np.empty(999, np.float32),
                                   np.empty(2000, np.float32)[::2], None])
def test_a_destination_that_does_not_fit_gets_a_new_array(wrong):
    a, b = pair()
    x = np.arange(1000, dtype=np.float32)
    channel.send_message(a, message(3, [x]))
    _, arrays, _ = channel.read_message(b, 1 << 20, lambda h: [wrong])
    assert arrays[0] is not wrong and arrays[0].dtype == np.float32
    np.testing.assert_array_equal(arrays[0], x)


def test_the_end_between_messages_is_eof_and_inside_one_a_connection_error():
    a, b = pair()
    channel.send_message(a, message(1, [np.ones(100, np.float32)]))
    a.close()
    channel.read_message(b, 1 << 20)
    with pytest.raises(EOFError):
        channel.read_message(b, 1 << 20)
    a, b = pair()
    frames = message(2, [np.ones(100, np.float32)])
    head = bytes(frames[0])
    a.sendall(struct.pack("<I", len(head)) + head + b"\0" * 10)   # 10 of 400 bytes
    a.close()
    with pytest.raises(ConnectionError, match="10 of the 400 bytes of buffer 0 of request 2"):
        channel.read_message(b, 1 << 20)


def raw(payload: bytes) -> socket.socket:
    a, b = pair()
    a.sendall(payload)
    a.close()
    return b


@pytest.mark.parametrize("payload, match", [
    (struct.pack("<I", (1 << 20) + 1), "exceeds the limit"),
    (struct.pack("<I", 3) + b"\xc1\xc1\xc1", "not valid msgpack"),
    (struct.pack("<I", 1) + msgpack.packb(5), "not a map"),
])
def test_malformed_headers_are_protocol_errors(payload, match):
    with pytest.raises(ProtocolError, match=match):
        channel.read_message(raw(payload), 1 << 20)


@pytest.mark.parametrize("change, match", [
    ({"shm": {"segs": [], "refs": [None]}}, "may not point into shared or device memory"),
    ({"dev": {"segs": [], "refs": [None]}}, "may not point into shared or device memory"),
    ({"layout": True}, "not in a layout frame"),       # (a channel writes each buffer on its own)
    ({"bufs": [["|O", [3]]]}, "not allowed"),
    ({"bufs": [["<f4", [1 << 30]]]}, "exceeds the limit"),
])
def test_malformed_buffer_descriptions_are_protocol_errors(change, match):
    header = msgpack.unpackb(bytes(message(4, [np.ones(3, np.float32)])[0]))
    head = msgpack.packb({**header, **change})
    with pytest.raises(ProtocolError, match=match):
        channel.read_message(raw(struct.pack("<I", len(head)) + head), 1 << 20)


def test_random_bytes_never_raise_anything_but_the_documented_errors():
    rng = random.Random(5)
    for i in range(400):
        if i % 2:                 # garbage, sometimes behind a plausible length
            payload = rng.randbytes(rng.randrange(0, 64))
            if rng.random() < 0.5:
                payload = struct.pack("<I", len(payload)) + payload
        else:                     # a valid header, then too few, enough or extra random bytes
            bufs = [[rng.choice(["<f4", "|u1", "<i8", "|O"]), [rng.randrange(0, 300)]]
                    for _ in range(rng.randrange(0, 4))]
            head = msgpack.packb({"v": 1, "op": "ok", "id": i, "bufs": bufs})
            payload = struct.pack("<I", len(head)) + head + rng.randbytes(rng.randrange(0, 4000))
        try:
            header, arrays, _ = channel.read_message(raw(payload), 1 << 16)
        except (EOFError, ConnectionError, ProtocolError):
            continue
        assert len(arrays) == len(header["bufs"])


def test_a_message_larger_than_the_limit_in_total_is_refused():
    frames = message(1, [np.ones(100, np.float32), np.ones(100, np.float32)])
    a, b = pair()
    channel.send_message(a, frames)
    with pytest.raises(ProtocolError, match="more than 600 bytes"):
        channel.read_message(b, 600)           # each buffer (400 B) fits, both do not


# -- threads and handshake ----------------------------------------------------------------------
def test_a_channel_delivers_in_order_and_its_end_once():
    a, b = pair()
    got, ends = [], []
    done = threading.Event()

    def deliver(header, arrays, nbytes):
        got.append((header["id"], arrays[0].copy()))
        if len(got) == 3:
            done.set()
    receiver = channel.Receiver(b, "test-b", 1 << 20, deliver, lambda e: (ends.append(e), done.set()))
    sender = channel.Sender(a, "test-a", lambda e: None)
    for i in range(3):
        sender.send(message(i, [np.full(50_000, i, np.float32)]))
    assert done.wait(10)
    assert [i for i, _ in got] == [0, 1, 2] and all((v == i).all() for i, v in got)
    ended = threading.Event()
    receiver._failed = lambda e: (ends.append(e), ended.set())
    sender.close()                        # the peer sees the end, once
    assert ended.wait(10)
    assert len(ends) == 1 and isinstance(ends[0], EOFError) and receiver.broken
    # counted once the sender's writer has stopped (it counts a message after writing it,
    # which may be after the receiver has delivered it)
    assert receiver.bytes_received == sender.bytes_sent > 3 * 200_000
    receiver.close()                      # closing reports nothing
    assert len(ends) == 1


def test_a_write_only_end_breaks_on_any_message_it_reads():
    """A server's end of a channel carries replies only: a worker that writes to it
    is out of protocol, and the channel ends (the worker then sees it end)."""
    a, b = pair()
    ends = []
    ended = threading.Event()
    server_end = channel.Sender(b, "test-server", lambda e: (ends.append(e), ended.set()))
    a.sendall(b"x")
    assert ended.wait(10)
    assert isinstance(ends[0], ProtocolError) and "only carries replies" in str(ends[0])
    assert a.recv(1) == b""                      # the worker's end sees the close
    server_end.close()
    a.close()


def test_the_listener_accepts_each_token_once_and_nothing_else(caplog):
    accepted = []
    arrived = threading.Event()
    listener = channel.Listener("127.0.0.1", lambda peer, sock: (accepted.append((peer, sock)),
                                                                 arrived.set()), "test")
    silent = socket.create_connection(("127.0.0.1", listener.port))   # never sends a token
    try:
        replaced = listener.offer(b"worker-a")
        token = listener.offer(b"worker-a")        # one token per peer: the newest
        start = time.monotonic()
        sock = channel.connect("127.0.0.1", listener.port, token, 5.0)
        assert time.monotonic() - start < listener.TOKEN_TIMEOUT   # the silent one held up nothing
        assert arrived.wait(10)
        assert [p for p, _ in accepted] == [b"worker-a"]
        with caplog.at_level(logging.WARNING, logger="kvstore.transport.channel"):
            # used once already; replaced by a newer one; never issued
            for bad in (token, replaced, b"\0" * channel.TOKEN_BYTES):
                with pytest.raises(ConnectionError):
                    channel.connect("127.0.0.1", listener.port, bad, 5.0)
        assert caplog.text.count("refused a data-channel connection from 127.0.0.1: wrong token") == 3
        assert len(accepted) == 1
        sock.close()
    finally:
        silent.close()
        listener.close()
        for _, s in accepted:
            s.close()


# -- in a job -------------------------------------------------------------------------------------
N = 50_000


def registered(cluster, ranks) -> threading.Event:
    """An event set once the servers ``ranks`` registered a data channel from every
    worker. A server's listener thread acknowledges a channel before it registers
    it, and until then the server answers that worker through ZeroMQ: a worker's
    first requests can overtake its registration (seen under load). Call before
    the workers start."""
    left, lock, done = {r: cluster.num_workers for r in ranks}, threading.Lock(), threading.Event()
    for r in ranks:
        listener = cluster.nodes[r]._data.endpoints["tcp"]._listener

        def accepted(peer, sock, r=r, inner=listener._accepted):
            inner(peer, sock)
            with lock:
                left[r] -= 1
                if not any(left.values()):
                    done.set()
        listener._accepted = accepted
    if not left:
        done.set()
    return done


def pushpull_twice(kv, channels: threading.Event | None = None):
    kv.init(1, np.zeros(N, np.float32))
    if channels is not None:      # the servers' replies go on the channels from here on
        assert channels.wait(20), "the servers did not register the workers' data channels"
    out = np.empty(N, np.float32)
    for step in range(2):
        kv.pushpull(1, np.full(N, kv.rank + step, np.float32), out=out)
    return out.copy(), [link.receiver is not None and link.receiver.bytes_received > 0
                        for link in kv._client.links], \
        kv.comm_stats()


@pytest.mark.parametrize("settings, used", [
    ({}, True),
    ({"data_channel": False}, False),
    ({"secret": "ab" * 32, "secure": True}, False),     # never in clear next to CURVE
])
def test_channels_carry_large_messages_over_tcp_unless_off_or_encrypted(make_cluster, settings, used):
    cluster = make_cluster(2, 2, transport="tcp", chunk_bytes=16384, channel_bytes=16384, **settings)
    ready = registered(cluster, [0, 1]) if used else None
    for out, channels, stats in cluster.run(lambda kv: pushpull_twice(kv, ready)):
        np.testing.assert_array_equal(out, np.full(N, 0 + 1 + 2, np.float32))
        assert channels == [used, used]
        assert stats["bytes_sent"] >= 2 * N * 4 and stats["bytes_received"] >= 2 * N * 4
    for node in cluster.nodes:
        assert (len(node._data.endpoints["tcp"]._channels) == 2) == used


def test_a_channel_that_breaks_fails_the_waiting_call_fast(make_cluster):
    """The server's end of worker 0's channel goes away while worker 0 waits for a
    pushpull reply on it: worker 0 gets NodeFailedError naming the channel at once,
    not a deadline error after KVSTORE_TIMEOUT."""
    cluster = make_cluster(2, 1, transport="tcp", channel_bytes=16384, timeout=30.0)
    data = cluster.nodes[0]._data
    intercept = data.intercept

    def break_on_pushpull(peer, header, arrays):
        if header["op"] == "pushpull" and header["src"] == 0:
            data.endpoints["tcp"]._channels[peer]._break(ConnectionError("cut by the test"))
        return intercept(peer, header, arrays)
    data.intercept = break_on_pushpull
    ready = registered(cluster, [0])   # the channel exists before the pushpull (see registered)

    def work(kv):
        kv.init(1, np.zeros(N, np.float32))
        if kv.rank == 1:
            return None              # never pushes: the round cannot complete
        assert ready.wait(20), "server 0 did not register the workers' data channels"
        start = time.monotonic()
        with pytest.raises(NodeFailedError, match="data channel to server 0") as e:
            kv.pushpull(1, np.ones(N, np.float32), out=np.empty(N, np.float32))
        return time.monotonic() - start, str(e.value)
    elapsed, message = cluster.run(work)[0]
    assert elapsed < 10, message
    assert "pushpull of key 1" in message


@pytest.mark.parametrize("how", ["no listener", "connection refused"])
def test_a_worker_that_cannot_open_a_channel_stays_on_zeromq(make_cluster, caplog, how):
    """A server without data channels answers the offer with no port; one whose port
    refuses the connection makes the worker log why: either way the job runs on
    ZeroMQ alone, with the same sums."""
    cluster = make_cluster(2, 2, transport="tcp", chunk_bytes=16384, channel_bytes=16384)
    tcp = cluster.nodes[1]._data.endpoints["tcp"]
    tcp._listener.close()                   # the port stops accepting connections
    if how == "no listener":
        tcp._listener = None
    ready = registered(cluster, [0])
    with caplog.at_level(logging.WARNING, logger="kvstore.transport.links.tcp_link"):
        for out, channels, _ in cluster.run(lambda kv: pushpull_twice(kv, ready)):
            np.testing.assert_array_equal(out, np.full(N, 0 + 1 + 2, np.float32))
            assert channels == [True, False], caplog.text
    refused = caplog.text.count("no data channel to server 1")
    assert refused == (2 if how == "connection refused" else 0)
    if refused:
        assert "its large replies come through ZeroMQ" in caplog.text


def test_a_call_that_gives_up_leaves_no_reader_that_could_write_into_its_output(make_cluster):
    """A pushpull that times out while its reply is due on a data channel: the
    channel is closed (its reader joined) before the DeadlineError reaches the
    caller, so the late reply cannot land in ``out`` while the caller uses it."""
    cluster = make_cluster(2, 1, transport="tcp", channel_bytes=16384, timeout=2.0)
    gave_up, finished = threading.Event(), threading.Event()

    def work(kv):
        kv.init(1, np.zeros(N, np.float32))
        out = np.empty(N, np.float32)
        if kv.rank == 1:                   # pushes only once worker 0 has given up
            assert gave_up.wait(20)
            try:                           # completes the round, unless worker 0's failure
                kv.pushpull(1, np.ones(N, np.float32), out=out)   # aborted the job first
            except NodeFailedError:
                pass
            finished.set()
            return None
        reader = kv._client.links[0].receiver._threads[0]
        with pytest.raises(DeadlineError):
            kv.pushpull(1, np.ones(N, np.float32), out=out)
        state = (kv._client.links[0].receiver, dict(kv._client.links[0]._into), reader.is_alive())
        out[:] = -1
        gave_up.set()
        assert finished.wait(20)           # the round completed (or the job was aborted)
        seen[0] = state, bool((out == -1).all())

    seen = {}
    try:
        cluster.run(work)
    except NodeFailedError:                # worker 0's failure aborts the job as the stores close
        pass
    (channel_after, into_after, reader_alive), untouched = seen[0]
    assert channel_after is None and into_after == {} and not reader_alive
    assert untouched


KILLED_MID_ROUND = textwrap.dedent("""
    import os, signal, numpy as np, kvstore
    from kvstore.transport import Advert
    kv = kvstore.create("dist_sync")
    kv.init(1, np.zeros(600_000, np.float32))
    out = np.empty(600_000, np.float32)
    kv.pushpull(1, np.ones(600_000, np.float32), out=out)
    print("RANK", kv.rank, "SUM", out[0], "CHANNELS",
          ",".join(str(c.receiver is not None and c.receiver.bytes_received > 0) for c in kv._client.links),
          flush=True)
    kv.barrier()
    if kv.rank == 0:     # server 0 dies while both workers' next replies are due from it
        os.kill(Advert.parse(kv._membership.registration.servers[0]).pid, signal.SIGKILL)
    kv.pushpull(1, np.ones(600_000, np.float32), out=out)
    print("FINISHED", kv.rank, flush=True)
""")


@pytest.mark.slow
def test_a_server_killed_while_replies_are_due_on_its_channel_fails_the_job_fast(tmp_path):
    """Real processes over tcp, replies through data channels: a server killed with
    SIGKILL ends the job within seconds, naming it; no worker finishes its call."""
    from services import FAST_FAILURE, ROOT
    script = tmp_path / "job.py"
    script.write_text(KILLED_MID_ROUND)
    env = {**os.environ, "PYTHONPATH": ROOT, "KVSTORE_TIMEOUT": "60", "KVSTORE_TRANSPORT": "tcp",
           "KVSTORE_CHANNEL_BYTES": "65536", **FAST_FAILURE}
    start = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "tracker.local", "-n", "2", "-s", "2", sys.executable,
                        str(script)], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    text = p.stdout + p.stderr
    assert time.monotonic() - start < 40, text      # not KVSTORE_TIMEOUT (60 s)
    lines = sorted(line.split("RANK", 1)[1].split() for line in p.stdout.splitlines() if "RANK " in line)
    assert lines == [["0", "SUM", "2.0", "CHANNELS", "True,True"],
                     ["1", "SUM", "2.0", "CHANNELS", "True,True"]], text
    assert p.returncode == 128 + 9, text
    assert "job failed: server 0 was killed by SIGKILL" in text
    assert "FINISHED" not in p.stdout
