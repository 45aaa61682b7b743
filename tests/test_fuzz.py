"""Bad input on the wire, against a live server and a live scheduler.

A real in-process job (scheduler + 2 server threads + 2 worker threads, real tcp
sockets) is started once for the module; a raw ZeroMQ DEALER then sends it random
and mutated messages (hypothesis, fixed budget, no shrinking: the cluster is
stateful, so the first failing message is reported as it was sent).

Properties, checked after every message:

- the server / scheduler thread is alive, and the scheduler's ``failure`` is None;
- every message gets a reply within ``REPLY_WAIT_MS`` (an ``error``, or ``ok``
  for a valid read-only request), or is dropped when the protocol says so (a frame
  above the socket's maximum size, a control message of more than one frame);
- the stored values never change (a pull over the wire equals the baseline);
- undecodable messages are logged at warning level.

A mutated message can by chance be a *valid* state-changing request (a push from
a real worker rank with the right dtype and size, a valid ``set_optimizer``...).
Such messages are recognised from the spec (docs/protocol.md), not from the
implementation, and are not sent: they would legitimately change the job. Every
other message must be rejected.

At the end of each test the real workers pull every key, run a sync round and
pass a barrier; the module teardown checks that the job then finishes cleanly.

Bugs this fuzzing found have regression tests below (they were xfail until fixed).

With atheris installed, ``test_atheris_decode_and_state`` runs a bounded
coverage-guided fuzz of ``decode`` + ``ServerState.handle`` (pure, no sockets) in
a subprocess (libFuzzer ends its process when done).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import queue
import re
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from cluster import Cluster
from kvstore import compression, optimizer
from kvstore.errors import ProtocolError
from kvstore.protocol import codec, decode, encode, ops
from kvstore.server.state import ServerState
from tracker import wire
from tracker.rendezvous import Scheduler

try:  # optional: coverage-guided fuzzing of the pure path
    import atheris
except ImportError:  # pragma: no cover - depends on the environment
    atheris = None

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

W, S = 2, 2
CHUNK_BYTES = 256                                # key 3 (200 x f4) splits into 4 chunks
MAX_MSG = codec.MAX_HEADER_BYTES + (64 << 10)    # lets an oversized *header* reach decode()
REPLY_WAIT_MS = 3000
LIVE = dict(max_examples=0, deadline=None, database=None, phases=[Phase.generate],
            report_multiple_bugs=False)


def live_settings(n: int):
    return settings(**{**LIVE, "max_examples": n})


def _keys() -> dict:
    return {
        0: np.arange(10, dtype=np.float32) - 4,
        1: np.arange(7, dtype=np.int32) * 3 - 5,
        2: np.arange(6, dtype=np.float16).reshape(3, 2),
        3: np.arange(200, dtype=np.float32) % 17,
        4: np.array(2.5, dtype=np.float64),
        5: np.zeros(0, dtype=np.uint8),
        6: np.array([True, False, True, True, False]),
    }


FLOAT_KEYS = [0, 2, 3, 4]
OPT = dict(learning_rate=1.0, momentum=0.5)    # SGD: zero gradients leave values unchanged


# -- the live job ----------------------------------------------------------------------
class _RecordingCluster(Cluster):
    """The test cluster, keeping each ServerNode so that tests can see its state."""

    def _serve(self, rank, node):
        self.__dict__.setdefault("nodes", {})[rank] = node
        super()._serve(rank, node)


class Live:
    """A running job whose worker threads execute callables on request."""

    def __init__(self):
        self.cluster = _RecordingCluster(W, S, chunk_bytes=CHUNK_BYTES, max_message_bytes=MAX_MSG,
                                         timeout=20.0)
        self._inbox = [queue.Queue() for _ in range(W)]
        self._outbox = [queue.Queue() for _ in range(W)]
        self.run_error = None
        self._runner = threading.Thread(target=self._run, name="fuzz-workers", daemon=True)
        self._runner.start()
        self.ctx = zmq.Context()
        self._ids = itertools.count(10 ** 15)
        self.servers = self.on_workers(_setup)[0]
        self.socks = [self.dealer(a) for a in self.servers]      # fuzz messages
        self._pullers = [self.dealer(a) for a in self.servers]   # checks
        nodes = self.cluster.nodes
        # chunk id -> (dtype, size) per server, as the spec's validity rules need them
        self.meta = [{cid: (c.value.dtype, c.value.size) for cid, c in nodes[i].state.chunks.items()}
                     for i in range(S)]
        self.baseline = [self.raw_pull_all(i) for i in range(S)]

    # workers ---------------------------------------------------------------------------
    def _run(self):
        try:
            self.cluster.run(self._drive, timeout=600)
        except BaseException as e:  # reported by close()
            self.run_error = e

    def _drive(self, kv):
        inbox, outbox = self._inbox[kv.rank], self._outbox[kv.rank]
        while True:
            fn = inbox.get()
            if fn is None:
                return
            try:
                outbox.put((True, fn(kv)))
            except BaseException as e:  # handed to the test thread
                outbox.put((False, e))

    def on_workers(self, fn, timeout: float = 30.0) -> list:
        for q in self._inbox:
            q.put(fn)
        results = []
        for rank, q in enumerate(self._outbox):
            try:
                ok, value = q.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"worker {rank} did not answer within {timeout}s") from None
            if not ok:
                raise value
            results.append(value)
        return results

    def close(self):
        for s in self.socks + self._pullers:
            s.close(linger=0)
        for q in self._inbox:
            q.put(None)
        self._runner.join(60)
        self.ctx.term()
        self.cluster.close()
        assert not self._runner.is_alive(), "the workers did not finish"
        assert self.run_error is None, f"a worker failed: {self.run_error!r}"
        assert self.cluster.scheduler.failure is None, self.cluster.scheduler.failure
        assert self.cluster.server_codes == [0] * S, self.cluster.server_codes

    # raw sockets -----------------------------------------------------------------------
    def dealer(self, address: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        security = getattr(self.cluster.config("worker", 0), "security", None)
        if security is not None:  # authenticated jobs: the fuzzer is an insider
            security().connect(sock)
        sock.connect(address)
        return sock

    @property
    def scheduler_address(self) -> str:
        return f"tcp://127.0.0.1:{self.cluster.scheduler.port}"

    def raw_pull_all(self, server: int) -> dict:
        """Every chunk of ``server``, pulled over the wire as worker 0."""
        cids = sorted(self.meta[server], key=repr)
        sock = self._pullers[server]
        rid = next(self._ids)
        sock.send_multipart(encode({"op": ops.PULL, "id": rid, "src": 0,
                                    "chunks": [list(c) for c in cids]}))
        assert sock.poll(REPLY_WAIT_MS), f"server {server} did not answer a plain pull"
        header, arrays = decode(sock.recv_multipart())
        assert header["op"] == ops.OK and header["id"] == rid, header
        return {cid: a.copy() for cid, a in zip(cids, arrays)}

    def assert_healthy(self, server: int | None = None, context: str = ""):
        for i, t in enumerate(self.cluster._threads):
            assert t.is_alive(), f"server {i} died{context}"
        sched = self.cluster.scheduler
        assert sched._thread.is_alive() and sched.failure is None, \
            f"the scheduler failed{context}: {sched.failure}"
        for i in range(S) if server is None else [server]:
            now = self.raw_pull_all(i)
            for cid, before in self.baseline[i].items():
                assert np.array_equal(now[cid], before), f"server {i} chunk {cid} changed{context}"

    def assert_job_works(self):
        """The real workers read the initial values, complete a round and a barrier."""
        self.assert_healthy()
        for values in self.on_workers(_pull_all):
            for key, expected in _keys().items():
                assert np.array_equal(values[key], expected), f"key {key} changed"
        self.on_workers(_zero_round)
        self.on_workers(lambda kv: kv.barrier())
        self.assert_healthy()


def _setup(kv):
    values = _keys()
    kv.init(list(values), list(values.values()))
    kv.set_optimizer(optimizer.create("sgd", **OPT))
    _zero_round(kv)   # the optimizer now holds state (momentum) for every float chunk
    return list(kv._client.servers)


def _zero_round(kv):
    values = _keys()
    zeros = [np.zeros_like(values[k]) for k in FLOAT_KEYS]
    kv.pushpull(FLOAT_KEYS, zeros)
    for k, z in zip(FLOAT_KEYS, zeros):
        assert np.array_equal(z, values[k]), f"a zero-gradient round changed key {k}"


def _pull_all(kv):
    out = {k: np.empty_like(v) for k, v in _keys().items()}
    kv.pull(list(out), list(out.values()))
    return out


@pytest.fixture(scope="module")
def live():
    job = Live()
    try:
        yield job
    finally:
        job.close()


def _wait_reply(sock: zmq.Socket, timeout_ms: int = REPLY_WAIT_MS):
    return sock.recv_multipart() if sock.poll(timeout_ms) else None


def _warnings(caplog, logger: str) -> int:
    return sum(1 for r in caplog.records if r.name == logger and r.levelno >= logging.WARNING)


# -- the spec's view of a data-plane message ---------------------------------------------
def _is_int(v) -> bool:
    return type(v) is int


def _chunk_ids(header):
    """The request's chunk ids if ``chunks`` is well-formed per spec §2.2/§3.1, else None."""
    raw = header.get("chunks")
    if not isinstance(raw, list):
        return None
    ids = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 2 and _is_int(item[1])
                and (_is_int(item[0]) or isinstance(item[0], str))):
            return None
        ids.append((item[0], item[1]))
    return ids if len(set(ids)) == len(ids) else None


class Expect:
    """What a message must get: ``send`` False means it is a valid state-changing
    request (not sent); ``ops`` the acceptable reply ops; ``values`` for a pull."""

    def __init__(self, send=True, ops_=(ops.ERROR,), undecodable=False, values=None):
        self.send, self.ops, self.undecodable, self.values = send, set(ops_), undecodable, values


def _expect(frames, meta: dict) -> Expect:
    try:
        header, arrays = decode(frames, MAX_MSG)
    except ProtocolError:
        return Expect(undecodable=True)
    src = header.get("src")
    if not isinstance(src, int) or header.get("id") is None:   # the node rejects these itself
        return Expect(undecodable=True)
    op = header["op"]
    seq = header.get("seq")
    if (op in ops.REQUESTS and op not in MODELED) or (_is_int(seq) and seq >= 0):
        return Expect(send=False)   # an op added after this test; a sequenced request (held)
    ids = _chunk_ids(header)
    worker_ok = _is_int(src) and 0 <= src < W
    exist = ids is not None and all(c in meta for c in ids)
    if op == ops.CONFIGURE:
        same = header.get("mode") == "sync" and _is_int(header.get("num_workers")) \
            and header.get("num_workers") == W
        return Expect(ops_=(ops.OK,) if same else (ops.ERROR,))
    if op == ops.PULL:
        if worker_ok and exist and not arrays:
            return Expect(ops_=(ops.OK,), values=ids)
        return Expect()
    if op == ops.GET_STATES:
        return Expect(ops_=(ops.OK,))       # an optimizer is set: states are readable
    if op in ("get_meta", "checkpoint") and op in ops.REQUESTS:
        # read-only / writes a file only when the job has a checkpoint directory (this one has none)
        return Expect(ops_=(ops.OK,) if op == "get_meta" else (ops.ERROR,))
    if op == ops.INIT:
        fresh = ids is not None and not any(c in meta for c in ids)
        return Expect(send=not (fresh and len(arrays) == len(ids)))
    if op in (ops.PUSH, ops.PUSHPULL):
        if not (worker_ok and exist and len(arrays) == len(ids)):
            return Expect()
        comp = header.get("compression")
        if comp is not None:
            try:
                compression.validate(comp)
            except Exception:   # invalid compression: must be rejected
                return Expect()
            return Expect(send=False)   # conservatively treated as valid
        dtypes_ok = all(a.dtype == meta[c][0] and a.size == meta[c][1] for c, a in zip(ids, arrays))
        floats = all(meta[c][0].kind == "f" for c in ids)
        return Expect(send=not (dtypes_ok and floats))
    if op == ops.SET_OPTIMIZER:
        try:
            optimizer.from_config(header.get("optimizer"))
        except Exception:  # anything from_config refuses must be refused by the server
            return Expect()
        return Expect(send=False)
    if op == ops.SET_STATES:
        states = header.get("states")
        if not (isinstance(states, list) and all(
                isinstance(m, list) and len(m) == 4 and all(_is_int(v) and v >= 0 for v in m[1:])
                for m in states)):
            return Expect()
        if sum(m[3] for m in states) != len(arrays):
            return Expect()
        pos = 0
        for key, index, _, count in states:
            try:
                found = (key, index) in meta
            except TypeError:  # unhashable key
                return Expect()
            parts = arrays[pos:pos + count]
            pos += count
            if not found or count != 1 or any(a.dtype != meta[(key, index)][0]
                                              or a.size != meta[(key, index)][1] for a in parts):
                return Expect()
        return Expect(send=False)
    return Expect()   # unknown op, reply ops, ...


def _expected_id(frames):
    """Spec §6: the request's id when the header is a map with an integer id, else null."""
    try:
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
    except Exception:  # not msgpack at all
        return None
    rid = header.get("id") if isinstance(header, dict) else None
    return rid if _is_int(rid) else None


def _exchange(live: Live, caplog, server: int, frames, what: str):
    """Send one fuzz message to ``server`` and check everything the module promises."""
    exp = _expect(frames, live.meta[server])
    if not exp.send:
        return False
    sock = live.socks[server]
    logged = _warnings(caplog, "kvstore.server.node")
    sock.send_multipart(frames, copy=True)
    reply = _wait_reply(sock)
    context = f" after {what}: {_show(frames)}"
    assert reply is not None, f"server {server} did not answer within {REPLY_WAIT_MS} ms{context}"
    want = _expected_id(frames)
    header, arrays = decode(reply, MAX_MSG)    # a reply always follows the protocol
    assert header["op"] in exp.ops, f"reply {header}{context}"
    assert header["id"] == want, f"reply id {header['id']!r}, expected {want!r}{context}"
    if header["op"] == ops.ERROR:
        assert header.get("kind") in ("ProtocolError", "InvalidArgumentError", "ConfigError"), header
        assert isinstance(header.get("message"), str) and header["message"], header
        if exp.undecodable:
            assert header["kind"] == "ProtocolError", header
            assert _warnings(caplog, "kvstore.server.node") > logged, f"not logged{context}"
    if exp.values is not None:
        for cid, a in zip(exp.values, arrays):
            assert np.array_equal(a, live.baseline[server][cid]), f"pull of {cid} returned {a}{context}"
    live.assert_healthy(server, context)
    return True


def _show(frames, limit: int = 600) -> str:
    text = repr([bytes(f) for f in frames])
    return text if len(text) <= limit else text[:limit] + f"... ({sum(len(f) for f in frames)} bytes)"


# -- strategies ------------------------------------------------------------------------
EDGE_INTS = [0, 1, -1, 2, 3, 255, 2 ** 31 - 1, 2 ** 31, 2 ** 32, 2 ** 40 - 1, 2 ** 40, 2 ** 53 + 1,
             2 ** 63 - 1, 2 ** 64 - 1, -2 ** 63]
SCALARS = st.one_of(
    st.none(), st.booleans(), st.sampled_from(EDGE_INTS), st.integers(-2 ** 63, 2 ** 64 - 1),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12), st.binary(max_size=12))
WEIRD = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.one_of(st.text(max_size=8), st.integers(-3, 3)), inner, max_size=3),
    max_leaves=10)
DTYPES = sorted(codec.ALLOWED_DTYPES) + [">f4", ">i8", "|O", "O", "<c8", "<U3", "|S2", "|V4",
                                           "<M8[s]", "f4", "float32", "", "<f4 ", "bfloat16"]
DIMS = st.one_of(st.integers(0, 70), st.sampled_from(EDGE_INTS + [-5]), SCALARS)
SHAPES = st.one_of(st.lists(DIMS, max_size=5), st.lists(st.integers(0, 3), min_size=30, max_size=40),
                   WEIRD)
OPT_CONFIGS = st.one_of(
    st.fixed_dictionaries({"name": st.sampled_from(["sgd", "SGD", "adam", "nag", "nope", ""])},
                          optional={"params": st.dictionaries(
                              st.sampled_from(["learning_rate", "momentum", "wd", "beta1", "x"]),
                              SCALARS, max_size=3),
                              "lr_scheduler": st.one_of(st.none(), WEIRD, st.fixed_dictionaries(
                                  {"name": st.sampled_from(["factor", "cosine", "multifactor", "z"]),
                                   "params": st.dictionaries(st.sampled_from(
                                       ["step", "factor", "max_update", "base_lr"]), WEIRD,
                                       max_size=2)}))}),
    WEIRD)
COMPRESSIONS = st.one_of(
    st.none(), WEIRD,
    st.fixed_dictionaries({"type": st.sampled_from(["2bit", "1bit", "fp16", "none", "8bit"])},
                          optional={"threshold": SCALARS}))
# ops this module knows the semantics of; other ops of ops.REQUESTS (added later) are not sent
MODELED = {ops.CONFIGURE, ops.INIT, ops.PUSH, ops.PULL, ops.PUSHPULL, ops.SET_OPTIMIZER,
           ops.GET_STATES, ops.SET_STATES, "get_meta", "checkpoint"}
REQUEST_OPS = sorted(MODELED) + [ops.OK, ops.ERROR, "bogus", "", "_on_push", "PUSH"]
FIELDS = ["v", "op", "id", "src", "chunks", "bufs", "mode", "num_workers", "optimizer", "states",
          "compression", "extra"]
RELEVANT = {  # the fields each op's validation looks at
    ops.PUSH: ["src", "src", "chunks", "bufs", "compression", "id"],
    ops.PUSHPULL: ["src", "src", "chunks", "bufs", "compression", "id"],
    ops.PULL: ["src", "chunks", "id"], ops.INIT: ["chunks", "bufs", "id"],
    ops.CONFIGURE: ["mode", "num_workers", "id"], ops.SET_OPTIMIZER: ["optimizer", "id"],
    ops.SET_STATES: ["states", "bufs", "id"], ops.GET_STATES: ["id", "v"],
}
NEAR = {  # per field: values next to the valid ones, then anything
    "v": st.sampled_from([0, 2, -1, "1", 1.0, True, None]),
    "op": st.sampled_from(REQUEST_OPS),
    "id": st.sampled_from(EDGE_INTS + [True, False, None, 1.5, "7"]),
    "src": st.one_of(st.integers(-3, W + 3), st.sampled_from([2 ** 63 - 1, 2 ** 64 - 1, True, False,
                                                              None, 0.0, "0"])),
    "num_workers": st.sampled_from([W, W + 1, 0, -1, True, 2.0, None, 2 ** 64 - 1]),
    "mode": st.sampled_from(["sync", "async", "Sync", "", None]),
}


@st.composite
def mutated_messages(draw, meta: dict):
    """A well-formed request for existing chunks, then 0-4 mutations of its header
    fields, chunk ids, buffer descriptions, frames or header bytes."""
    cids = sorted(meta, key=repr)
    op = draw(st.sampled_from(REQUEST_OPS + [ops.PUSH, ops.PUSHPULL, ops.PULL] * 2))
    chosen = draw(st.lists(st.sampled_from(cids), min_size=1, max_size=4, unique=True))
    header = {"v": codec.VERSION, "op": op, "id": draw(st.integers(0, 2 ** 32)),
              "src": draw(st.integers(0, W - 1))}
    arrays = []
    if op in (ops.INIT, ops.PUSH, ops.PUSHPULL, ops.PULL):
        header["chunks"] = [list(c) for c in chosen]
    if op in (ops.INIT, ops.PUSH, ops.PUSHPULL):
        arrays = [np.ones(meta[c][1], meta[c][0]) for c in chosen]
        if draw(st.integers(0, 3)) == 0:
            header["compression"] = draw(COMPRESSIONS)
    if op == ops.CONFIGURE:
        header["mode"] = draw(st.sampled_from(["sync", "async", "SYNC"]))
        header["num_workers"] = draw(st.sampled_from([W, W + 1, 0, 1]))
    if op == ops.SET_OPTIMIZER:
        header["optimizer"] = draw(OPT_CONFIGS)
    if op == ops.SET_STATES:
        header["states"] = [[c[0], c[1], draw(st.integers(0, 5)), 1] for c in chosen]
        arrays = [np.zeros(meta[c][1], meta[c][0]) for c in chosen]
    header["bufs"] = [[a.dtype.str, list(a.shape)] for a in arrays]
    frames = [None, *(a.tobytes() for a in arrays)]

    relevant = RELEVANT.get(op, ["id", "v", "op"])
    for _ in range(draw(st.sampled_from([0, 1, 1, 1, 1, 1, 2, 2, 3]))):
        kind = draw(st.sampled_from(["set"] * 5 + ["del", "chunk", "buf", "buf", "frame"]))
        if kind == "set":
            field = draw(st.sampled_from(relevant) if draw(st.integers(0, 9)) < 7
                         else st.sampled_from(FIELDS))
            header[field] = draw(st.one_of(NEAR[field], WEIRD) if field in NEAR else WEIRD)
        elif kind == "del" and header:
            header.pop(draw(st.sampled_from(sorted(header, key=repr))))
        elif kind == "chunk":
            chunks = header.get("chunks")
            if not isinstance(chunks, list):
                chunks = header["chunks"] = []
            how = draw(st.sampled_from(["key", "index", "entry", "dup", "append"]))
            if how == "append" or not chunks:
                chunks.append([draw(st.one_of(st.integers(-3, 10), SCALARS)), draw(DIMS)])
            else:
                i = draw(st.integers(0, len(chunks) - 1))
                entry = chunks[i]
                if how == "dup":
                    chunks.append(entry)
                elif how == "entry" or not (isinstance(entry, list) and len(entry) == 2):
                    chunks[i] = draw(WEIRD)
                else:
                    chunks[i] = [draw(WEIRD), entry[1]] if how == "key" else [entry[0], draw(DIMS)]
        elif kind == "buf":
            bufs = header.get("bufs")
            if isinstance(bufs, list) and bufs:
                i = draw(st.integers(0, len(bufs) - 1))
                entry = bufs[i] if isinstance(bufs[i], list) and len(bufs[i]) == 2 else ["<f4", [1]]
                bufs[i] = draw(st.sampled_from([
                    [draw(st.sampled_from(DTYPES)), entry[1]], [entry[0], draw(SHAPES)], draw(WEIRD)]))
            else:
                header["bufs"] = [[draw(st.sampled_from(DTYPES)), draw(SHAPES)]]
        elif kind == "frame":
            how = draw(st.sampled_from(["drop", "extra", "resize", "replace"]))
            if how == "drop" and len(frames) > 1:
                frames.pop()
            elif how == "extra":
                frames.append(draw(st.binary(max_size=64)))
            elif len(frames) > 1:
                i = draw(st.integers(1, len(frames) - 1))
                if how == "resize":
                    n = max(0, len(frames[i]) + draw(st.integers(-9, 9)))
                    frames[i] = (frames[i] + b"\0" * 9)[:n]
                else:
                    frames[i] = draw(st.binary(max_size=64))
    head = msgpack.packb(header, use_bin_type=True)
    how = draw(st.sampled_from(["none"] * 12 + ["truncate", "flip", "append"]))
    if how == "truncate":
        head = head[:draw(st.integers(0, max(0, len(head) - 1)))]
    elif how == "flip" and head:
        i = draw(st.integers(0, len(head) - 1))
        head = head[:i] + bytes([head[i] ^ draw(st.integers(1, 255))]) + head[i + 1:]
    elif how == "append":
        head += draw(st.binary(min_size=1, max_size=8))
    frames[0] = head
    return frames


RANDOM_FRAMES = st.lists(
    st.one_of(st.binary(max_size=300), WEIRD.map(lambda v: msgpack.packb(v, use_bin_type=True))),
    min_size=1, max_size=4)


# -- data plane ---------------------------------------------------------------------------
def test_server_survives_random_frames(live, caplog):
    caplog.set_level(logging.WARNING)
    sent = []

    @live_settings(120)
    @given(server=st.integers(0, S - 1), frames=RANDOM_FRAMES)
    def fuzz(server, frames):
        sent.append(_exchange(live, caplog, server, frames, "random frames"))

    fuzz()
    assert sum(sent) > 0.8 * len(sent), f"only {sum(sent)} of {len(sent)} messages were sent"
    live.assert_job_works()


def test_server_survives_mutated_requests(live, caplog):
    caplog.set_level(logging.WARNING)
    sent = []

    @live_settings(400)
    @given(data=st.data())
    def fuzz(data):
        server = data.draw(st.integers(0, S - 1))
        frames = data.draw(mutated_messages(live.meta[server]))
        sent.append(_exchange(live, caplog, server, frames, "a mutated request"))

    fuzz()
    # the generator must mostly produce messages worth sending (not valid requests)
    assert sum(sent) > 0.6 * len(sent), f"only {sum(sent)} of {len(sent)} messages were sent"
    live.assert_job_works()


@pytest.mark.parametrize("case", ["header", "header-frame", "buffer-frame"])
def test_oversized_input(live, caplog, case):
    """A header above MAX_HEADER_BYTES is refused with an error; a frame above the
    socket's maximum message size is dropped by ZeroMQ (no reply) and the peer is
    disconnected; either way the server keeps serving everyone else."""
    caplog.set_level(logging.WARNING)
    sock = live.dealer(live.servers[0])
    try:
        cid = sorted(live.meta[0], key=repr)[0]
        base = {"op": ops.PULL, "id": 77, "src": 0, "chunks": [list(cid)]}
        if case == "header":
            pad = b"\0" * (codec.MAX_HEADER_BYTES + 1)
            frames = encode(dict(base, pad=pad))
            assert len(frames[0]) > codec.MAX_HEADER_BYTES and len(frames[0]) <= MAX_MSG
            logged = _warnings(caplog, "kvstore.server.node")
            sock.send_multipart(frames)
            reply = _wait_reply(sock)
            assert reply is not None, "an oversized header got no reply"
            header, _ = decode(reply)
            assert header["op"] == ops.ERROR and header["kind"] == "ProtocolError", header
            assert "exceeds" in header["message"], header
            assert header["id"] in (77, None)
            assert _warnings(caplog, "kvstore.server.node") > logged
        else:
            big = b"\0" * (MAX_MSG + 1)
            frames = [big] if case == "header-frame" else \
                [*encode(dict(base, op=ops.PUSH), [np.zeros(1, np.float32)])[:1], big]
            sock.send_multipart(frames)
            assert _wait_reply(sock, 500) is None, "a frame above the maximum size was answered"
        live.assert_healthy()
    finally:
        sock.close(linger=0)


@pytest.mark.parametrize("case", ["too-many-bufs", "many-frames", "deep-nesting", "many-dims"])
def test_structural_limits(live, caplog, case):
    caplog.set_level(logging.WARNING)
    sock = live.dealer(live.servers[1])
    try:
        base = {"v": 1, "op": ops.PUSH, "id": 5, "src": 0, "chunks": []}
        if case == "too-many-bufs":
            frames = [msgpack.packb(dict(base, bufs=[0] * (codec.MAX_BUFFERS + 1)))]
        elif case == "many-frames":
            frames = [msgpack.packb(dict(base, bufs=[["|u1", [0]]] * 3))] + [b""] * 2000
        elif case == "deep-nesting":
            frames = [_with_raw(dict(base, bufs=[]), "chunks", _deep(3000))]  # beyond msgpack's limit
        else:
            frames = [msgpack.packb(dict(base, bufs=[["<f4", [1] * 33]])), b"\0" * 4]
        sock.send_multipart(frames)
        reply = _wait_reply(sock)
        assert reply is not None, f"no reply to {case}"
        header, _ = decode(reply)
        assert header["op"] == ops.ERROR and header["kind"] == "ProtocolError", header
        live.assert_healthy()
    finally:
        sock.close(linger=0)


# -- control plane --------------------------------------------------------------------------
CTRL_OPS = ["register", "barrier", "finish", "heartbeat", "fail", "registered", "barrier_done",
            "finished", "ack", "shutdown", "abort", "error", "", "_on_message", "nope"]
CTRL_FIELDS = ["v", "op", "id", "node", "role", "rank", "host", "addr", "pid", "token", "reason"]
CTRL_MODELED = {"register", "barrier", "finish", "heartbeat", "fail"}


@st.composite
def control_messages(draw):
    """One control frame: a well-formed message of a node that never registered,
    then mutations of its fields or bytes."""
    op = draw(st.sampled_from(CTRL_OPS))
    msg = {"v": wire.VERSION, "op": op, "id": draw(st.integers(0, 2 ** 32)),
           "node": f"worker-fuzz-{draw(st.integers(0, 10 ** 6))}"}
    if op == "register":
        msg.update(role=draw(st.sampled_from(["worker", "server", "scheduler"])),
                   rank=draw(st.sampled_from([None, 0, 1, 5])), host="127.0.0.1", addr="",
                   pid=draw(st.integers(1, 10 ** 6)))
    elif op == "barrier":
        msg["token"] = draw(st.sampled_from(["barrier", "init done", ""]))
    elif op == "fail":
        msg["reason"] = "fuzz"
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["set", "set", "del", "key"]))
        if kind == "set":
            msg[draw(st.sampled_from(CTRL_FIELDS))] = draw(WEIRD)
        elif kind == "del" and msg:
            msg.pop(draw(st.sampled_from(sorted(msg, key=repr))))
        elif kind == "key":
            msg[draw(st.one_of(st.integers(-9, 9), st.binary(max_size=4)))] = draw(SCALARS)
    frame = msgpack.packb(msg, use_bin_type=True)
    how = draw(st.sampled_from(["none"] * 6 + ["truncate", "flip", "random"]))
    if how == "truncate":
        frame = frame[:draw(st.integers(0, len(frame) - 1))]
    elif how == "flip":
        i = draw(st.integers(0, len(frame) - 1))
        frame = frame[:i] + bytes([frame[i] ^ draw(st.integers(1, 255))]) + frame[i + 1:]
    elif how == "random":
        frame = draw(st.binary(max_size=200))
    return frame


def _ctrl_exchange(live: Live, caplog, sock, frames, probe_ids):
    sched = live.cluster.scheduler
    try:
        op = wire.decode(frames[0])["op"] if len(frames) == 1 else None
    except Exception:  # undecodable: sent
        op = None
    if op is not None and op not in CTRL_MODELED and hasattr(sched, f"_op_{op}"):
        return   # an op added to the scheduler after this test: its reply is not modeled here
    context = f" after {_show(frames)}"
    logged = _warnings(caplog, "tracker.rendezvous")
    sock.send_multipart(frames)
    if len(frames) != 1:
        # dropped without a reply: the next reply this socket gets answers a probe
        rid = next(probe_ids)
        sock.send(wire.encode("finish", id=rid, node="worker-fuzz-probe"))
        reply = _wait_reply(sock)
        assert reply is not None, f"the scheduler stopped answering{context}"
        msg = wire.decode(reply[0])
        assert msg["op"] == "error" and msg["id"] == rid, f"{msg}{context}"
    else:
        reply = _wait_reply(sock)
        assert reply is not None and len(reply) == 1, f"no reply within {REPLY_WAIT_MS} ms{context}"
        msg = wire.decode(reply[0])           # replies follow the protocol
        try:
            sent = wire.decode(frames[0])
        except Exception:  # undecodable: error with a null id, and a warning
            sent = None
        if sent is not None and sent["op"] == "heartbeat" and "node" in sent:
            assert msg["op"] == "ack", f"{msg}{context}"   # heartbeats are answered before registration
        else:
            assert msg["op"] == "error", f"{msg}{context}"
            want = None if sent is None else sent.get("id")
            want = want if type(want) is int else None   # only integer ids are echoed
            assert msgpack.packb(msg.get("id")) == msgpack.packb(want), f"{msg}{context}"
            assert isinstance(msg.get("message"), str)
            assert _warnings(caplog, "tracker.rendezvous") > logged, f"not logged{context}"
    assert sched._thread.is_alive(), f"the scheduler thread died{context}"
    assert sched.failure is None, f"the job failed{context}: {sched.failure}"


def test_scheduler_survives_bad_control_messages(live, caplog):
    caplog.set_level(logging.WARNING)
    sock = live.dealer(live.scheduler_address)
    probe_ids = itertools.count(10 ** 12)
    frame_lists = st.one_of(
        control_messages().map(lambda f: [f]),
        st.lists(st.one_of(control_messages(), st.binary(max_size=50)), min_size=2, max_size=3))

    @live_settings(200)
    @given(frames=frame_lists)
    def fuzz(frames):
        _ctrl_exchange(live, caplog, sock, frames, probe_ids)

    try:
        fuzz()
        # a frame over wire.MAX_BYTES is dropped by ZeroMQ; one at the limit is answered
        for size, answered in ((wire.MAX_BYTES, True), (wire.MAX_BYTES + 1, False)):
            big = live.dealer(live.scheduler_address)
            try:
                big.send(b"\xc1" * size)
                assert (_wait_reply(big, 1000 if answered else 300) is not None) == answered, size
            finally:
                big.close(linger=0)
        _ctrl_exchange(live, caplog, sock, [b"\xc1"], probe_ids)
    finally:
        sock.close(linger=0)
    live.assert_job_works()
    assert live.cluster.scheduler.failure is None


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


def _deep(depth: int) -> bytes:
    """msgpack bytes of a list nested ``depth`` times (msgpack itself accepts ~1000)."""
    return b"\x91" * depth + b"\x90"


def _with_raw(msg: dict, field: str, raw: bytes) -> bytes:
    """Pack ``msg`` with ``field`` replaced by the raw msgpack bytes ``raw``."""
    packed = msgpack.packb(dict(msg, **{field: "@@PLACEHOLDER@@"}), use_bin_type=True)
    return packed.replace(msgpack.packb("@@PLACEHOLDER@@"), raw)


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


# -- atheris: decode + ServerState.handle, no sockets -------------------------------------
A_RUNS = int(os.environ.get("KVSTORE_ATHERIS_RUNS", "8000"))
A_OPS = sorted(ops.REQUESTS) + [ops.OK, ops.ERROR, "nope"]
A_KEYS = {("a", 0): np.arange(6, dtype=np.float32), ("a", 1): np.arange(5, dtype=np.float32),
          (7, 0): np.arange(4, dtype=np.int32), (8, 0): np.ones(3, np.float16),
          (9, 0): np.zeros(0, np.float64)}


def _a_state(kind: int) -> ServerState:
    """Fresh states: sync without optimizer / sync with SGD momentum / async with Adam."""
    state = ServerState(name="fuzz")
    mode = "async" if kind == 2 else "sync"
    state.handle(b"p", {"op": "configure", "id": 1, "src": 0, "mode": mode, "num_workers": 2}, [])
    ids = list(A_KEYS)
    state.handle(b"p", {"op": "init", "id": 2, "src": 0, "chunks": [list(c) for c in ids]},
                 [a.copy() for a in A_KEYS.values()])
    if kind:
        opt = {"name": "sgd", "params": {"momentum": 0.9}} if kind == 1 else {"name": "adam"}
        state.handle(b"p", {"op": "set_optimizer", "id": 3, "src": 0, "optimizer": opt}, [])
    return state


def _a_value(fdp, depth: int = 0):
    kind = fdp.ConsumeIntInRange(0, 9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return fdp.ConsumeBool()
    if kind == 2:
        return fdp.ConsumeIntInRange(-3, 12)
    if kind == 3:
        return fdp.PickValueInList(EDGE_INTS)
    if kind == 4:
        return fdp.ConsumeFloat()
    if kind == 5:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 8))
    if kind == 6:
        return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 8))
    n = fdp.ConsumeIntInRange(0, 4)
    if kind in (7, 8):
        return [_a_value(fdp, depth + 1) for _ in range(n)]
    return {fdp.PickValueInList(FIELDS + ["type", "name", "params"]): _a_value(fdp, depth + 1)
            for _ in range(n)}


def _a_message(fdp) -> list:
    mode = fdp.ConsumeIntInRange(0, 4)
    if mode == 0:   # raw frames
        return [fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64)) for _ in range(fdp.ConsumeIntInRange(1, 3))]
    if mode == 1:   # any msgpack value as the header
        return [msgpack.packb(_a_value(fdp), use_bin_type=True)]
    op = fdp.PickValueInList(A_OPS)
    header = {"v": fdp.PickValueInList([1, 1, 1, 0, 2, True, "1"]), "op": op,
              "id": fdp.PickValueInList([1, 0, -1, 2 ** 64 - 1, True, None, "1", 1.0]),
              "src": fdp.PickValueInList([0, 1, 1, 0, 2, -1, True, None, "0", 2 ** 63 - 1])}
    cids, datas, bufs = [], [], []
    for _ in range(fdp.ConsumeIntInRange(0, 3)):
        pick = fdp.ConsumeIntInRange(0, 6)
        if pick <= 4:
            cid = list(fdp.PickValueInList(list(A_KEYS)))
        elif pick == 5:
            cid = [_a_value(fdp, 2), fdp.ConsumeIntInRange(-1, 3)]
        else:
            cid = _a_value(fdp, 1)
        cids.append(cid)
        try:
            ref = A_KEYS.get(tuple(cid)) if isinstance(cid, list) and len(cid) == 2 else None
        except TypeError:  # unhashable key
            ref = None
        dtype = ref.dtype.str if ref is not None and fdp.ConsumeProbability() < 0.8 \
            else fdp.PickValueInList(DTYPES)
        shape = [ref.size] if ref is not None and fdp.ConsumeProbability() < 0.8 else \
            [fdp.PickValueInList([0, 1, 2, 3, 4, 5, 6, 2 ** 39, 2 ** 40, -1]) for _ in
             range(fdp.ConsumeIntInRange(0, 3))]
        bufs.append([dtype, shape])
        try:
            nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        except Exception:  # not a dtype numpy knows
            nbytes = 0
        datas.append(fdp.ConsumeBytes(nbytes if 0 <= nbytes <= 64 and fdp.ConsumeProbability() < 0.9
                                      else fdp.ConsumeIntInRange(0, 16)))
    if fdp.ConsumeBool():
        header["chunks"] = cids
    if op in (ops.PUSH, ops.PUSHPULL) and fdp.ConsumeBool():
        header["compression"] = {"type": fdp.PickValueInList(["2bit", "1bit", "fp16", "none", "x"]),
                                 "threshold": fdp.PickValueInList([0.5, 0, -1, 1e300, 2, True])}
    if op == ops.SET_OPTIMIZER:
        header["optimizer"] = fdp.PickValueInList([
            {"name": "sgd"}, {"name": "adam", "params": {"beta1": 0.5}}, {"name": "nope"},
            {"name": "sgd", "lr_scheduler": {"name": "factor", "params": {"step": 2}}}]) \
            if fdp.ConsumeBool() else _a_value(fdp)
    if op in (ops.SET_STATES, ops.GET_STATES):
        header["states"] = [[c[0] if isinstance(c, list) and c else c, fdp.ConsumeIntInRange(-1, 2),
                             fdp.PickValueInList([0, 1, 5, 2 ** 64 - 1]), fdp.ConsumeIntInRange(0, 3)]
                            for c in cids] if fdp.ConsumeBool() else _a_value(fdp)
    if op == ops.CONFIGURE:
        header["mode"] = fdp.PickValueInList(["sync", "async", None])
        header["num_workers"] = fdp.PickValueInList([2, 1, 0, -1, True, 2 ** 64 - 1])
    for _ in range(fdp.ConsumeIntInRange(0, 2) if fdp.ConsumeProbability() < 0.3 else 0):
        header[fdp.PickValueInList(FIELDS)] = _a_value(fdp)
    header.setdefault("bufs", bufs)
    frames = [msgpack.packb(header, use_bin_type=True), *datas]
    if mode == 4 and fdp.remaining_bytes():   # byte-level damage to the header
        head = frames[0]
        i = fdp.ConsumeIntInRange(0, len(head) - 1)
        frames[0] = head[:i] + fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 3)) + head[i + 1:]
    return frames


def atheris_one_input(data: bytes) -> None:
    """One atheris input: 1-3 messages from different peers to one fresh state (so
    sync rounds can complete). decode must raise only ProtocolError; handle() must
    never raise; a rejected request changes nothing; every reply encodes."""
    fdp = atheris.FuzzedDataProvider(data)
    state = _a_state(fdp.ConsumeIntInRange(0, 2))
    for n in range(fdp.ConsumeIntInRange(1, 3)):
        _a_deliver(state, b"peer%d" % n, _a_message(fdp))


def _a_deliver(state: ServerState, peer: bytes, frames: list) -> None:
    try:
        header, arrays = decode(frames, 1 << 20)
    except ProtocolError:
        return
    if not isinstance(header.get("src"), int) or not isinstance(header.get("id"), int):
        return   # ServerNode answers these before the state machine sees them
    before = {cid: c.value.copy() for cid, c in state.chunks.items()}
    replies = state.handle(peer, header, arrays)
    for reply in replies:
        assert reply.header["op"] in (ops.OK, ops.ERROR), reply.header
        encode(reply.header, reply.arrays)
    if len(replies) == 1 and replies[0].peer == peer and replies[0].header["op"] == ops.ERROR:
        assert set(state.chunks) == set(before), "a rejected request created chunks"
        for cid, value in before.items():
            assert np.array_equal(state.chunks[cid].value, value, equal_nan=True), \
                f"a rejected request changed {cid}"


ATHERIS_MAIN = """
import sys
import warnings
import atheris
warnings.simplefilter("ignore")   # numpy overflow warnings of fuzzed float16 values
with atheris.instrument_imports(include=["kvstore"]):
    import kvstore.protocol.codec, kvstore.server.state, kvstore.compression, kvstore.optimizer
sys.path.insert(0, {tests!r})
import test_fuzz
atheris.Setup(sys.argv, test_fuzz.atheris_one_input)
atheris.Fuzz()
"""


@pytest.mark.skipif(atheris is None, reason="atheris is not installed (pip install atheris)")
def test_atheris_decode_and_state(tmp_path):
    code = ATHERIS_MAIN.format(tests=os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, "-c", code, f"-runs={A_RUNS}", "-seed=20240607", "-max_total_time=40",
         "-max_len=1024", "-len_control=0", "-rss_limit_mb=2048",
         f"-artifact_prefix={tmp_path}{os.sep}", "-print_final_stats=1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert f"Done {A_RUNS} runs" in out or "stat::number_of_executed_units" in out, out[-3000:]
