"""Frames <-> (header, arrays).

A message is ``[header][buffer 0]...[buffer n-1]``. The header is a msgpack map::

    {"v": 1, "op": "push", "id": 42, "src": 0,
     "chunks": [[key, index], ...],            # what the buffers are (op-specific)
     "bufs": [["<f4", [shape...]], ...]}       # dtype and shape of each buffer

Buffers are raw, C-ordered bytes of exactly ``prod(shape) * itemsize`` bytes.
Only plain numeric dtypes are accepted, so nothing on the wire can carry code.

A buffer may instead be passed by reference into memory both ends can reach
(docs/protocol.md 2.7): the header then has a field per kind of reference,
``shm`` (a segment of host shared memory) or ``dev`` (device memory exported by
CUDA IPC, kvstore.devices), each ``{"segs": [...], "refs": [...]}``; the receiver
resolves each kind with its own resolver, so whose memory a reference names is
never ambiguous.

Small buffers may travel packed into one frame (``pack``: the indices of the buffers
in it, docs/protocol.md 2.1): one frame of many small values costs ZeroMQ one part
instead of one each, which for a call of 161 keys was most of a message's cost.

The fields that describe the buffers (``bufs``, ``pack``, ``shm``, ``dev`` and
``chunks``) may travel in a frame of their own after the header (``layout``: true,
docs/protocol.md 2.1), which a receiver with a :class:`~.layouts.LayoutMemo` decodes
once per sender and content (kvstore/protocol/layouts.py).
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

import msgpack
import numpy as np

from ..errors import ProtocolError
from . import ops
from .layouts import LAYOUT_FIELDS, Described, Layout, LayoutMemo

VERSION = 1
MAX_HEADER_BYTES = 1 << 20
MAX_BUFFERS = 1 << 16
MAX_SEGMENT_WORDS = 16     # ints naming one segment (a CUDA IPC handle is 8 x 64 bits)

# the kinds of reference, each a header field: host shared memory, device memory
REF_KINDS = ("shm", "dev")
# resolve(segment, offset, dtype, shape) -> the referenced array, or ProtocolError
Resolver = Callable[..., np.ndarray]
# buffers under this many bytes are packed into one frame when the sender asks
# (encode's ``pack``); each starts at a multiple of PACK_ALIGN bytes in it
PACK_BYTES = 64 << 10
PACK_ALIGN = 8
_PADS = [bytes(n) for n in range(PACK_ALIGN)]

ALLOWED_DTYPES = frozenset(np.dtype(t).str for t in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64"))


def encode(header: dict, arrays: Sequence[np.ndarray] = (), shared: Sequence | None = None,
           layout: bool = False, sent: LayoutMemo[Described] | None = None) -> list:
    """Build the frames of one message. ``arrays`` must be C-contiguous; they are
    not copied (the caller sends them zero-copy or lets ZeroMQ copy small ones).

    ``shared`` (optional, parallel to ``arrays``): for each array None (sent as a
    frame), ``(segment, offset)`` where the receiver finds it in shared memory, or
    ``(segment, offset, kind)`` for a reference of another kind (``"dev"``: device
    memory); ``segment`` is a tuple of ints, opaque here. See the header fields
    ``shm`` and ``dev``. Device arrays may be passed when referenced (only their
    dtype and shape are read).

    ``header["pack"] is True`` asks for the buffers sent in the message that are under
    :data:`PACK_BYTES`, if there are two or more, to be copied into one frame, the
    first after the header (the header's ``pack`` then lists them; without two such
    buffers it is dropped); only for messages that go through ZeroMQ as they are (a
    data channel writes each buffer on its own, docs/protocol.md 2.8).

    ``layout``: the fields that describe the buffers (:data:`LAYOUT_FIELDS`) go in a
    frame of their own after the header, which says ``layout: true`` (requests a
    receiver decodes with a :class:`LayoutMemo`; not for a data channel). ``sent``
    (the sender's :class:`LayoutMemo`): a layout of the same content as one packed
    before (chunks, each buffer's dtype, shape and reference) is not built again."""
    header = dict(header, v=VERSION)
    pack = header.pop("pack", None) is True
    key = _content(header, arrays, shared, pack) if layout and sent is not None else None
    described = sent.get(key) if sent is not None and key is not None else None
    if described is None:
        described = _described(header, arrays, shared, pack, layout)
        if sent is not None and key is not None:
            sent.keep(key, described, len(described.frame or b""))
    if layout:
        header.pop("chunks", None)            # (in the layout frame)
        header["layout"] = True
        head = [msgpack.packb(header, use_bin_type=True), described.frame]
    else:
        header.update(described.fields)
        head = [msgpack.packb(header, use_bin_type=True)]
    inline, small = described.inline, described.small
    if small:
        chosen = set(small)
        return [*head, _joined(arrays, small), *(arrays[i] for i in inline if i not in chosen)]
    return [*head, *(arrays[i] for i in inline)]


def _content(header: dict, arrays: Sequence, shared: Sequence | None, pack: bool) -> tuple | None:
    """What a message's layout is made of, as a key (None: not hashable as given)."""
    chunks = header.get("chunks")
    try:
        return (None if chunks is None else tuple(map(tuple, chunks)),
                tuple([(a.dtype, a.shape) for a in arrays]), None if shared is None else tuple(shared), pack)
    except TypeError:
        return None


def _described(header: dict, arrays: Sequence, shared: Sequence | None, pack: bool, layout: bool) -> Described:
    """A message's buffers described: the fields (``bufs``, and ``shm``/``dev``, ``pack``
    where there are any; with ``layout`` also ``chunks``, and the layout frame packed),
    the buffers sent as frames and the small ones among them packed into one."""
    fields: dict = {"bufs": [[_dtype_str(a), list(a.shape)] for a in arrays]}
    inline: list = list(range(len(arrays)))
    if shared and any(place is not None for place in shared):
        segments: dict[str, dict] = {kind: {} for kind in REF_KINDS}
        refs: dict[str, list] = {kind: [None] * len(arrays) for kind in REF_KINDS}
        inline = []
        for i, (a, place) in enumerate(zip(arrays, shared)):
            if place is None:
                inline.append(i)
                continue
            kind = place[2] if len(place) > 2 else "shm"
            if kind not in REF_KINDS:
                raise ValueError(f"unknown kind of reference {kind!r} (known: {', '.join(REF_KINDS)})")
            refs[kind][i] = [segments[kind].setdefault(tuple(place[0]), len(segments[kind])), int(place[1])]
        for kind in REF_KINDS:
            if segments[kind]:
                fields[kind] = {"segs": [list(s) for s in segments[kind]], "refs": refs[kind]}
    small = [i for i in inline if arrays[i].nbytes < PACK_BYTES] if pack else []
    if len(small) < 2:
        small = []
    else:
        fields["pack"] = small
    frame = None
    if layout:
        if "chunks" in header:
            fields["chunks"] = header["chunks"]
        frame = msgpack.packb({name: fields[name] for name in sorted(LAYOUT_FIELDS) if name in fields},
                              use_bin_type=True)
    return Described(fields, inline, small, frame)


def _joined(arrays: Sequence, small: list) -> bytes:
    """The ``small`` arrays in one frame, each at a multiple of PACK_ALIGN bytes."""
    parts: list = []
    offset = 0
    for i in small:
        a = arrays[i]
        pad = -offset % PACK_ALIGN
        if pad:
            parts.append(_PADS[pad])
        parts.append(a)             # (bytes.join takes the C-contiguous array's buffer as it is)
        offset += pad + a.nbytes
    return b"".join(parts)


_STRS: dict = {}      # dtype -> its string (np.dtype(...).str costs ~1 us, on every buffer)


def _dtype_str(a) -> str:
    dtype = a.dtype
    try:
        return _STRS[dtype]
    except (KeyError, TypeError):     # (TypeError: an unhashable dtype-like, left to numpy)
        text = np.dtype(dtype).str
        if len(_STRS) < 64:
            _STRS[dtype] = text
        return text


def _buffer(frame) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    return buf if buf is not None else memoryview(frame)


def decode(frames: Sequence, max_buffer_bytes: int = 1 << 30,
           resolve: Mapping[str, Resolver] | Callable[[dict], Mapping[str, Resolver]] | None = None,
           memo: LayoutMemo[Layout] | None = None) -> tuple[dict, list[np.ndarray]]:
    """Parse one message. Raises ProtocolError naming what is wrong.

    The returned arrays are read-only views on the frames (no copy). A message
    whose header has references of a kind (``shm``, ``dev``) is accepted only when
    ``resolve`` has that kind's resolver, ``resolve[kind](segment, offset, dtype,
    shape)`` (``segment`` a tuple of ints), which returns the referenced array (or
    raises ProtocolError). ``resolve`` may also be a function of the checked header
    that returns them (a receiver whose checks depend on who sent the message).

    ``memo`` (one per sender): a message with a layout frame (``layout``) whose
    bytes, ``src`` and ``op`` are those of an earlier message that decoded is
    decoded from what that one's layout decoded to (kvstore/protocol/layouts.py):
    the same checks passed, the same references resolved to the same arrays."""
    if not frames:
        raise ProtocolError("empty message")
    header = parse_header(_buffer(frames[0]))
    buffer_frames = frames[1:]
    known, key = None, None
    if "layout" in header:
        head = _layout_frame(header, buffer_frames)
        buffer_frames = buffer_frames[1:]
        src = header.get("src")
        if memo is not None and (type(src) is int or src is None):    # (any other src is refused later)
            key = (bytes(head), src, header["op"])
            known = memo.get(key)
        header.update(known.fields if known is not None else _layout_fields(head, header))
        _check_bufs(header)
    bufs = header["bufs"]
    found: dict
    if known is not None:
        found, packed, specs = known.resolved, known.packed, known.specs
    else:
        if callable(resolve):
            resolve = resolve(header)
        found = _references(header, len(bufs), resolve or {})
        packed = _pack_field(header, len(bufs), found)
        specs = buffer_specs(header, max_buffer_bytes)
    inline = len(bufs) - len(found) - len(packed) + (1 if packed else 0)
    if inline != len(buffer_frames):
        raise _error(f"header describes {inline} buffers but {len(buffer_frames)} followed "
                     "(truncated message?)", header)
    arrays: list = []
    resolved: dict = {}
    pending = iter(buffer_frames)
    pack = _buffer(next(pending)) if packed else None
    offset = 0
    for i, (dtype, shape, expected) in enumerate(specs):
        if i in found:
            if known is not None:           # (a layout decoded before: its references' arrays)
                arrays.append(found[i])
                continue
            resolver, segment, offset_ = found[i]
            try:
                resolved[i] = array = resolver(segment, offset_, dtype, shape)
            except ProtocolError as e:
                raise _error(f"buffer {i}: {e}", header) from None
            arrays.append(array)
            continue
        if i in packed:
            assert pack is not None
            offset += -offset % PACK_ALIGN
            if expected >= PACK_BYTES or offset + expected > pack.nbytes:
                raise _error(f"buffer {i} ({expected} bytes) does not fit in the packed frame of "
                             f"{pack.nbytes} bytes", header)
            data = pack[offset:offset + expected]
            offset += expected
        else:
            data = _buffer(next(pending))
            if data.nbytes != expected:
                raise _error(f"buffer {i} has {data.nbytes} bytes; its header says {expected} "
                             f"({dtype.name} x {shape})", header)
        try:
            arrays.append(np.frombuffer(data, dtype=dtype).reshape(shape))
        except ValueError as e:   # e.g. a zero-sized shape whose other dimensions overflow
            raise _error(f"buffer {i}: shape {shape} is unusable: {e}", header) from None
    if pack is not None and offset != pack.nbytes:
        raise _error(f"the packed frame has {pack.nbytes} bytes; its buffers take {offset}", header)
    if key is not None and known is None:
        assert memo is not None
        memo.keep(key, Layout({name: header[name] for name in LAYOUT_FIELDS if name in header},
                              specs, packed, resolved), len(key[0]))
    return header, arrays


def _layout_frame(header: dict, rest: Sequence) -> memoryview:
    """The layout frame of a message whose header says ``layout`` (which must be true,
    with none of the layout's fields in the header itself)."""
    if header["layout"] is not True or not rest:
        raise _error("invalid 'layout': true, with the buffers' fields in the frame after the header", header)
    if any(name in header for name in LAYOUT_FIELDS):
        raise _error("a message with a layout frame has its buffers' fields there, not in the header", header)
    head = _buffer(rest[0])
    if head.nbytes > MAX_HEADER_BYTES:
        raise _error(f"layout frame of {head.nbytes} bytes exceeds the limit of {MAX_HEADER_BYTES}", header)
    return head


def _layout_fields(head, header: dict) -> dict:
    """The checked map of a layout frame: fields of :data:`LAYOUT_FIELDS` only."""
    try:
        fields = msgpack.unpackb(head, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises many unrelated types on garbage
        raise _error(f"layout frame is not valid msgpack: {e}", header) from None
    if not isinstance(fields, dict) or not set(fields) <= LAYOUT_FIELDS:
        raise _error(f"a layout frame is a map of {', '.join(sorted(LAYOUT_FIELDS))} only", header)
    return fields


def _check_bufs(header: dict) -> None:
    bufs = header.get("bufs")
    if not isinstance(bufs, list) or len(bufs) > MAX_BUFFERS:
        raise _error("header has no valid 'bufs' list", header)


def _pack_field(header: dict, count: int, found: dict) -> frozenset:
    """The buffers a checked header says are packed into its first buffer frame
    (``pack``: ascending indices of buffers not passed by reference, two or more)."""
    pack = header.get("pack")
    if pack is None:
        return frozenset()
    if not (isinstance(pack, list) and 2 <= len(pack) <= count
            and all(type(i) is int for i in pack)
            and all(0 <= a < b for a, b in zip(pack, pack[1:])) and pack[-1] < count
            and not any(i in found for i in pack)):
        raise _error("invalid 'pack' field: expected ascending indices of two or more buffers "
                     "that are not passed by reference", header)
    return frozenset(pack)


def parse_header(head) -> dict:
    """The checked header map of a message (``head``: its first frame's bytes):
    our version, an ``op`` string, an integer ``id`` and a ``bufs`` list (unless it
    says ``layout``: then its layout frame has them, see :func:`decode`). Raises
    ProtocolError naming what is wrong."""
    head = memoryview(head)
    if head.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {head.nbytes} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(head, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises many unrelated types on garbage
        raise ProtocolError(f"header is not valid msgpack: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header is a {type(header).__name__}, not a map")
    if type(header.get("v")) is not int or header["v"] != VERSION:
        raise _error(f"protocol version {header.get('v')!r} is not ours ({VERSION}): "
                     "every process of a job must run the same kvstore version", header)
    if not isinstance(header.get("op"), str):
        raise _error("header has no 'op' string", header)
    req_id = header.get("id")
    # nil only in an error reply to a request whose id could not be read
    if (req_id is not None and not isinstance(req_id, int)) or isinstance(req_id, bool) \
            or (req_id is None and header["op"] != ops.ERROR):
        raise _error("header has no integer 'id'", header)
    if "layout" not in header:         # (else its layout frame has them: decode checks them there)
        _check_bufs(header)
    return header


def buffer_specs(header: dict, max_buffer_bytes: int = 1 << 30) -> list[tuple[np.dtype, list, int]]:
    """(dtype, shape, bytes) of each buffer a checked header describes (for a
    reader that receives the buffers into memory of its choosing)."""
    specs = []
    for i, meta in enumerate(header["bufs"]):
        try:
            dtype, shape = _check_meta(i, meta)
        except ProtocolError as e:
            raise _error(str(e), header) from None
        expected = math.prod(shape) * dtype.itemsize
        if expected > max_buffer_bytes:
            raise _error(f"buffer {i} of {expected} bytes exceeds the limit of {max_buffer_bytes}", header)
        specs.append((dtype, shape, expected))
    return specs


def _references(header: dict, count: int, resolve: Mapping[str, Resolver]) -> dict:
    """{buffer index: (resolver, segment, offset)} of the buffers a checked header
    passes by reference, from its fields of each kind: ``{"segs": [[int...]...],
    "refs": [null | [segment, offset], ...]}`` with one ref per buffer. A buffer
    referenced twice, or a kind without a resolver here, is a ProtocolError."""
    found: dict = {}
    for kind in REF_KINDS:
        field = header.get(kind)
        if field is None:
            continue
        resolver = resolve.get(kind)
        if resolver is None:
            what = "shared-memory" if kind == "shm" else "device-memory"
            raise _error(f"{what} buffers ({kind!r} references) are not accepted on this connection",
                         header)
        segs, refs = (field.get("segs"), field.get("refs")) if isinstance(field, dict) else (None, None)
        if not (isinstance(segs, list) and isinstance(refs, list) and len(refs) == count
                and len(segs) <= MAX_BUFFERS
                and all(isinstance(s, list) and len(s) <= MAX_SEGMENT_WORDS
                        and all(type(v) is int for v in s) for s in segs)
                and all(r is None or (isinstance(r, list) and len(r) == 2 and type(r[0]) is int
                                      and 0 <= r[0] < len(segs) and type(r[1]) is int and r[1] >= 0)
                        for r in refs)):
            raise _error(f"invalid {kind!r} field: expected {{segs: [[int...]...], refs: [null or "
                         "[segment, offset]] with one entry per buffer}", header)
        segs = [tuple(s) for s in segs]     # (hashable once per message: resolvers key by segment)
        for i, ref in enumerate(refs):
            if ref is None:
                continue
            if i in found:
                raise _error(f"buffer {i} is referenced by more than one kind of memory", header)
            found[i] = (resolver, segs[ref[0]], ref[1])
    return found


def _error(message: str, header: dict) -> ProtocolError:
    """A ProtocolError that remembers the request id (if the header had a usable
    one), so the server can address its error reply."""
    error = ProtocolError(message)
    rid = header.get("id")
    error.request_id = rid if type(rid) is int else None
    return error


_DIM_LIMIT = 1 << 40
_ALLOWED = {text: np.dtype(text) for text in ALLOWED_DTYPES}     # (np.dtype(str) on every buffer cost ~1 us)


def _check_meta(i: int, meta) -> tuple[np.dtype, list[int]]:
    if not (isinstance(meta, list) and len(meta) == 2 and isinstance(meta[0], str)
            and isinstance(meta[1], list)):
        raise ProtocolError(f"buffer {i}: description must be [dtype, shape]")
    dtype = _ALLOWED.get(meta[0])
    if dtype is None:
        raise ProtocolError(f"buffer {i}: dtype {meta[0]!r} is not allowed")
    shape = meta[1]
    if len(shape) > 32:
        raise ProtocolError(f"buffer {i}: invalid shape {shape!r}")
    for d in shape:       # (a loop: a generator in all() cost more than the rest of the check)
        if not ((type(d) is int or (isinstance(d, int) and not isinstance(d, bool))) and 0 <= d < _DIM_LIMIT):
            raise ProtocolError(f"buffer {i}: invalid shape {shape!r}")
    return dtype, shape


def error_header(req_id, kind: str, message: str) -> dict:
    """Header of an error reply."""
    return {"op": ops.ERROR, "id": req_id, "kind": kind, "message": message}


def chunk_label(chunk) -> str:
    """Human name of a chunk id ``[key, index]`` for error messages."""
    key, index = chunk
    return f"key {key!r} (chunk {index})"
