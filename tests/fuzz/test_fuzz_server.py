"""Bad input on the wire, against a live server (the data plane).

A real in-process job (scheduler + 2 server threads + 2 worker threads, real tcp
sockets, see fuzzing.py) is started once for the module; a raw ZeroMQ DEALER then
sends its servers random and mutated messages (hypothesis, fixed budget, no
shrinking: the cluster is stateful, so the first failing message is reported as it
was sent), and oversized or structurally extreme ones.

Properties, checked after every message:

- the server thread is alive, and the scheduler's ``failure`` is None;
- every message gets a reply within ``REPLY_WAIT_MS`` (an ``error``, or ``ok``
  for a valid read-only request), or is dropped when the protocol says so (a frame
  above the socket's maximum size);
- the stored values never change (a pull over the wire equals the baseline);
- undecodable messages are logged at warning level.

A mutated message can by chance be a *valid* state-changing request (a push from
a real worker rank with the right dtype and size, a valid ``set_optimizer``...).
Such messages are recognised from the spec (docs/protocol.md), not from the
implementation, and are not sent: they would legitimately change the job. Every
other message must be rejected.

At the end of each test the real workers pull every key, run a sync round and
pass a barrier; the module teardown checks that the job then finishes cleanly.
The control plane is fuzzed in test_fuzz_scheduler.py, the bugs this fuzzing found
are pinned in test_fuzz_regressions.py.
"""

from __future__ import annotations

import logging

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzing import (COMPRESSIONS, DIMS, DTYPES, FIELDS, MAX_MSG, MODELED, NEAR, OPT_CONFIGS,
                     RELEVANT, REPLY_WAIT_MS, REQUEST_OPS, SCALARS, SHAPES, WEIRD, Live, S, W,
                     _deep, _show, _wait_reply, _warnings, _with_raw, live_settings)
from kvstore import compression, optimizer
from kvstore.errors import ProtocolError
from kvstore.protocol import codec, decode, encode, ops
from kvstore.protocol.layouts import LAYOUT_FIELDS

pytest_plugins = ["fuzzing"]   # the module-scoped ``live`` fixture


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
    if not _is_int(src) or not _is_int(header.get("id")):   # the node rejects these itself (a bool is no int)
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
    if draw(st.integers(0, 2)) == 0:     # the buffers' fields in a layout frame (the client's requests)
        fields = {name: header.pop(name) for name in sorted(LAYOUT_FIELDS) if name in header}
        header["layout"] = draw(st.sampled_from([True] * 6 + [1, False, None]))
        layout = msgpack.packb(fields, use_bin_type=True)
        if draw(st.integers(0, 5)) == 0 and layout:
            i = draw(st.integers(0, len(layout) - 1))
            layout = layout[:i] + bytes([layout[i] ^ draw(st.integers(1, 255))]) + layout[i + 1:]
        frames.insert(1, layout)
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
