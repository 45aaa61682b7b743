"""A message's layout, decoded once per sender and content: the fields that describe
its buffers (``bufs``, ``pack``, the references ``shm`` and ``dev``, and ``chunks``),
sent by the reference client in a frame of their own (docs/protocol.md 2.1,
``layout``).

A training step sends the same keys to the same servers every call: the same
chunks, dtypes and shapes, the same slots' references. Decoding them cost a server
about a third of a request (a msgpack list per buffer, each description and
reference checked, each reference resolved to an array: ~2 us a buffer on a
loaded machine). The receiver keeps what a layout decoded to in a
:class:`LayoutMemo` of that sender (one per connection): its fields as checked, each
buffer's description, and the arrays its references resolved to. A later message
whose layout frame has the same bytes, from the same sender (``src``) with the same
op, is decoded from there: it would pass every check the same way (the checks
depend on nothing else; a receiver drops its memos when who may send what changes,
e.g. the job's members, and a server also when keys are initialised, as the stores
forget their call plans then), and its references name the same memory, so they
resolve to the same arrays. Buffers sent as frames are read from the new message as ever.

A memo is bounded (:data:`MAX_LAYOUTS` layouts, :data:`MAX_LAYOUT_BYTES` of their
frames); past that it starts again empty, so a sender that never repeats a layout
costs a receiver that much memory and a dictionary lookup per message.

The fields handed out from a memo are shared by every message of that layout: a
reader may keep them, never change them.

The sender keeps a :class:`LayoutMemo` too: a layout of the same content (the chunks,
each buffer's dtype, shape and reference) as one sent before is not described and
packed again (kvstore.protocol.codec.encode's ``sent``): the same bytes go out, which
is also what lets the receiver's memo find them.

Example::

    sent, memo = LayoutMemo(), LayoutMemo()          # the sender's, the receiver's
    frames = encode(header, arrays, places, layout=True, sent=sent)   # (kvstore.protocol.codec)
    header, arrays = decode(frames, resolve=resolvers, memo=memo)
"""

from __future__ import annotations

from typing import Generic, NamedTuple, TypeVar

# the header fields that describe a message's buffers; the layout frame holds them
LAYOUT_FIELDS = frozenset({"bufs", "pack", "shm", "dev", "chunks"})
MAX_LAYOUTS = 256
MAX_LAYOUT_BYTES = 1 << 20
V = TypeVar("V")


class Layout(NamedTuple):
    """What a layout frame decoded to: its ``fields``; ``specs`` (dtype, shape, bytes)
    per buffer; ``packed``, the buffers packed into the first buffer frame; and
    ``resolved``, {buffer index: the array its reference resolved to}."""
    fields: dict
    specs: list
    packed: frozenset
    resolved: dict


class Described(NamedTuple):
    """What a sender made of a message's buffers (kvstore.protocol.codec.encode):
    ``fields`` (``bufs``, ``shm``/``dev``, ``pack``; with a layout frame also ``chunks``),
    the buffers that travel as frames (``inline``), the small ones among them packed
    into one (``small``), and the packed layout frame (None without one)."""
    fields: dict
    inline: list
    small: list
    frame: bytes | None


class LayoutMemo(Generic[V]):
    """Layouts kept by key, bounded by their number and the bytes of their frames (past
    either it starts again empty). The receiver's: ``key`` (the layout frame's bytes,
    the sender's ``src``, the op) -> :class:`Layout`. The sender's: ``key`` (the chunks,
    each buffer's dtype, shape and reference) -> :class:`Described`."""

    def __init__(self, max_layouts: int = MAX_LAYOUTS, max_bytes: int = MAX_LAYOUT_BYTES):
        self._kept: dict[tuple, V] = {}
        self._bytes = 0
        self._max_layouts, self._max_bytes = max_layouts, max_bytes

    def get(self, key: tuple) -> V | None:
        return self._kept.get(key)

    def keep(self, key: tuple, value: V, size: int) -> None:
        """Keep ``value`` (its layout frame ``size`` bytes) under ``key``."""
        if len(self._kept) >= self._max_layouts or self._bytes + size > self._max_bytes:
            self.clear()
        if size <= self._max_bytes:
            self._kept[key] = value
            self._bytes += size

    def clear(self) -> None:
        self._kept.clear()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._kept)
