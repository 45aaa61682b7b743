"""Frames <-> (header, arrays).

A message is ``[header][buffer 0]...[buffer n-1]``. The header is a msgpack map::

    {"v": 1, "op": "push", "id": 42, "src": 0,
     "chunks": [[key, index], ...],            # what the buffers are (op-specific)
     "bufs": [["<f4", [shape...]], ...]}       # dtype and shape of each buffer

Buffers are raw, C-ordered bytes of exactly ``prod(shape) * itemsize`` bytes.
Only plain numeric dtypes are accepted, so nothing on the wire can carry code.
"""

from __future__ import annotations

import math
from typing import Sequence

import msgpack
import numpy as np

from ..errors import ProtocolError

VERSION = 1
MAX_HEADER_BYTES = 16 << 20
MAX_BUFFERS = 1 << 20

ALLOWED_DTYPES = frozenset(np.dtype(t).str for t in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64"))


def encode(header: dict, arrays: Sequence[np.ndarray] = ()) -> list:
    """Build the frames of one message. ``arrays`` must be C-contiguous; they are
    not copied (the caller sends them zero-copy or lets ZeroMQ copy small ones)."""
    header = dict(header, v=VERSION, bufs=[[a.dtype.str, list(a.shape)] for a in arrays])
    return [msgpack.packb(header, use_bin_type=True), *arrays]


def _buffer(frame) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    return buf if buf is not None else memoryview(frame)


def decode(frames: Sequence, max_buffer_bytes: int = 1 << 30) -> tuple[dict, list[np.ndarray]]:
    """Parse one message. Raises ProtocolError naming what is wrong.

    The returned arrays are read-only views on the frames (no copy)."""
    if not frames:
        raise ProtocolError("empty message")
    head = _buffer(frames[0])
    if head.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {head.nbytes} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(head, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises many unrelated types on garbage
        raise ProtocolError(f"header is not valid msgpack: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header is a {type(header).__name__}, not a map")
    if type(header.get("v")) is not int or header["v"] != VERSION:
        raise ProtocolError(f"protocol version {header.get('v')!r} is not ours ({VERSION}): "
                            "every process of a job must run the same kvstore version")
    if not isinstance(header.get("op"), str):
        raise ProtocolError("header has no 'op' string")
    req_id = header.get("id")
    # nil only in an error reply to a request whose id could not be read
    if (req_id is not None and not isinstance(req_id, int)) or isinstance(req_id, bool) \
            or (req_id is None and header["op"] != "error"):
        raise ProtocolError("header has no integer 'id'")
    bufs = header.get("bufs")
    if not isinstance(bufs, list) or len(bufs) > MAX_BUFFERS:
        raise ProtocolError("header has no valid 'bufs' list")
    if len(bufs) != len(frames) - 1:
        raise ProtocolError(f"header describes {len(bufs)} buffers but {len(frames) - 1} followed "
                            "(truncated message?)")
    arrays = []
    for i, (meta, frame) in enumerate(zip(bufs, frames[1:])):
        dtype, shape = _check_meta(i, meta)
        data = _buffer(frame)
        expected = math.prod(shape) * dtype.itemsize
        if expected > max_buffer_bytes:
            raise ProtocolError(f"buffer {i} of {expected} bytes exceeds the limit of {max_buffer_bytes}")
        if data.nbytes != expected:
            raise ProtocolError(f"buffer {i} has {data.nbytes} bytes; its header says {expected} "
                                f"({dtype.name} x {shape})")
        arrays.append(np.frombuffer(data, dtype=dtype).reshape(shape))
    return header, arrays


def _check_meta(i: int, meta) -> tuple[np.dtype, list[int]]:
    if not (isinstance(meta, list) and len(meta) == 2 and isinstance(meta[0], str)
            and isinstance(meta[1], list)):
        raise ProtocolError(f"buffer {i}: description must be [dtype, shape]")
    if meta[0] not in ALLOWED_DTYPES:
        raise ProtocolError(f"buffer {i}: dtype {meta[0]!r} is not allowed")
    shape = meta[1]
    if len(shape) > 32 or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40
                                  for d in shape):
        raise ProtocolError(f"buffer {i}: invalid shape {shape!r}")
    return np.dtype(meta[0]), shape


def error_header(req_id, kind: str, message: str) -> dict:
    """Header of an error reply."""
    return {"op": "error", "id": req_id, "kind": kind, "message": message}


def chunk_label(chunk) -> str:
    """Human name of a chunk id ``[key, index]`` for error messages."""
    key, index = chunk
    return f"key {key!r} (chunk {index})"
