"""Every op of the data plane, every field, every kind of bad value: the server
answers each with a typed error (or, where the value happens to be valid, ``ok``),
no exception leaves its request handling, and bad input changes nothing.

Two levels:

- the server's state machine (``ServerState.handle``, every op of
  ``ops.REQUESTS``), driven directly as the I/O loop drives it: a request that
  raises out of ``handle`` would reach the node's last-resort ``InternalError``
  reply, which is a bug; here it fails the test, naming op, field and value;
- a live job (real sockets, the node's loop: ``ops.NODE`` and ``ops.TRANSPORT``,
  and the reference fields ``shm``/``dev`` of every op), where each message must
  get a reply whose kind is typed and never ``InternalError``, and the server's
  log must show no exception.

A new op fails ``test_every_op_has_a_template`` until it gets a template here:
the fuzz suite grows with each op (docs/security.md). The control plane's ops
are fuzzed in test_fuzz_scheduler.py, which checks its own coverage the same way.
"""

from __future__ import annotations

import logging

import msgpack
import numpy as np
import pytest

from fuzzing import MAX_MSG, REPLY_WAIT_MS, Live, S, _show, _wait_reply
from kvstore import optimizer
from kvstore.protocol import codec, decode, ops
from kvstore.rows.dynamic import DynamicRows
from state_driver import Server, peer

pytestmark = pytest.mark.timeout(300)
pytest_plugins = ["fuzzing"]   # the module-scoped ``live`` fixture

F32, I64 = np.float32, np.int64
A = ("w", 0)                  # a dense float chunk of 6 values on this server
ROWS = ["e", 1]               # a row-sparse key of shape (7, 2): this server (1 of 2) holds rows 1, 3, 5
DYN = ["d", 1]                # a key of dynamic rows, width 2
SGD = optimizer.SGD(learning_rate=0.1, momentum=0.5)
TYPED = {"ProtocolError", "InvalidArgumentError", "ConfigError", "CheckpointError", "RemoteError"}

# one well-formed request per op: (header fields, buffers); the fuzz changes one field at a time
TEMPLATES: dict[str, tuple[dict, list]] = {
    ops.CONFIGURE: ({"mode": "sync", "num_workers": 2}, []),
    ops.INIT: ({"chunks": [["fresh", 0]]}, [np.zeros(4, F32)]),
    ops.PUSH: ({"chunks": [list(A)]}, [np.zeros(6, F32)]),
    ops.PULL: ({"chunks": [list(A)]}, []),
    ops.PUSHPULL: ({"chunks": [list(A)]}, [np.zeros(6, F32)]),
    ops.SET_OPTIMIZER: ({"optimizer": SGD.to_config()}, []),
    ops.GET_STATES: ({}, []),
    ops.SET_STATES: ({"states": [["w", 0, 1, 1]]}, [np.zeros(6, F32)]),
    ops.APPLY_NORMS: ({"chunks": [list(A)], "sums": [[1.0, 1.0]], "rounds": [1], "values": True}, []),
    ops.CHECKPOINT: ({"checkpoint": 1, "step": 1, "meta": {}}, []),
    ops.CHECKPOINT_COMMIT: ({"checkpoint": 1}, []),
    ops.CHECKPOINT_LIST: ({}, []),
    ops.CHECKPOINT_RESTORE: ({"checkpoint": 1}, []),
    ops.GET_META: ({}, []),
    ops.WRITE: ({"chunks": [list(A)], "values": True}, []),
    ops.WRITTEN: ({"grant": 1}, []),
    ops.INIT_ROWS: ({"chunk": ["f", 1], "shape": [7, 2], "dtype": "float32", "servers": 2, "init": None},
                    [np.array([1, 3], I64), np.zeros((2, 2), F32)]),
    ops.PUSH_ROWS: ({"chunk": ROWS}, [np.array([1, 5], I64), np.ones((2, 2), F32)]),
    ops.PULL_ROWS: ({"chunk": ROWS}, [np.array([3], I64)]),
    ops.SET_ROWS: ({"chunk": ROWS}, [np.array([3], I64), np.ones((1, 2), F32)]),
    ops.INIT_DYN: ({"chunk": ["g", 1], "servers": 2,
                    "spec": DynamicRows(2, init=("uniform", 1.0), seed=3).to_wire()}, []),
    ops.PUSH_DYN: ({"chunk": DYN}, [np.array([9], I64), np.ones((1, 2), F32)]),
    ops.PULL_DYN: ({"chunk": DYN}, [np.array([9], I64)]),
    ops.DYN_STATS: ({"chunk": DYN}, []),
    # a primary's rounds to its backup (replicated servers): this server backs nobody up
    ops.REPLICATE: ({"kind": "rounds", "chunks": [list(A)], "rounds": [1], "updated": True}, [np.zeros(6, F32)]),
    # answered by the node and its transports, not the state machine (the live job below)
    ops.COMMAND: ({"head": "profile_stop", "body": ""}, []),
    ops.DURABLE: ({}, []),
    ops.HELLO: ({"nonce": b"\0" * 16}, [np.zeros(16, np.uint8)]),
    ops.CHANNEL: ({}, []),
    ops.DEVICE_HELLO: ({"nonce": b"\0" * 16, "dev_reply": True}, [np.zeros(16, np.uint8)]),
}

# fields any request may carry (docs/protocol.md §2.2): each op is also sent with bad values of these
SHARED_FIELDS = ["chunks", "chunk", "compression", "norms", "group", "rows", "shm", "shm_reply", "dev", "dev_reply",
                 "channel", "keep_state", "state_scale", "staleness", "deterministic", "values", "meta",
                 "precision", "reply_precision", "book", "share", "rounds", "call", "caller", "calls", "applied"]

# every kind of bad value: wrong types, NULs, paths, signs, overflow, nesting, absurd sizes
# (sizes that no check would allow: a missing check shows as an exception, not as memory use)
BAD = [None, True, -1, 2 ** 64 - 1, -2 ** 63, 1.5, float("nan"), float("inf"), "", "\x00", "a\x00b",
       "/etc/x", "../..", b"\x00" * 3, [], [[]], [None], {}, {"x": 1}, {"type": "2bit", "threshold": -1},
       [2 ** 32, 2 ** 32], [4, 2 ** 32, 2 ** 32], [-1, 2], [2 ** 40], [1] * 64, ["w", 0], [["w", 0]] * 3,
       [["w", -1]], [["w", 2 ** 63]], [[1.5, 0]], "x" * 10_000, list(range(1000))]


def _fresh() -> Server:
    """A configured sync server (2 workers, SGD) holding a dense key, a row-sparse key
    and a key of dynamic rows, as server 1 of 2."""
    s = Server(num_workers=2, opt=SGD, init={A: np.arange(6, dtype=F32)})
    for op, fields, arrays in [
            (ops.INIT_ROWS, {"chunk": ROWS, "shape": [7, 2], "dtype": "float32", "servers": 2, "init": None},
             [np.array([1, 3, 5], I64), np.arange(6, dtype=F32).reshape(3, 2)]),
            (ops.INIT_DYN, {"chunk": DYN, "servers": 2,
                            "spec": DynamicRows(2, init=("uniform", 1.0), seed=7).to_wire()}, [])]:
        _, replies = s.send(0, op, arrays=arrays, **fields)
        assert [r.header["op"] for r in replies] == [ops.OK], replies
    return s


def _snapshot(s: Server) -> dict:
    return {cid: c.value.copy() for cid, c in s.state.chunks.items()}


def _cases(op: str):
    fields, arrays = TEMPLATES[op]
    names = list(dict.fromkeys([*fields, "src", *SHARED_FIELDS]))
    for name in names:
        for value in BAD:
            yield f"{name}={value!r:.60}", {**fields, name: value}, arrays
        yield f"without {name}", {k: v for k, v in fields.items() if k != name}, arrays
    for label, bufs in [("no buffers", []), ("an extra buffer", [*arrays, np.zeros(3, F32)]),
                        ("int8 buffers", [a.astype(np.int8) for a in arrays]),
                        ("one value short", [a.reshape(-1)[:-1] for a in arrays if a.size]),
                        ("2-d buffers", [a.reshape(1, -1) for a in arrays])]:
        yield label, fields, bufs


def test_every_op_has_a_template():
    assert set(TEMPLATES) == ops.REQUESTS | ops.NODE | ops.TRANSPORT, \
        set(TEMPLATES) ^ (ops.REQUESTS | ops.NODE | ops.TRANSPORT)


@pytest.mark.parametrize("op", sorted(ops.REQUESTS))
def test_the_state_machine_answers_every_bad_field_of(op):
    s = _fresh()
    before = _snapshot(s)
    answered = 0
    for label, fields, arrays in _cases(op):
        header = {"op": op, "id": 77, "src": 0, **fields}
        try:
            replies = s.state.handle(peer(header["src"]) if type(header["src"]) is int else b"x",
                                     header, list(arrays))
        except Exception as e:   # the node would answer InternalError: a bug
            pytest.fail(f"{op} with {label}: {type(e).__name__} escaped ServerState.handle: {e}")
        mine = [r for r in replies if r.header.get("id") == 77]
        for r in mine:
            assert r.header["op"] in (ops.OK, ops.ERROR), (op, label, r.header)
            if r.header["op"] == ops.ERROR:
                assert r.header.get("kind") in TYPED, (op, label, r.header)
                assert isinstance(r.header.get("message"), str) and r.header["message"], (op, label)
        answered += bool(mine)
        if mine and all(r.header["op"] == ops.ERROR for r in mine) and len(replies) == len(mine):
            now = _snapshot(s)      # an error changes nothing
            assert now.keys() == before.keys() and all(np.array_equal(now[c], before[c]) for c in now), \
                f"{op} with {label} was refused but changed the values"
        else:                       # accepted (or parked): start the next case afresh
            s = _fresh()
            before = _snapshot(s)
    assert answered > 0


# -- the live job: what the node and its transports answer ----------------------------------
NODE_FIELDS = ["head", "body", "nonce", "shm", "dev", "dev_reply", "shm_reply", "channel", "bufs"]


def _live_cases():
    for op in sorted(ops.NODE | ops.TRANSPORT):
        fields, arrays = TEMPLATES[op]
        for name in dict.fromkeys([*fields, *NODE_FIELDS]):
            for value in BAD:
                yield op, f"{name}={value!r:.60}", {**fields, name: value}, arrays
    for op in (ops.PUSH, ops.PUSHPULL, ops.PULL, ops.INIT, ops.PUSH_ROWS):   # references on data ops
        fields, arrays = TEMPLATES[op]
        for name in ("shm", "dev", "pack"):
            for value in BAD + [{"seg": "x", "refs": [[0, 0, 4]]}, {"refs": [[2 ** 63, 0, 4]]}]:
                yield op, f"{name}={value!r:.60}", {**fields, name: value, "chunks": [["nope", 0]]}, arrays


def _frames(op: str, rid: int, fields: dict, arrays: list) -> list:
    """The message as a client would encode it, except that ``bufs`` may be bad too."""
    header = {"v": codec.VERSION, "op": op, "id": rid, "src": 0,
              "bufs": [[a.dtype.str, list(a.shape)] for a in arrays], **fields}
    return [msgpack.packb(header, use_bin_type=True), *(np.ascontiguousarray(a).tobytes() for a in arrays)]


def test_the_node_answers_every_bad_field_of_its_own_ops_and_of_references(live: Live, caplog):
    caplog.set_level(logging.WARNING)
    sock = live.socks[1]
    for rid, (op, label, fields, arrays) in enumerate(_live_cases(), start=1):
        frames = _frames(op, rid, fields, arrays)
        sock.send_multipart(frames, copy=True)
        reply = _wait_reply(sock)
        what = f"{op} with {label}: {_show(frames, 200)}"
        assert reply is not None, f"server 1 did not answer within {REPLY_WAIT_MS} ms: {what}"
        header, _ = decode(reply, MAX_MSG)
        assert header["op"] in (ops.OK, ops.ERROR), (what, header)
        if header["op"] == ops.ERROR:
            assert header.get("kind") in TYPED, (what, header)
        if header["op"] == ops.OK and op == ops.COMMAND and fields.get("head") == "profile_start":
            sock.send_multipart(_frames(op, 0, {"head": "profile_stop", "body": ""}, []))
            assert _wait_reply(sock) is not None
    escaped = [r for r in caplog.records if r.name == "kvstore.server.node" and r.exc_info]
    assert not escaped, f"an exception reached the node's last resort: {escaped[0].getMessage()}"
    live.assert_healthy()
    for server in range(S):
        live.assert_healthy(server)
    live.assert_job_works()


# -- the checkpoint ops of a server with a checkpoint directory (kvstore.server.checkpoint_ops) --
CHECKPOINT_FIELDS = ["checkpoint", "step", "meta", "job", "verify", "id", "src"]


@pytest.mark.parametrize("resume", [False, True], ids=["running", "resuming"])
def test_the_checkpoint_ops_answer_every_bad_field(tmp_path, resume):
    """The node hands a job's checkpoint ops to CheckpointOps (a server started with
    KVSTORE_CHECKPOINT_DIR): every bad value of every field gets a typed error reply
    (or ok), nothing raises, and no file appears outside the checkpoint directory."""
    from kvstore.server.checkpoint_ops import CheckpointOps
    s = _fresh()
    cops = CheckpointOps(str(tmp_path / "ckpt"), 1, 2, s.state, resume=resume, job="6f1c0a9e8d2b4c57")
    cops.start(wait=5.0)
    try:
        cases = 0
        for op in sorted(CheckpointOps.HANDLED):
            fields, _ = TEMPLATES[op]
            for name in dict.fromkeys([*fields, *CHECKPOINT_FIELDS]):
                for value in BAD:
                    header = {"op": op, "id": 77, "src": 0, **fields, name: value}
                    try:
                        reply = cops.handle(header)
                    except Exception as e:   # the node would answer InternalError: a bug
                        pytest.fail(f"{op} with {name}={value!r:.60}: {type(e).__name__} escaped: {e}")
                    assert reply["op"] in (ops.OK, ops.ERROR), (op, name, reply)
                    if reply["op"] == ops.ERROR:
                        assert reply.get("kind") in TYPED, (op, name, reply)
                    cases += 1
        assert cases > 400
    finally:
        cops.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
