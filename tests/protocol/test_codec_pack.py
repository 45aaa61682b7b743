"""Small buffers packed into one frame (kvstore.protocol.codec: a header's ``pack: true``
asks encode for it, docs/protocol.md 2.1): what is encoded decodes to exactly
the same arrays, with or without references beside them; a ``pack`` field or packed
frame that does not describe its buffers exactly is a ProtocolError naming it."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.errors import ProtocolError
from kvstore.protocol import VERSION, decode, encode
from kvstore.protocol.codec import PACK_ALIGN, PACK_BYTES

FUZZ = settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "float16", "float32", "float64"]


def wire(frames):
    return [bytes(f) if isinstance(f, (bytes, bytearray)) else np.ascontiguousarray(f).tobytes() for f in frames]


def arrays_of(sizes_and_dtypes):
    rng = np.random.default_rng(0)
    return [(rng.integers(0, 100, size=n) % (2 if d == "bool" else 100)).astype(d) for n, d in sizes_and_dtypes]


@FUZZ
@given(st.lists(st.tuples(st.sampled_from([0, 1, 3, 7, 100, PACK_BYTES // 8, PACK_BYTES]), st.sampled_from(DTYPES)),
                max_size=8))
def test_packed_messages_decode_to_what_was_encoded(specs):
    arrays = arrays_of(specs)
    frames = encode({"op": "push", "id": 3, "pack": True}, arrays)
    header = msgpack.unpackb(frames[0])
    small = [i for i, a in enumerate(arrays) if a.nbytes < PACK_BYTES]
    if len(small) >= 2:
        assert header["pack"] == small
        assert len(frames) == 2 + len(arrays) - len(small)
    else:
        assert "pack" not in header and len(frames) == 1 + len(arrays)
    _, got = decode(wire(frames))
    assert len(got) == len(arrays)
    for a, b in zip(arrays, got):
        assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all()


def test_packing_keeps_shapes_scalars_and_alignment():
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array(7.5), np.ones(3, np.int8), np.arange(3.0)]
    frames = encode({"op": "pushpull", "id": 1, "pack": True}, arrays)
    assert len(frames) == 2
    _, got = decode(wire(frames))
    for a, b in zip(arrays, got):
        assert a.shape == b.shape and (a == b).all()
    # each packed buffer starts at a multiple of PACK_ALIGN bytes in the frame
    assert len(frames[1]) == 24 + 8 + 8 + 24 and PACK_ALIGN == 8


def test_packing_beside_references():
    arrays = [np.ones(2, np.float32), np.full(3, 2.0, np.float32), np.full(4, 3.0, np.float32)]
    resolved = np.full(3, 9.0, np.float32)
    frames = encode({"op": "pushpull", "id": 1, "pack": True}, arrays, [None, ((5,), 64), None])
    header = msgpack.unpackb(frames[0])
    assert header["pack"] == [0, 2] and len(frames) == 2
    _, got = decode(wire(frames), resolve={"shm": lambda seg, off, dtype, shape: resolved})
    assert (got[0] == 1).all() and got[1] is resolved and (got[2] == 3).all()


def packed_header(**over):
    h = {"v": VERSION, "op": "push", "id": 4, "src": 0, "chunks": [[1, 0], [1, 1]],
         "bufs": [["<f4", [2]], ["<f4", [3]]], "pack": [0, 1]}
    h.update(over)
    return h


GOOD_PACK = bytes(8) + bytes(12)


def test_a_well_formed_packed_message_decodes():
    _, got = decode([msgpack.packb(packed_header()), GOOD_PACK])
    assert [a.shape for a in got] == [(2,), (3,)]


@pytest.mark.parametrize("pack", [[0], [1, 0], [0, 0], [0, 2], [-1, 1], [0, True], "01", {"0": 1}, [0.0, 1]])
def test_a_bad_pack_field_is_refused(pack):
    with pytest.raises(ProtocolError, match="invalid 'pack' field"):
        decode([msgpack.packb(packed_header(pack=pack)), GOOD_PACK])


@pytest.mark.parametrize("frame", [GOOD_PACK[:-1], GOOD_PACK + bytes(1), bytes(8) + bytes(8), b""])
def test_a_packed_frame_of_the_wrong_size_is_refused(frame):
    with pytest.raises(ProtocolError, match="packed frame"):
        decode([msgpack.packb(packed_header()), frame])


def test_a_packed_message_with_a_frame_too_many_or_few_is_refused():
    with pytest.raises(ProtocolError, match="describes 1 buffers but 2 followed"):
        decode([msgpack.packb(packed_header()), GOOD_PACK, GOOD_PACK])
    with pytest.raises(ProtocolError, match="describes 1 buffers but 0 followed"):
        decode([msgpack.packb(packed_header())])


def test_a_buffer_too_large_to_pack_is_refused_in_a_pack():
    big = PACK_BYTES // 4
    header = packed_header(bufs=[["<f4", [big]], ["<f4", [1]]])
    with pytest.raises(ProtocolError, match="does not fit in the packed frame"):
        decode([msgpack.packb(header), bytes(PACK_BYTES + 8)])


def test_a_referenced_buffer_cannot_also_be_packed():
    header = packed_header(shm={"segs": [[5]], "refs": [[0, 0], None]})
    with pytest.raises(ProtocolError, match="invalid 'pack' field"):
        decode([msgpack.packb(header), GOOD_PACK], resolve={"shm": lambda *a: np.zeros(2, np.float32)})
