"""Tests of kvstore.protocol.codec: frames <-> (header, arrays).

Every message a peer can send must either decode into exactly what was encoded
or raise ProtocolError with a message that says what is wrong; nothing else may
escape decode() (the server turns ProtocolError into an error reply and keeps
serving).
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.errors import KVStoreError, ProtocolError
from kvstore.protocol import VERSION, chunk_label, decode, encode, error_header, ops
from kvstore.protocol import codec
from kvstore.protocol.codec import ALLOWED_DTYPES, MAX_BUFFERS, MAX_HEADER_BYTES

# No example database: the tests must not write files into the checkout.
FUZZ = settings(max_examples=40, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def wire(frames):
    """What a socket delivers: every frame as plain bytes."""
    return [bytes(f) if isinstance(f, (bytes, bytearray)) else np.ascontiguousarray(f).tobytes()
            for f in frames]


def raw(header: dict, *buffers: bytes) -> list:
    """Frames with a hand-written header (no help from encode())."""
    return [msgpack.packb(header, use_bin_type=True), *buffers]


def good_header(**over) -> dict:
    h = {"v": VERSION, "op": "push", "id": 1, "src": 0, "chunks": [[1, 0]],
         "bufs": [["<f4", [2, 2]]]}
    h.update(over)
    return h


FOUR_FLOATS = np.arange(4, dtype="<f4").tobytes()  # matches good_header()'s buffer


# -- round trips ------------------------------------------------------------------

ARRAYS = [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.array(3.5, dtype=np.float64),                  # 0-d
    np.zeros((0,), dtype=np.int64),                   # empty
    np.zeros((2, 0, 3), dtype=np.uint8),              # empty, 3-d
    np.array([True, False, True]),
    np.arange(7, dtype=np.float16),
    np.array([-128, 0, 127], dtype=np.int8),
    np.array([-(1 << 15), (1 << 15) - 1], dtype=np.int16),
    np.array([-(1 << 31), 7], dtype=np.int32),
    np.array([np.iinfo(np.int64).min, np.iinfo(np.int64).max], dtype=np.int64),
    np.array([65535], dtype=np.uint16),
    np.array([1 << 31], dtype=np.uint32),
    np.array([np.iinfo(np.uint64).max], dtype=np.uint64),
    np.arange(24, dtype=np.float64).reshape(2, 3, 4),
]


@pytest.mark.parametrize("a", ARRAYS, ids=lambda a: f"{a.dtype}{list(a.shape)}")
@pytest.mark.parametrize("as_bytes", [False, True], ids=["arrays", "bytes"])
def test_round_trip_one_array(a, as_bytes):
    frames = encode({"op": ops.PUSH, "id": 9, "src": 2, "chunks": [[5, 0]]}, [a])
    if as_bytes:
        frames = wire(frames)
    header, arrays = decode(frames)
    assert len(arrays) == 1
    out = arrays[0]
    assert out.dtype == a.dtype and out.shape == a.shape
    np.testing.assert_array_equal(out, a)
    assert header["op"] == ops.PUSH and header["id"] == 9 and header["src"] == 2
    assert header["v"] == VERSION
    assert header["bufs"] == [[a.dtype.str, list(a.shape)]]


def test_round_trip_many_arrays_and_int_and_str_keys():
    big = (1 << 63) - 1
    header = {"op": ops.PUSHPULL, "id": (1 << 62) + 3, "src": 1,
              "chunks": [[0, 0], ["fc1.weight", 2], [big, 1], [-(1 << 63), 0], ["", 0]],
              "extra": {"nested": [1, "two", None, True, 2.5, b"\x00\xff"]}}
    arrays = [np.full(3, i, dtype=np.float32) for i in range(4)] + [np.array(1, np.int64)]
    h, out = decode(wire(encode(header, arrays)))
    assert h["chunks"] == [[0, 0], ["fc1.weight", 2], [big, 1], [-(1 << 63), 0], ["", 0]]
    assert isinstance(h["chunks"][1][0], str)
    assert type(h["chunks"][2][0]) is int
    assert h["id"] == (1 << 62) + 3
    assert h["extra"] == {"nested": [1, "two", None, True, 2.5, b"\x00\xff"]}
    assert len(out) == len(arrays)
    for got, want in zip(out, arrays):
        np.testing.assert_array_equal(got, want)
        assert got.dtype == want.dtype and got.shape == want.shape


def test_round_trip_without_buffers():
    frames = encode({"op": ops.PULL, "id": 1, "src": 0, "chunks": [["k", 0]]})
    assert len(frames) == 1
    h, arrays = decode(wire(frames))
    assert arrays == [] and h["bufs"] == [] and h["chunks"] == [["k", 0]]


def test_encode_does_not_copy_and_overrides_caller_version():
    a = np.arange(5, dtype=np.float32)
    frames = encode({"op": "push", "id": 1, "v": 99, "bufs": "junk"}, [a])
    assert frames[1] is a
    h = msgpack.unpackb(frames[0], raw=False)
    assert h["v"] == VERSION and h["bufs"] == [["<f4", [5]]]


def test_encode_leaves_caller_header_untouched():
    header = {"op": "push", "id": 1}
    encode(header, [np.zeros(2, np.float32)])
    assert header == {"op": "push", "id": 1}


@pytest.mark.parametrize("make", [bytes, bytearray, memoryview], ids=["bytes", "bytearray", "memoryview"])
def test_decode_returns_views_not_copies(make):
    a = np.arange(256, dtype=np.float64)
    frames = encode({"op": "push", "id": 1}, [a])
    frame = make(a.tobytes())
    _, (out,) = decode([frames[0], frame])
    assert np.shares_memory(out, np.frombuffer(frame, dtype=np.uint8)), "decode copied the buffer"
    np.testing.assert_array_equal(out, a)
    if make is bytes:
        assert not out.flags.writeable  # a view on immutable bytes must stay read-only


def test_decode_views_numpy_frames_zero_copy():
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    frames = encode({"op": "push", "id": 1}, [a])
    _, (out,) = decode(frames)
    assert np.shares_memory(out, a)


# -- errors ------------------------------------------------------------------------

def test_protocol_error_is_a_kvstore_error():
    assert issubclass(ProtocolError, KVStoreError)


def test_empty_frame_list():
    with pytest.raises(ProtocolError, match="empty"):
        decode([])


@pytest.mark.parametrize("head", [b"", b"\xc1", b"\x92\x01", b"\x81\xa1v", b"\x01\x02",
                                  b"\xdb\xff\xff\xff\xff"],
                         ids=["empty", "reserved-byte", "truncated-array", "truncated-map",
                              "extra-data", "huge-str-length"])
def test_header_not_msgpack(head):
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        decode([head])


@pytest.mark.parametrize("value", [[1, 2], "push", 7, None, 1.5, b"x"],
                         ids=["list", "str", "int", "nil", "float", "bin"])
def test_header_not_a_map(value):
    with pytest.raises(ProtocolError, match=f"header is a {type(value).__name__}, not a map"):
        decode([msgpack.packb(value, use_bin_type=True)])


@pytest.mark.parametrize("v", [0, 2, VERSION + 1, "1", 1.5, None, [1], -1])
def test_wrong_version(v):
    with pytest.raises(ProtocolError, match=r"protocol version .* is not ours") as e:
        decode(raw(good_header(v=v), FOUR_FLOATS))
    assert repr(v) in str(e.value)  # the message names the version it got


def test_missing_version():
    h = good_header()
    del h["v"]
    with pytest.raises(ProtocolError, match="protocol version None is not ours"):
        decode(raw(h, FOUR_FLOATS))


@pytest.mark.parametrize("v", [True, 1.0], ids=["true", "float"])
def test_version_equal_to_1_but_not_an_int_is_rejected(v):
    # regression: msgpack true (== 1 in Python) used to pass as version 1
    with pytest.raises(ProtocolError, match="protocol version"):
        decode(raw(good_header(v=v), FOUR_FLOATS))


@pytest.mark.parametrize("op", [None, 5, b"push", ["push"]], ids=["missing", "int", "bin", "list"])
def test_missing_or_bad_op(op):
    h = good_header(op=op)
    if op is None:
        del h["op"]
    with pytest.raises(ProtocolError, match="'op'"):
        decode(raw(h, FOUR_FLOATS))


@pytest.mark.parametrize("req_id", [None, True, False, "1", 1.0, [1]],
                         ids=["missing", "true", "false", "str", "float", "list"])
def test_missing_or_bad_id(req_id):
    h = good_header(id=req_id)
    if req_id is None:
        del h["id"]
    with pytest.raises(ProtocolError, match="integer 'id'"):
        decode(raw(h, FOUR_FLOATS))


@pytest.mark.parametrize("bufs", [None, "x", {"0": 1}, 3], ids=["missing", "str", "map", "int"])
def test_missing_or_bad_bufs(bufs):
    h = good_header(bufs=bufs)
    if bufs is None:
        del h["bufs"]
    with pytest.raises(ProtocolError, match="'bufs'"):
        decode(raw(h, FOUR_FLOATS))


def test_error_reply_may_have_nil_id_but_requests_may_not():
    # a server answers a request whose id it could not read with id nil
    h, arrays = decode(wire(encode(error_header(None, "ProtocolError", "bad header"))))
    assert h["op"] == ops.ERROR and h["id"] is None and arrays == []
    with pytest.raises(ProtocolError, match="integer 'id'"):
        decode(wire(encode({"op": ops.OK, "id": None})))


def test_too_many_buffers(monkeypatch):
    assert 1024 <= MAX_BUFFERS < 1 << 31
    monkeypatch.setattr(codec, "MAX_BUFFERS", 4)  # the real limit costs seconds to build
    decode(raw(good_header(bufs=[["<f4", [0]]] * 4), *[b""] * 4))
    with pytest.raises(ProtocolError, match="'bufs'"):
        decode(raw(good_header(bufs=[["<f4", [0]]] * 5), *[b""] * 5))
    with pytest.raises(ProtocolError, match="'bufs'"):
        decode(raw(good_header(bufs=[["<f4", [0]]] * 5)))  # refused before counting frames


@pytest.mark.parametrize("nframes", [0, 2, 3])
def test_buffer_count_differs_from_frames(nframes):
    with pytest.raises(ProtocolError, match=f"describes 1 buffers but {nframes} followed"):
        decode(raw(good_header(), *[FOUR_FLOATS] * nframes))


@pytest.mark.parametrize("nbytes", [0, 1, 15, 17, 32])
def test_byte_count_mismatch(nbytes):
    # good_header(): float32 x [2, 2] = 16 bytes
    with pytest.raises(ProtocolError, match=f"buffer 0 has {nbytes} bytes; its header says 16"):
        decode(raw(good_header(), bytes(nbytes)))


def test_truncated_second_buffer_is_named():
    a = np.zeros(3, np.float64)
    frames = wire(encode({"op": "push", "id": 1}, [a, a]))
    frames[2] = frames[2][:-1]
    with pytest.raises(ProtocolError, match="buffer 1 has 23 bytes; its header says 24"):
        decode(frames)


@pytest.mark.parametrize("dtype", ["|O", "<U4", "V8", "|V8", ">f4", ">i8", "float32", "f4", "<c8",
                                   "<M8[s]", "", "<f4 "])
def test_disallowed_dtype(dtype):
    h = good_header(bufs=[[dtype, [1]]])
    with pytest.raises(ProtocolError, match=r"buffer 0: dtype .* is not allowed") as e:
        decode(raw(h, bytes(16)))
    assert repr(dtype) in str(e.value)


def test_allowed_dtypes_are_plain_numbers_only():
    kinds = {np.dtype(d).kind for d in ALLOWED_DTYPES}
    assert kinds <= set("biuf")
    assert not any(np.dtype(d).hasobject for d in ALLOWED_DTYPES)
    assert len(ALLOWED_DTYPES) == 12


@pytest.mark.parametrize("meta", [["<f4"], ["<f4", [1], 0], "<f4", ["<f4", 4], [4, [1]], None,
                                  ["<f4", "4"]],
                         ids=["short", "long", "str", "int-shape", "int-dtype", "nil", "str-shape"])
def test_bad_buffer_description(meta):
    with pytest.raises(ProtocolError, match="buffer 0: description must be \\[dtype, shape\\]"):
        decode(raw(good_header(bufs=[meta]), FOUR_FLOATS))


@pytest.mark.parametrize("shape", [[-1], [2, -2], [1.5], ["2"], [None], [True], [[2]],
                                   [1 << 40], [1] * 33],
                         ids=["neg", "neg2", "float", "str", "nil", "bool", "list", "huge", "33-dims"])
def test_bad_shape(shape):
    with pytest.raises(ProtocolError, match="buffer 0: invalid shape"):
        decode(raw(good_header(bufs=[["<f4", shape]]), FOUR_FLOATS))


def test_header_bigger_than_limit():
    h = good_header(pad="x" * MAX_HEADER_BYTES)
    frames = raw(h, FOUR_FLOATS)
    assert len(frames[0]) > MAX_HEADER_BYTES
    with pytest.raises(ProtocolError, match=f"exceeds the limit of {MAX_HEADER_BYTES}"):
        decode(frames)


def test_oversized_header_is_refused_before_parsing():
    # Garbage of the limit + 1 bytes: the size check comes first, so no parse attempt.
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        decode([b"\xc1" * (MAX_HEADER_BYTES + 1)])


def test_header_at_the_limit_is_accepted():
    h = good_header(pad="")
    base = len(msgpack.packb(h, use_bin_type=True))
    # a str32 needs 5 bytes of prefix; choose the padding so the header is exactly the limit
    h["pad"] = "x" * (MAX_HEADER_BYTES - base - 4)
    frames = raw(h, FOUR_FLOATS)
    assert len(frames[0]) == MAX_HEADER_BYTES
    header, _ = decode(frames)
    assert len(header["pad"]) == MAX_HEADER_BYTES - base - 4


def test_buffer_larger_than_limit():
    a = np.zeros(4, np.float32)  # 16 bytes
    frames = wire(encode({"op": "push", "id": 1}, [a]))
    decode(frames, max_buffer_bytes=16)
    with pytest.raises(ProtocolError, match="buffer 0 of 16 bytes exceeds the limit of 15"):
        decode(frames, max_buffer_bytes=15)


def test_huge_claimed_shape_is_refused_without_allocation():
    # A tiny frame claiming 2**39 float64 elements: refused by the size limit (not by a
    # failed allocation or a reshape error).
    h = good_header(bufs=[["<f8", [1 << 39]]])
    with pytest.raises(ProtocolError, match="exceeds the limit of 1073741824"):
        decode(raw(h, b"\x00" * 8))
    h = good_header(bufs=[["<f8", [(1 << 40) - 1] * 32]])
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        decode(raw(h, b""))


def test_error_header_and_chunk_label():
    assert error_header(7, "ProtocolError", "bad") == {
        "op": ops.ERROR, "id": 7, "kind": "ProtocolError", "message": "bad"}
    assert chunk_label(["fc1.weight", 3]) == "key 'fc1.weight' (chunk 3)"
    assert chunk_label((12, 0)) == "key 12 (chunk 0)"


# -- fuzzing -----------------------------------------------------------------------

def _decode_or_protocol_error(frames):
    """decode() must return (dict, arrays matching the frames) or raise ProtocolError."""
    try:
        header, arrays = decode(frames)
    except ProtocolError as e:
        assert str(e), "ProtocolError without a message"
        return None
    assert isinstance(header, dict)
    assert len(arrays) == len(frames) - 1
    for a, f in zip(arrays, frames[1:]):
        assert isinstance(a, np.ndarray) and a.nbytes == memoryview(f).nbytes
        assert a.dtype.str in ALLOWED_DTYPES
    return header, arrays


@settings(FUZZ, max_examples=100)
@given(st.binary(max_size=300), st.lists(st.binary(max_size=64), max_size=4))
def test_fuzz_random_bytes(head, rest):
    _decode_or_protocol_error([head, *rest])


# Cheap, non-recursive junk (recursive strategies cost ~10 ms an example).
msgpack_values = st.one_of(
    st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(),
    st.text(max_size=6), st.binary(max_size=6),
    st.lists(st.integers(-3, 3) | st.text(max_size=2), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(-3, 3), max_size=2))

dtype_strings = st.sampled_from(sorted(ALLOWED_DTYPES) + ["|O", "<U4", "|V8", ">f4", "x"])
shapes = st.lists(st.integers(-2, 6) | st.sampled_from([True, 1.0, "3", None, 1 << 40]), max_size=4)
metas = st.one_of(st.tuples(dtype_strings, shapes).map(list), msgpack_values)


@st.composite
def near_valid_messages(draw):
    """Headers that get past the first checks, buffers of right or wrong length."""
    header = {"v": draw(st.sampled_from([VERSION, VERSION, VERSION, 0, True, "1"])),
              "op": draw(st.sampled_from(["push", "pull"]) | msgpack_values),
              "id": draw(st.integers(-(1 << 63), (1 << 63) - 1) | msgpack_values),
              "bufs": draw(st.lists(metas, max_size=3) | msgpack_values)}
    if draw(st.booleans()):
        header["chunks"] = draw(msgpack_values)
    head = msgpack.packb(header, use_bin_type=True)
    frames = [head]
    bufs = header["bufs"] if isinstance(header["bufs"], list) else []
    for meta in bufs + draw(st.lists(st.none(), max_size=1)):
        nbytes = None
        try:
            nbytes = int(np.prod(meta[1])) * np.dtype(meta[0]).itemsize
        except Exception:
            pass
        if nbytes is None or nbytes < 0 or nbytes > 4096 or draw(st.booleans()):
            frames.append(draw(st.binary(max_size=40)))
        else:
            frames.append(bytes(nbytes))
    return frames


@FUZZ
@given(near_valid_messages())
def test_fuzz_structured_headers(frames):
    _decode_or_protocol_error(frames)


@st.composite
def valid_messages(draw):
    arrays = []
    for _ in range(draw(st.integers(0, 3))):
        dt = np.dtype(draw(st.sampled_from(sorted(ALLOWED_DTYPES))))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        arrays.append(np.frombuffer(draw(st.binary(min_size=int(np.prod(shape)) * dt.itemsize,
                                                   max_size=int(np.prod(shape)) * dt.itemsize)),
                                    dtype=dt).reshape(shape))
    header = {"op": draw(st.sampled_from(sorted(ops.REQUESTS))), "id": draw(st.integers(0, 1 << 40)),
              "src": draw(st.integers(0, 100)),
              "chunks": draw(st.lists(st.tuples(st.integers(-(1 << 63), (1 << 63) - 1) | st.text(max_size=6),
                                                st.integers(0, 99)).map(list), max_size=3))}
    return header, arrays


@FUZZ
@given(valid_messages())
def test_fuzz_valid_round_trip(msg):
    header, arrays = msg
    h, out = decode(wire(encode(header, arrays)))
    for k, v in header.items():
        assert h[k] == v
    assert len(out) == len(arrays)
    for got, want in zip(out, arrays):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()  # bitwise: NaN payloads survive


@FUZZ
@given(valid_messages(), st.data())
def test_fuzz_mutated_messages(msg, data):
    header, arrays = msg
    frames = wire(encode(header, arrays))
    i = data.draw(st.integers(0, len(frames) - 1), label="frame")
    f = bytearray(frames[i])
    action = data.draw(st.sampled_from(["flip", "truncate", "extend", "drop"]), label="action")
    if action == "flip" and f:
        pos = data.draw(st.integers(0, len(f) - 1))
        f[pos] ^= data.draw(st.integers(1, 255))
    elif action == "truncate" and f:
        del f[data.draw(st.integers(0, len(f) - 1)):]
    elif action == "extend":
        f += data.draw(st.binary(min_size=1, max_size=8))
    frames[i] = bytes(f)
    if action == "drop":
        del frames[i]
    _decode_or_protocol_error(frames)
