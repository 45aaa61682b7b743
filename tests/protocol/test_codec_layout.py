"""A message's buffers' fields in a layout frame (kvstore.protocol.codec ``layout``,
kvstore/protocol/layouts.py, docs/protocol.md 2.1): it decodes to what was encoded,
with or without a memo; with one, a repeated layout is decoded once per sender and op
(its references resolved once) while every frame sent with it is read anew; and a
layout that is malformed, or that does not describe its frames, is a ProtocolError
naming it, remembered by no memo."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.errors import ProtocolError
from kvstore.protocol import VERSION, decode, encode
from kvstore.protocol.codec import MAX_HEADER_BYTES, PACK_BYTES
from kvstore.protocol.layouts import LAYOUT_FIELDS, LayoutMemo

FUZZ = settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
SEGMENT = (4242, 7, 1 << 20)


def wire(frames):
    return [bytes(f) if isinstance(f, (bytes, bytearray)) else np.ascontiguousarray(f).tobytes() for f in frames]


class Memory:
    """A peer's memory that references point into; counts the references resolved."""

    def __init__(self):
        self.bytes = np.arange(1 << 18, dtype=np.float32).view(np.uint8)
        self.resolved = 0

    def resolve(self, segment, offset, dtype, shape):
        assert segment == SEGMENT
        self.resolved += 1
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if offset + n > self.bytes.size:
            raise ProtocolError(f"offset {offset} out of the segment")
        return self.bytes[offset:offset + n].view(dtype).reshape(shape)


def request(values, refs=2, src=0, op="pushpull", seq=0):
    """A request's frames as the client sends them: ``refs`` references, then ``values``
    inline (the small ones packed)."""
    arrays = [np.zeros(4, np.float32)] * refs + list(values)
    shared = [(SEGMENT, 64 * i, "shm") for i in range(refs)] + [None] * len(values)
    chunks = [[k, 0] for k in range(len(arrays))]
    return encode({"op": op, "id": 10 + seq, "src": src, "seq": seq, "chunks": chunks, "pack": True},
                  arrays, shared, layout=True)


def test_a_layout_frame_holds_the_buffers_fields_and_decodes_as_the_plain_message():
    values = [np.full(3, 5, np.int64), np.arange(PACK_BYTES // 4 + 1, dtype=np.float32)]
    frames = request(values)
    header = msgpack.unpackb(frames[0])
    assert header["layout"] is True and not set(header) & LAYOUT_FIELDS
    assert set(msgpack.unpackb(frames[1])) == {"bufs", "chunks", "shm"}
    memory = Memory()
    got, arrays = decode(wire(frames), resolve={"shm": memory.resolve})
    plain, plain_arrays = decode(wire(encode({"op": "pushpull", "id": 10, "src": 0, "seq": 0,
                                              "chunks": got["chunks"]},
                                             [np.zeros(4, np.float32)] * 2 + values,
                                             [(SEGMENT, 0, "shm"), (SEGMENT, 64, "shm"), None, None])),
                                 resolve={"shm": memory.resolve})
    assert {k: v for k, v in got.items() if k != "layout"} == plain
    for a, b in zip(arrays, plain_arrays):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(arrays[3], values[1])


def test_a_memo_decodes_a_layout_once_per_sender_and_op_and_reads_every_frame_anew():
    memory, memo = Memory(), LayoutMemo()
    resolve = {"shm": memory.resolve}
    first = decode(wire(request([np.full(3, 1, np.int64)])), resolve=resolve, memo=memo)
    assert memory.resolved == 2 and len(memo) == 1
    header, arrays = decode(wire(request([np.full(3, 2, np.int64)], seq=1)), resolve=resolve, memo=memo)
    assert memory.resolved == 2 and len(memo) == 1              # the references: resolved once
    assert header["seq"] == 1 and header["id"] == 11 and header["chunks"] == first[0]["chunks"]
    assert arrays[0] is first[1][0] and arrays[1] is first[1][1]    # the same memory's arrays
    np.testing.assert_array_equal(arrays[2], 2)                 # the frame: this message's
    # another sender, or another op, with the same layout bytes: decoded (and checked) again
    decode(wire(request([np.full(3, 3, np.int64)], src=1)), resolve=resolve, memo=memo)
    decode(wire(request([np.full(3, 3, np.int64)], op="push")), resolve=resolve, memo=memo)
    assert memory.resolved == 6 and len(memo) == 3
    # a frame that no longer fits its remembered description is still refused
    frames = wire(request([np.full(3, 4, np.int64)], seq=2))
    with pytest.raises(ProtocolError, match="buffer 2 has 16 bytes"):
        decode(frames[:-1] + [frames[-1][:16]], resolve=resolve, memo=memo)


def test_a_layout_that_does_not_decode_is_refused_by_name_and_not_remembered():
    memory, memo = Memory(), LayoutMemo()
    head = {"v": VERSION, "op": "push", "id": 3, "src": 0}
    layout = msgpack.packb({"bufs": [["<f4", [2]]], "chunks": [[1, 0]]})
    data = np.ones(2, np.float32).tobytes()
    cases = {
        "invalid 'layout'": [msgpack.packb({**head, "layout": 1}), layout, data],
        "frame after the header": [msgpack.packb({**head, "layout": True})],
        "not in the header": [msgpack.packb({**head, "layout": True, "bufs": []}), layout, data],
        "not valid msgpack": [msgpack.packb({**head, "layout": True}), b"\xc1", data],
        "map of bufs": [msgpack.packb({**head, "layout": True}), msgpack.packb({"bufs": [], "op": "x"}), data],
        "no valid 'bufs'": [msgpack.packb({**head, "layout": True}), msgpack.packb({"bufs": 3}), data],
        "exceeds the limit": [msgpack.packb({**head, "layout": True}), bytes(MAX_HEADER_BYTES + 1), data],
        "1 buffers but 0 followed": [msgpack.packb({**head, "layout": True}), layout],
        "out of the segment": [msgpack.packb({**head, "layout": True}),
                               msgpack.packb({"bufs": [["<f4", [2]]], "shm": {"segs": [list(SEGMENT)],
                                                                               "refs": [[0, 1 << 30]]}}), ],
    }
    for why, frames in cases.items():
        with pytest.raises(ProtocolError, match=why) as e:
            decode(frames, resolve={"shm": memory.resolve}, memo=memo)
        assert e.value.request_id == 3, why
    assert len(memo) == 0


def test_a_memo_is_bounded_and_starts_again_empty():
    memo: LayoutMemo = LayoutMemo(max_layouts=2, max_bytes=100)
    for i in range(2):
        memo.keep((i, 0, "push"), "layout", 11)
    assert len(memo) == 2
    memo.keep(("third", 0, "push"), "layout", 5)
    assert len(memo) == 1 and memo.get(("third", 0, "push")) == "layout"
    memo.keep(("y", 0, "push"), "big", 96)                   # past the bytes: starts again
    assert len(memo) == 1 and memo.get(("third", 0, "push")) is None
    memo.keep(("z", 0, "push"), "too big", 101)              # never kept
    assert len(memo) == 0


@FUZZ
@given(st.lists(st.tuples(st.sampled_from([0, 1, 5, 300]), st.sampled_from(["int8", "float32", "float64"])),
                max_size=6), st.integers(0, 3))
def test_layout_messages_decode_to_what_was_encoded(specs, refs):
    values = [np.arange(n).astype(d) for n, d in specs]
    memory, memo = Memory(), LayoutMemo()
    for seq in range(2):        # the second from the memo
        header, arrays = decode(wire(request(values, refs=refs, seq=seq)), resolve={"shm": memory.resolve},
                                memo=memo)
        assert header["seq"] == seq and len(arrays) == refs + len(values)
        for a, v in zip(arrays[refs:], values):
            np.testing.assert_array_equal(a, v)
    assert memory.resolved == refs


def test_a_sender_field_that_is_not_an_int_decodes_without_the_memo():
    """(found by the server fuzz: a map as ``src`` made the memo's key unhashable and
    the message was dropped unanswered) ``src`` other than an int is decoded as
    ever, never kept, and left for the receiver to refuse."""
    memory, memo = Memory(), LayoutMemo()
    frames = wire(request([np.full(3, 1, np.int64)]))
    header = msgpack.unpackb(frames[0])
    for src in ({"a": 1}, [0], 1.5, True):
        odd = [msgpack.packb(dict(header, src=src)), *frames[1:]]
        got, _ = decode(odd, resolve={"shm": memory.resolve}, memo=memo)
        assert got["src"] == src
    assert len(memo) == 0


def test_a_sender_packs_a_layout_of_the_same_content_once_and_every_buffer_anew():
    """The sender's ``LayoutMemo``: a message of the same chunks, dtypes, shapes
    and references as one sent before takes that one's layout frame (the same bytes,
    not built again), while its buffers (packed small ones included) are this message's;
    another chunk, shape, dtype or reference is another layout."""
    sent = LayoutMemo()

    def frames(fill, chunks=((1, 0), (2, 0), (3, 0)), n=3, dtype=np.int64, offset=64):
        values = [np.full(n, fill, dtype), np.full(2, fill + 1, np.float32)]
        return encode({"op": "pushpull", "id": fill, "src": 0, "chunks": [list(c) for c in chunks], "pack": True},
                      [np.zeros(4, np.float32)] + values, [(SEGMENT, offset, "shm"), None, None], layout=True,
                      sent=sent)
    first, again = frames(1), frames(2)
    assert len(sent) == 1 and again[1] == first[1]
    plain = encode({"op": "pushpull", "id": 2, "src": 0, "chunks": [[1, 0], [2, 0], [3, 0]], "pack": True},
                   [np.zeros(4, np.float32), np.full(3, 2, np.int64), np.full(2, 3, np.float32)],
                   [(SEGMENT, 64, "shm"), None, None], layout=True)
    assert wire(again) == wire(plain)                     # what was built without the memo, to the byte
    memory = Memory()
    _, arrays = decode(wire(again), resolve={"shm": memory.resolve})
    np.testing.assert_array_equal(arrays[1], 2)
    np.testing.assert_array_equal(arrays[2], 3)
    for other in (dict(chunks=((1, 0), (2, 0), (4, 0))), dict(n=4), dict(dtype=np.int32), dict(offset=128)):
        assert frames(5, **other)[1] != first[1]
    assert len(sent) == 5
    sent.clear()
    assert len(sent) == 0
