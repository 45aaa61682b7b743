"""Shared parts of the wire fuzz tests (``test_fuzz_*.py``); not collected itself.

- the live job: a real in-process job (scheduler + 2 server threads + 2 worker
  threads, real tcp sockets) whose workers run callables on request, with raw
  ZeroMQ DEALER sockets to its servers and checks of its health and stored values;
- ``live``: the module-scoped fixture that starts one such job per test module and,
  at teardown, checks that the job then finishes cleanly (test modules load it
  with ``pytest_plugins = ["fuzzing"]``);
- small message helpers (replies, warnings counted in the log, raw msgpack nesting);
- the hypothesis strategies and the protocol vocabulary the fuzzers draw from.

Hypothesis runs with a fixed budget and no shrinking (``live_settings``): the
cluster is stateful, so the first failing message is reported as it was sent.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import Phase, settings
from hypothesis import strategies as st

from cluster import Cluster
from kvstore import optimizer
from kvstore.protocol import codec, decode, encode, ops


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


def _show(frames, limit: int = 600) -> str:
    text = repr([bytes(f) for f in frames])
    return text if len(text) <= limit else text[:limit] + f"... ({sum(len(f) for f in frames)} bytes)"


def _deep(depth: int) -> bytes:
    """msgpack bytes of a list nested ``depth`` times (msgpack itself accepts ~1000)."""
    return b"\x91" * depth + b"\x90"


def _with_raw(msg: dict, field: str, raw: bytes) -> bytes:
    """Pack ``msg`` with ``field`` replaced by the raw msgpack bytes ``raw``."""
    packed = msgpack.packb(dict(msg, **{field: "@@PLACEHOLDER@@"}), use_bin_type=True)
    return packed.replace(msgpack.packb("@@PLACEHOLDER@@"), raw)


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
# ops the data-plane fuzz knows the semantics of; other ops of ops.REQUESTS (added later) are not sent
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
