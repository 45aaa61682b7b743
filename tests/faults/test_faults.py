"""Network faults injected between workers and servers: duplicated, reordered and
delayed messages heal (exact results); a lost message ends the job with an error
naming the server within the deadline. Never a wrong result, never a hang."""

import dataclasses
import random
import threading
import time

import numpy as np
import pytest
import zmq

import kvstore
from kvstore.errors import DeadlineError, NodeFailedError

STEPS, SHAPE = 12, (3000,)


class FaultySocket:
    """Wraps a server's ROUTER socket and misbehaves on the way in (and out)."""

    def __init__(self, sock, fault: str, p: float = 0.3, seed: int = 0, drop_after: int = 20):
        self._sock, self.fault, self.p = sock, fault, p
        self._rng = random.Random(seed)
        self._held = []          # (release time, frames)
        self._ready = []         # frames to hand out before reading the socket again
        self.seen = self.injected = 0
        self._drop_after = drop_after

    def __getattr__(self, name):
        return getattr(self._sock, name)

    def poll(self, timeout=None, flags=zmq.POLLIN):
        if self._ready or any(t <= time.monotonic() for t, _ in self._held):
            return zmq.POLLIN
        return self._sock.poll(min(timeout or 20, 20), flags)

    def recv_multipart(self, flags=0, copy=True):
        if self._ready:
            return self._ready.pop(0)
        now = time.monotonic()
        for item in self._held:
            if item[0] <= now:
                self._held.remove(item)
                return item[1]
        frames = self._sock.recv_multipart(flags, copy=copy)
        self.seen += 1
        if self.fault == "drop" and self.seen == self._drop_after:
            self.injected += 1
            raise zmq.Again()                       # this request is lost for good
        if self.fault in ("reorder", "delay") and self._rng.random() < self.p:
            self.injected += 1
            self._held.append((now + (0.03 if self.fault == "reorder" else 0.1), frames))
            raise zmq.Again()                       # later ones overtake it
        if self.fault == "duplicate" and self._rng.random() < self.p:
            self.injected += 1
            self._ready.append(frames)
        return frames

    def send_multipart(self, frames, *args, **kwargs):
        out = self._sock.send_multipart(frames, *args, **kwargs)
        if self.fault == "duplicate-replies" and self._rng.random() < self.p:
            self.injected += 1
            self._sock.send_multipart(frames, *args, **kwargs)
        return out


def grad(rank, step):
    return np.full(SHAPE, (rank + 1) * (step + 1), np.float32) + np.arange(SHAPE[0], dtype=np.float32) % 3


def training(kv):
    kv.init(["a", "b"], [np.zeros(SHAPE, np.float32), np.zeros(17, np.float32)])
    seen = []
    for step in range(STEPS):
        kv.push(["a", "b"], [grad(kv.rank, step), np.full(17, step, np.float32)])
        if step % 3 == 2:
            kv.barrier()
        out = np.empty(SHAPE, np.float32)
        kv.pull("a", out=out)
        seen.append(out)
    return seen


@pytest.mark.parametrize("fault", ["duplicate", "reorder", "delay", "duplicate-replies"])
def test_faults_that_heal_give_exact_results(make_cluster, fault):
    sockets = []

    def wrap(sock):
        sockets.append(FaultySocket(sock, fault, seed=len(sockets)))
        return sockets[-1]

    cluster = make_cluster(3, 2, chunk_bytes=4096, server_socket_wrapper=wrap)
    for seen in cluster.run(training):
        for step, out in enumerate(seen):
            np.testing.assert_array_equal(out, sum(grad(r, step) for r in range(3)))
    assert sum(s.injected for s in sockets) > 5, "the faults were not injected"
    if fault == "duplicate":
        assert sum(node.sequencer.duplicates for node in cluster.nodes) > 0


def test_a_lost_message_ends_with_an_error_naming_the_server_not_a_wrong_result(make_cluster):
    sockets = []

    def wrap(sock):
        sockets.append(FaultySocket(sock, "drop" if not sockets else "none"))
        return sockets[-1]

    cluster = make_cluster(2, 2, chunk_bytes=4096, server_socket_wrapper=wrap, timeout=3.0)
    outcomes = []

    def job(kv):
        try:
            seen = training(kv)
        except (DeadlineError, NodeFailedError) as e:
            outcomes.append(str(e))
            return None
        return seen

    started = time.monotonic()
    results = cluster.run(job)
    assert time.monotonic() - started < 30
    assert sockets[0].injected == 1
    assert outcomes and any("server 0" in message for message in outcomes), outcomes
    for seen in results:               # whatever completed was right
        for step, out in enumerate(seen or []):
            np.testing.assert_array_equal(out, sum(grad(r, step) for r in range(2)))


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_a_reply_that_comes_after_its_call_gave_up_does_not_reach_the_output(make_cluster, transport):
    """pull() times out (the other worker has not pushed yet); the caller reuses its
    buffer; the round completes later and its reply arrives while the next call
    waits: that reply must be dropped, not copied into the failed call's ``out``."""
    cluster = make_cluster(2, 1, transport=transport, timeout=2.0)
    gave_up, n = threading.Event(), 8
    seen = {}

    def work(kv):
        kv.init([0, 1], [np.zeros(n, np.float32)] * 2)
        if kv.rank == 1:
            assert gave_up.wait(20)
            try:
                kv.push(0, np.full(n, 5, np.float32))    # completes worker 0's abandoned round
                kv.push(1, np.ones(n, np.float32))
                kv.pull(1, out=np.empty(n, np.float32))
            except NodeFailedError:     # worker 0's failure may abort the job as it closes
                pass
            return
        kv.push(0, np.ones(n, np.float32))
        out = np.full(n, -1, np.float32)
        with pytest.raises(DeadlineError):
            kv.pull(0, out=out)
        out[:] = -7                     # the caller's buffer again
        gave_up.set()
        kv.push(1, np.ones(n, np.float32))
        later = np.empty(n, np.float32)
        kv.pull(1, out=later)           # answered after the late reply to pull(0) came in
        seen["out"], seen["later"] = out.copy(), later.copy()

    try:
        cluster.run(work)
    except NodeFailedError:
        pass
    np.testing.assert_array_equal(seen["later"], np.full(n, 2, np.float32))
    np.testing.assert_array_equal(seen["out"], np.full(n, -7, np.float32))


def test_a_close_that_fails_tells_the_job_at_once(make_cluster):
    """Worker 0's close() cannot flush its push (nobody completes the round): the
    job learns it from that failure, not later from a heartbeat timeout that would
    blame a dead or stuck worker."""
    cluster = make_cluster(2, 1, timeout=20.0, heartbeat_timeout=60.0)
    errors = {}

    def work(rank):
        config = cluster.config("worker", rank)
        if rank == 0:
            config = dataclasses.replace(config, timeout=2.0)
        kv = kvstore.create("dist_sync", config=config)
        kv.init(0, np.zeros(4, np.float32))
        try:
            if rank == 0:
                kv.push(0, np.ones(4, np.float32))
                kv.close()
            else:
                kv.barrier()         # never pushes key 0
        except Exception as e:
            errors[rank] = e
        finally:
            try:
                kv.close()
            except NodeFailedError:    # worker 1's: the job was aborted (what its barrier said)
                pass

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert isinstance(errors.get(0), DeadlineError), errors
    assert isinstance(errors.get(1), NodeFailedError), errors
    assert "close: DeadlineError" in str(errors[1]), errors[1]


# -- sequence gaps: a request that takes its sequence number must not hold back the rest ----

def test_sequencer_skips_a_rejected_request_in_order():
    from kvstore.server.sequencer import Sequencer
    seq = Sequencer("server 0")
    req = lambda n: ({"id": n, "src": 0, "seq": n}, [])
    assert seq.skip(b"p", 1) == []                     # rejected early: a gap to skip later
    assert seq.accept(b"p", *req(2)) == []             # held: 0 has not come
    assert [h["seq"] for h, _ in seq.accept(b"p", *req(0))] == [0, 2]
    assert seq.skip(b"p", 3) == [] and [h["seq"] for h, _ in seq.accept(b"p", *req(4))] == [4]
    assert seq.skip(b"p", 0) == [] and seq.skip(b"p", "x") == [] and seq.skip(b"p", None) == []


def test_a_request_that_cannot_be_encoded_leaves_the_connection_working(make_cluster):
    from kvstore.errors import InvalidArgumentError
    from kvstore.protocol import ops
    cluster = make_cluster(1, 1, timeout=5.0)

    def job(kv):
        kv.init("w", np.zeros(3, np.float32))
        before = list(kv._client._seq)
        with pytest.raises(InvalidArgumentError, match="cannot be encoded"):
            kv._client.request(0, ops.GET_META, "a request with an unencodable field", bogus=object())
        with pytest.raises(InvalidArgumentError, match="cannot be encoded"):
            kv._client.request(0, ops.GET_META, "a request with an unencodable field", bogus=np.int64(3))
        assert kv._client._seq == before                  # no sequence number was used up
        kv.push("w", np.ones(3, np.float32))
        out = np.empty(3, np.float32)
        kv.pull("w", out=out)                             # answered, not held until the deadline
        return out

    out, = cluster.run(job)
    np.testing.assert_array_equal(out, 1)


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_a_request_rejected_after_its_header_was_read_leaves_the_connection_working(make_cluster, transport):
    import msgpack
    cluster = make_cluster(1, 1, timeout=5.0, transport=transport)

    def job(kv):
        kv.init("w", np.zeros(3, np.float32))
        client = kv._client
        seq, client._seq[0] = client._seq[0], client._seq[0] + 1
        header = {"v": 1, "op": "push", "id": 10 ** 9, "src": 0, "seq": seq,
                  "chunks": [["w", 0]], "bufs": [["<f4", [3]]]}
        client._socks[0].send_multipart([msgpack.packb(header), b"12345"])   # 5 bytes, not 12
        kv.push("w", np.ones(3, np.float32))
        out = np.empty(3, np.float32)
        kv.pull("w", out=out)
        return out

    out, = cluster.run(job)
    np.testing.assert_array_equal(out, 1)


# -- many requests in flight ----------------------------------------------------------------


def test_more_than_512_keys_pushed_in_different_orders_do_not_deadlock(make_cluster):
    """Worker 0 pushes keys 0..n-1, worker 1 n-1..0, one call per key, before either
    waits: no round completes until the other worker reaches that key, so a limit
    on requests in flight that waited for replies would hold both for ever."""
    from kvstore.worker.client import MAX_IN_FLIGHT
    n = 2 * MAX_IN_FLIGHT + 100
    cluster = make_cluster(2, 1, timeout=20.0)

    def job(kv):
        keys = list(range(n))
        kv.init(keys, [np.zeros(2, np.float32)] * n)
        for key in (keys if kv.rank == 0 else keys[::-1]):
            kv.push(key, np.full(2, key + 1000 * kv.rank, np.float32))
        outs = [np.empty(2, np.float32) for _ in keys]
        kv.pull(keys, out=outs)
        return [o[0] for o in outs]

    started = time.monotonic()
    results = cluster.run(job)
    assert time.monotonic() - started < 60
    for seen in results:
        assert seen == [2 * key + 1000 for key in range(n)]


def test_a_timeout_names_the_keys_awaited(make_cluster):
    cluster = make_cluster(2, 1, timeout=2.0)
    failed = threading.Event()

    def job(kv):
        kv.init(["late", "ok"], [np.zeros(2, np.float32)] * 2)
        if kv.rank == 1:
            kv.push("ok", np.ones(2, np.float32))
            failed.wait(30)                  # never pushes 'late'
            return None
        kv.push("ok", np.ones(2, np.float32))
        kv.push("late", np.ones(2, np.float32))
        try:
            kv.barrier()                     # waits for its pushes first
        except DeadlineError as e:
            return str(e)
        finally:
            failed.set()

    message = cluster.run_each(job)[0]
    assert isinstance(message, str), message
    assert "no reply from server 0" in message and "push of key 'late'" in message, message
    assert "push of key 'ok'" not in message, message
