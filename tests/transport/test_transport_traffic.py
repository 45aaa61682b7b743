"""kvstore.transport.traffic on its own: :class:`Traffic`, a worker's bytes by the way
they went (what ``kv.comm_stats()`` reports)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.transport.traffic import Traffic

pytestmark = pytest.mark.timeout(30)


def test_the_docstring_example():
    traffic = Traffic()
    traffic.sent("shm", 4096)
    assert traffic.totals() == (4096, 0)
    assert traffic.by_transport() == {"shm": {"sent": 4096, "received": 0}}


def test_bytes_add_up_per_transport_and_in_total():
    traffic = Traffic()
    traffic.sent("tcp", 100)
    traffic.received("tcp", 30)
    traffic.received("channel", np.int64(1 << 33))          # counted as a Python int
    traffic.sent("tcp", 1)
    assert traffic.totals() == (101, 30 + (1 << 33))
    assert traffic.by_transport() == {"channel": {"sent": 0, "received": 1 << 33},
                                      "tcp": {"sent": 101, "received": 30}}
    assert all(type(n) is int for counts in traffic.by_transport().values() for n in counts.values())
