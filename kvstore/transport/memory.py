"""glibc malloc settings for processes that receive large ZeroMQ frames.

libzmq allocates each incoming frame with malloc. By default glibc serves
allocations above a (dynamic, at most 32 MiB) threshold with a fresh mmap and
returns freed memory at the top of a heap to the kernel once more than twice
that is free, and every I/O thread gets its own arena: so every large message
lands in pages the kernel must fault in and zero again (measured: 3,000-8,000
minor faults and 20-30 % of a worker's CPU per ResNet-50 exchange). Keeping
freed memory in the process (high mmap and trim thresholds, one arena) lets the
next message reuse warm pages. See docs/performance.md for the numbers.

:func:`tune` is called once by a server process and by a worker's store; it is a
no-op where glibc's ``mallopt`` is missing and when ``KVSTORE_MALLOC_TUNING=0``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

_done: set = set()


def tune(single_arena: bool = False) -> bool:
    """Keep freed memory for reuse: mmap threshold 256 MiB, trim threshold 1 GiB and,
    with ``single_arena`` (server processes: one busy thread), one malloc arena.
    Returns whether mallopt accepted the settings."""
    key = ("arena" if single_arena else "plain")
    if key in _done:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, 256 << 20)) and bool(mallopt(M_TRIM_THRESHOLD, 1 << 30))
    if single_arena:
        ok = bool(mallopt(M_ARENA_MAX, 1)) and ok
    if ok:
        _done.add(key)
    else:
        log.debug("mallopt refused the settings")
    return ok
