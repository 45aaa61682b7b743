"""A server's memory budget (``KVSTORE_SERVER_MEMORY``): how many bytes requests may
make it hold, counted before anything is allocated.

A request declares sizes the server then allocates: an ``init_rows`` shape, an
``init_dyn`` row shape (and the rows its pushes create), the ids of a ``pull_dyn``
(its reply), the values of an ``init``; and early requests wait in the sequencer
(kvstore.server.sequencer) holding their buffers. Each is charged here first, in
Python integers (no shape can wrap), and one that would take the server past its
budget is refused with an :class:`~kvstore.errors.InvalidArgumentError` naming what
asked (the op and the key), the bytes, the budget and the setting: the server
changes nothing and goes on serving. What the budget counts is what a request can
make the server hold for good (values, tables, held requests); a reply built for
one request counts against the room left, and is not kept.

Sums of sync rounds and optimizer state are not counted: they are sized by values
the budget already counted (a few times them at most, e.g. Adam's two states).

Example::

    budget = MemoryBudget(1 << 30)
    with budget.holding(4096, "init of key 'w' (chunk 0)"):
        ...                                   # allocate; an exception gives it back
    budget.check(1 << 40, "pull_dyn of key 'e' (chunk 1)")   # InvalidArgumentError
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

from ..errors import InvalidArgumentError

SETTING = "KVSTORE_SERVER_MEMORY"
LARGEST = sys.maxsize        # no allocation is larger, whatever the budget (numpy's intp)
AUTO_FRACTION = 2            # "auto": half of the memory this process may use
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max",                     # cgroup v2
                  "/sys/fs/cgroup/memory/memory.limit_in_bytes")   # cgroup v1


def physical_memory() -> int | None:
    """Bytes of memory this process may use: the host's, or its cgroup's limit when
    lower; None where neither can be read."""
    try:
        total: int | None = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = None
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():            # "max": no limit
            total = int(text) if total is None else min(total, int(text))
        break
    return total


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n:,} bytes ({n / (1 << shift):.3g} {unit})"
    return f"{n:,} bytes"


class MemoryBudget:
    """At most ``limit`` bytes held (None: no limit, but never one allocation past
    :data:`LARGEST`). ``held`` counts what was taken and not given back."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self.held = 0

    @classmethod
    def from_setting(cls, value: int | str) -> "MemoryBudget":
        """The budget ``KVSTORE_SERVER_MEMORY`` sets: bytes, 0 for no limit, or
        ``auto``: half of :func:`physical_memory` (no limit where it is unknown)."""
        if value == "auto":
            memory = physical_memory()
            return cls(None if memory is None else memory // AUTO_FRACTION)
        if isinstance(value, int):
            return cls(value or None)
        raise ValueError(f"{SETTING} must be auto or a number of bytes, got {value!r}")

    def describe(self) -> str:
        return "no memory budget" if self.limit is None else f"a memory budget of {_size(self.limit)}"

    def room(self) -> int:
        """Bytes that may still be taken."""
        return LARGEST if self.limit is None else max(0, self.limit - self.held)

    def check(self, nbytes: int, what: str) -> None:
        """Raise InvalidArgumentError unless ``nbytes`` (a Python int, any size) fits
        in the room left; ``what`` names the request and its key."""
        if nbytes < 0:
            raise InvalidArgumentError(f"{what}: a size of {nbytes} bytes is negative")
        if nbytes > LARGEST:
            raise InvalidArgumentError(
                f"{what} needs {_size(nbytes)}, more than any allocation can hold ({LARGEST:,} bytes), "
                f"whatever {SETTING} says: the request was refused, nothing changed")
        if nbytes > self.room():
            assert self.limit is not None
            raise InvalidArgumentError(
                f"{what} needs {_size(nbytes)}; this server holds {_size(self.held)} of its budget of "
                f"{_size(self.limit)} ({SETTING}): the request was refused, nothing changed")

    def take(self, nbytes: int, what: str) -> None:
        """Count ``nbytes`` as held, after :meth:`check`."""
        self.check(nbytes, what)
        self.held += nbytes

    def give(self, nbytes: int) -> None:
        """``nbytes`` taken before are free again."""
        self.held = max(0, self.held - nbytes)

    def count(self, nbytes: int) -> None:
        """Count ``nbytes`` the server holds already (a restored checkpoint), unchecked."""
        self.held += max(0, nbytes)

    @contextlib.contextmanager
    def holding(self, nbytes: int, what: str) -> Iterator[None]:
        """Take ``nbytes`` around an allocation; given back if the block raises."""
        self.take(nbytes, what)
        try:
            yield
        except BaseException:
            self.give(nbytes)
            raise
