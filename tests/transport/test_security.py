"""Every connection of a job proves it holds the job's secret; with KVSTORE_SECURE
all traffic is CURVE-encrypted; the secret never appears on a command line."""

import logging
import os
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

import kvstore
from kvstore.config import Config
from kvstore.errors import KVStoreError
from kvstore.protocol import encode
from tracker.control import wire
from tracker.control.security import Handshakes, Security, new_secret, peer_address

SECRET = new_secret()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def probe(address: str, frames, security: Security = Security(), wait_ms=1500, source=None):
    """Send one message from an outsider's socket (connecting from the loopback
    address ``source`` if given); return the reply or None."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    security.connect(sock)
    sock.connect(address.replace("tcp://", f"tcp://{source}:0;") if source else address)
    sock.send_multipart(frames)
    reply = sock.recv_multipart() if sock.poll(wait_ms) else None
    sock.close()
    ctx.term()
    return reply


def store_values(kv):
    kv.init("w", np.arange(4, dtype=np.float32))
    kv.push("w", np.ones(4, np.float32))
    out = np.empty(4, np.float32)
    kv.pull("w", out=out)
    return out


@pytest.mark.parametrize("secure", [False, True], ids=["plain-token", "curve"])
def test_outsiders_are_rejected_and_logged_while_the_job_runs(make_cluster, caplog, secure):
    cluster = make_cluster(1, 1, secret=SECRET, secure=secure)
    scheduler = f"tcp://127.0.0.1:{cluster.scheduler.port}"
    pull = encode({"op": "pull", "id": 1, "src": 0, "chunks": [["w", 0]]})
    register = [wire.encode("register", id=1, node="intruder", role="worker", rank=0,
                            host="127.0.0.1", pid=1)]
    wrong = Security(new_secret(), secure)
    downgrade = Security(SECRET, not secure)   # right secret, other mechanism

    def job(kv):
        server = kv._client.servers[0]
        with caplog.at_level(logging.WARNING):
            replies = [probe(server, pull), probe(server, pull, wrong), probe(server, pull, downgrade),
                       probe(scheduler, register), probe(scheduler, register, wrong)]
        return replies, store_values(kv)

    replies, values = cluster.run(job)[0]
    assert replies == [None] * 5, "an outsider got an answer"
    np.testing.assert_array_equal(values, 1)     # the real worker was served throughout
    assert re.search(r"server rejected a connection (from|on) (tcp://)?127\.0\.0\.1", caplog.text)
    assert re.search(r"scheduler rejected a connection (from|on) (tcp://)?127\.0\.0\.1", caplog.text)
    assert len(caplog.records) < 20          # retrying peers do not flood the log


@pytest.mark.parametrize("secure", [False, True], ids=["plain-token", "curve"])
def test_rejections_name_the_peers_address(make_cluster, caplog, secure):
    """Each outsider connects from a loopback address of its own, and every
    rejection is logged with that address: credentials ZAP refused, and handshakes
    that fail before ZAP is asked (no security, the other mechanism, CURVE keys
    of another secret), never with the refusing socket's own endpoint only."""
    cluster = make_cluster(1, 1, secret=SECRET, secure=secure)
    scheduler = f"tcp://127.0.0.1:{cluster.scheduler.port}"
    outsiders = {"127.0.0.21": Security(), "127.0.0.22": Security(new_secret(), secure),
                 "127.0.0.23": Security(SECRET, not secure)}

    def logged(text: str) -> bool:
        return any(text in r.getMessage() for r in caplog.records)

    def job(kv):
        server = kv._client.servers[0]
        missing, deadline = [], time.monotonic() + 30
        with caplog.at_level(logging.WARNING):
            for source, security in outsiders.items():
                for name, address in (("server", server), ("scheduler", scheduler)):
                    wanted = f"{name} rejected a connection from {source}"
                    # an outsider retries (ZeroMQ reconnects): each try is a rejection
                    while not logged(wanted) and time.monotonic() < deadline:
                        assert probe(address, [b"x"], security, wait_ms=500, source=source) is None
                    if not logged(wanted):
                        missing.append(wanted)
        return missing, store_values(kv)

    missing, values = cluster.run(job)[0]
    assert missing == [], "\n".join([*missing, "logged:", caplog.text])
    np.testing.assert_array_equal(values, 1)


def test_a_failed_handshake_is_paired_with_the_peer_read_at_its_accept():
    """ZeroMQ's failure event names no connection: the DISCONNECTED event that
    follows it does (the descriptor of the accept)."""
    peers = {7: "10.0.0.5", 8: "10.0.0.6", 9: None}
    handshakes = Handshakes(peer_of=lambda fd, endpoint: peers[fd])
    endpoint = "tcp://0.0.0.0:5000"

    def event(kind, value=0):
        return handshakes.on_event(kind, value, endpoint)

    assert [event(zmq.EVENT_ACCEPTED, fd) for fd in (7, 8, 9)] == [None] * 3
    assert event(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, 0x11000001) is None
    assert event(zmq.EVENT_DISCONNECTED, 8) == ("HANDSHAKE_FAILED_PROTOCOL", "10.0.0.6")
    assert event(zmq.EVENT_DISCONNECTED, 7) is None          # a connection that just ended
    assert event(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 104) is None
    assert event(zmq.EVENT_DISCONNECTED, 9) == ("HANDSHAKE_FAILED_NO_DETAIL", None)  # gone too soon
    peers[8] = "10.0.0.9"     # the descriptor of a later connection
    event(zmq.EVENT_ACCEPTED, 8)
    event(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 104)
    assert event(zmq.EVENT_DISCONNECTED, 8) == ("HANDSHAKE_FAILED_NO_DETAIL", "10.0.0.9")


def test_peer_address_reads_the_connection_behind_a_descriptor():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        endpoint = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        with socket.socket() as client:
            client.bind(("127.0.0.31", 0))
            client.connect(listener.getsockname())
            conn, _ = listener.accept()
            with conn:
                fd = conn.fileno()
                assert peer_address(fd, endpoint) == "127.0.0.31"
                assert peer_address(fd, "tcp://127.0.0.1:1") is None   # not that endpoint's
    assert peer_address(fd, endpoint) is None    # closed
    a, b = socket.socketpair()
    with a, b:
        assert peer_address(a.fileno(), "ipc://@x") == f"pid {os.getpid()} uid {os.getuid()}"


def test_a_worker_with_the_wrong_secret_fails_fast_with_a_clear_error(make_cluster):
    cluster = make_cluster(1, 1, secret=SECRET)
    bad = cluster.config("worker", 0).replace(secret=new_secret())
    started = time.monotonic()
    with pytest.raises(KVStoreError, match="rejected this process's credentials"):
        kvstore.create("dist_sync", config=bad)
    assert time.monotonic() - started < 10    # not the 30 s registration deadline
    assert cluster.run(store_values)[0].tolist() == [1, 1, 1, 1]


def test_encryption_needs_a_secret():
    with pytest.raises(kvstore.ConfigError, match="KVSTORE_SECRET"):
        Config(secure=True).security()


def test_config_repr_hides_the_secret():
    assert SECRET not in repr(Config(secret=SECRET))


@pytest.mark.slow
def test_curve_job_through_the_launcher_and_no_secret_on_any_command_line(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import os, numpy as np, kvstore\n"
        "kv = kvstore.create('dist_sync')\n"
        "kv.init(1, np.zeros(3, np.float32))\n"
        "kv.push(1, np.full(3, kv.rank + 1, np.float32))\n"
        "out = np.empty(3, np.float32); kv.pull(1, out=out)\n"
        "cmdlines = []\n"
        "for pid in os.listdir('/proc'):\n"
        "    try: cmdlines.append(open(f'/proc/{pid}/cmdline', 'rb').read())\n"
        "    except OSError: pass\n"
        "secret = os.environ['KVSTORE_SECRET'].encode()\n"
        "print('SUM', out[0], 'SECRET-ON-CMDLINE', any(secret in c for c in cmdlines), flush=True)\n"
        "kv.close()\n")
    env = {**os.environ, "KVSTORE_SECURE": "1", "PYTHONPATH": ROOT}
    env.pop("KVSTORE_SECRET", None)
    p = subprocess.run([sys.executable, "-m", "tracker.local", "-n", "2", "-s", "2", sys.executable,
                        str(script)], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("SUM 3.0 SECRET-ON-CMDLINE False") == 2, p.stdout
    dry = subprocess.run([sys.executable, "-m", "tracker.local", "-n", "1", "--dry-run",
                          "--env", f"KVSTORE_SECRET={SECRET}", "python", "x.py"],
                         env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert SECRET not in dry.stdout + dry.stderr


def test_a_monitor_event_is_read_as_libzmq_writes_it():
    import struct
    from tracker.control.security import monitor_event
    frames = [struct.pack("=hi", zmq.EVENT_ACCEPTED, 17), b"tcp://127.0.0.1:5555"]
    assert monitor_event(frames) == (zmq.EVENT_ACCEPTED, 17, "tcp://127.0.0.1:5555")
    with pytest.raises(RuntimeError, match="not a ZeroMQ monitor event"):
        monitor_event([b"\x00" * 5, b"x"])
