"""What a :class:`~kvstore.devices.base.Sharing` would make again for the same
reference: the arrays it opened from peers' references, and the references it
exported for its own arrays. A training step sends the same references every
call (a worker's slots, a server's values), and opening or exporting one costs a
few microseconds of Python per value (the host devices: a shared-memory view and
its device tag, a segment search by address; a GPU: a CuPy array over IPC memory,
a driver query), which for a call of 161 keys was a sixth of a server's time.

- :class:`Opened`: an opened array by its exact reference (device, segment,
  offset, dtype, shape), handed out again as it is. The first open made every
  check a reference gets (the segment is a peer's, the array fits the memory
  mapped): the same reference passes them again, and an opened mapping is never
  unmapped before the sharing closes (which clears this). Opened arrays are
  read-only (a peer's memory is mapped so), so one object serves every reader.
- :class:`Exported`: an exported array's reference by the array object, held by
  a weak reference and checked to be that object, so an array that died and
  another that reuses its id never share an entry.

Both are bounded (:data:`LIMIT` entries; then they start again empty), so a peer
that names ever new references costs memory no more than that.

Example::

    opened = Opened()
    a = opened.get(key) or opened.keep(key, mapper_view(...))
"""

from __future__ import annotations

import weakref
from typing import Any

LIMIT = 8192


class Opened:
    def __init__(self, limit: int = LIMIT):
        self._arrays: dict[tuple, Any] = {}
        self._limit = limit

    def get(self, key: tuple):
        return self._arrays.get(key)

    def keep(self, key: tuple, array):
        if len(self._arrays) >= self._limit:
            self._arrays.clear()
        self._arrays[key] = array
        return array

    def clear(self) -> None:
        self._arrays.clear()

    def __len__(self) -> int:
        return len(self._arrays)


class Exported:
    def __init__(self, limit: int = LIMIT):
        self._places: dict[int, tuple[weakref.ref, tuple]] = {}
        self._limit = limit

    def get(self, a) -> tuple | None:
        entry = self._places.get(id(a))
        return entry[1] if entry is not None and entry[0]() is a else None

    def keep(self, a, place: tuple) -> tuple:
        try:
            ref = weakref.ref(a)
        except TypeError:          # an array type without weak references: not kept
            return place
        if len(self._places) >= self._limit:
            self._places.clear()
        self._places[id(a)] = (ref, place)
        return place

    def clear(self) -> None:
        self._places.clear()

    def __len__(self) -> int:
        return len(self._places)
