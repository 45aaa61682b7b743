"""The rows a row-sparse push names on a dense key, as they travel to the servers.

MXNet's optimizers update only the rows a row-sparse gradient names
(``lazy_update=True``, the default of SGD, Adam and LARS): weights, weight decay
and state of the other rows stay as they are, also on a dense key. A dense key
lies on the servers in chunks of the flat array, which need not start or end on a
row; its push carries each chunk's values as any dense push does, and, beside them,
which of the chunk's rows the push named: the ``rows`` field of the push's header
(docs/protocol.md), one entry per chunk, ``[width, phase, bits]``: the key's row
width in values, the position within its row of the chunk's first value
(``start % width``), and a bitmap (little-endian bit order) over the rows the chunk
touches, in order. A server takes a round's union and updates those values alone.

Pure functions, used by the worker (:func:`chunk_field`) and the server
(:func:`parse`); a malformed field is a ProtocolError naming the chunk.

Example::

    chunk_field(np.array([1, 4]), width=3, start=2, stop=14)
    # [3, 2, b"\\x12"]: the chunk covers rows 0..4 (from value 2 of row 0), rows 1 and 4 named
    parse([3, 2, b"\\x12"], 12, "chunk (k, 0)")   # values 1..3 and 10..11 of the chunk: True
"""

from __future__ import annotations

import numpy as np

from ..errors import ProtocolError

__all__ = ["chunk_field", "parse", "field_bytes", "MAX_WIDTH"]

MAX_WIDTH = 1 << 48        # a row's values (and a chunk's): far beyond any real table, no int64 overflow


def _rows_of_chunk(width: int, start: int, stop: int) -> tuple[int, int]:
    """(first row, number of rows) that values ``[start, stop)`` of a key touch."""
    if stop <= start:
        return start // width, 0
    first = start // width
    return first, (stop - 1) // width - first + 1


def chunk_field(rows: np.ndarray, width: int, start: int, stop: int) -> list:
    """The ``rows`` entry of the chunk ``[start, stop)`` (in values) of a key whose rows
    are ``width`` values wide, for a push naming the unique sorted ``rows``."""
    first, n = _rows_of_chunk(width, start, stop)
    lo, hi = np.searchsorted(rows, [first, first + n])
    bits = np.zeros(n, bool)
    bits[rows[lo:hi] - first] = True
    return [int(width), int(start % width), np.packbits(bits, bitorder="little").tobytes()]


def field_bytes(width: int, start: int, stop: int) -> int:
    """The size of :func:`chunk_field`'s bitmap for that chunk (the header's budget)."""
    return (_rows_of_chunk(width, start, stop)[1] + 7) // 8


def parse(field, size: int, label: str) -> np.ndarray:
    """The values of a chunk of ``size`` values that a ``rows`` entry names: a bool mask
    of ``size``. Raises ProtocolError, naming ``label``, for a malformed entry."""
    if not (isinstance(field, list) and len(field) == 3 and isinstance(field[2], bytes)
            and all(isinstance(x, int) and not isinstance(x, bool) for x in field[:2])):
        raise ProtocolError(f"{label}: a 'rows' entry must be [width, phase, bitmap bytes], got {field!r:.80}")
    width, phase, bits = field
    if not (1 <= width <= MAX_WIDTH and 0 <= phase < width):
        raise ProtocolError(f"{label}: 'rows' has width {width} and phase {phase}; it needs "
                            f"1 <= width <= {MAX_WIDTH} and 0 <= phase < width")
    _, n = _rows_of_chunk(width, phase, phase + size)
    if len(bits) != (n + 7) // 8:
        raise ProtocolError(f"{label}: 'rows' bitmap has {len(bits)} bytes; {n} rows of width {width} "
                            f"from phase {phase} over {size} values need {(n + 7) // 8}")
    named = np.unpackbits(np.frombuffer(bits, np.uint8), count=n, bitorder="little").astype(bool)
    # values per touched row: the first from its phase, the last cut at the chunk's end
    r = np.arange(n, dtype=np.int64)
    counts = np.clip((r + 1) * width - phase, 0, size) - np.clip(r * width - phase, 0, size)
    return np.repeat(named, counts)
