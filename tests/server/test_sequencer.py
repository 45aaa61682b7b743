"""kvstore.server.sequencer on its own: :class:`Sequencer`, delivery order per
connection (pure: headers in, the requests now deliverable out; times from the
caller). Pinned from its docstring: each connection's requests are handled in
``seq`` order exactly once; an early one waits for those before it; a duplicate is
dropped; a request rejected before it was handled uses up its number (``skip``);
unsequenced requests are handled as they come; held requests of a connection that
made no progress for the timeout are dropped (``expire``). The bounds on what is
held are tests/server/test_request_bounds.py's."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.server.budget import MemoryBudget
from kvstore.server.sequencer import Sequencer

pytestmark = pytest.mark.timeout(30)


def req(seq, rid=None, nbytes=0):
    header = {"op": "push", "id": seq if rid is None else rid, "src": 0}
    if seq is not None:
        header["seq"] = seq
    return header, [np.zeros(nbytes, np.uint8)] if nbytes else []


def ids(delivered) -> list:
    return [header["id"] for header, _ in delivered]


def test_requests_in_order_are_delivered_at_once_and_an_early_one_waits_for_the_gap():
    budget = MemoryBudget(None)
    s = Sequencer("server 0", budget)
    assert ids(s.accept(b"c", *req(0, nbytes=8))) == [0]
    assert s.held_bytes() == 0 == budget.held             # delivered at once: nothing held
    assert ids(s.accept(b"c", *req(2, nbytes=16))) == []  # 1 has not come
    assert ids(s.accept(b"c", *req(3, nbytes=32))) == []
    assert s.held_bytes(b"c") == 48 == budget.held
    assert ids(s.accept(b"c", *req(1))) == [1, 2, 3]     # in order, the gap filled
    assert s.held_bytes() == 0 == budget.held             # and their bytes given back
    assert ids(s.accept(b"c", *req(4))) == [4]


def test_each_connection_has_its_own_order():
    s = Sequencer("server 0")
    assert ids(s.accept(b"a", *req(1))) == []
    assert ids(s.accept(b"b", *req(0))) == [0]           # b's 0 is not held back by a's gap
    assert ids(s.accept(b"a", *req(0))) == [0, 1]


def test_a_duplicate_is_dropped_whether_handled_or_still_held():
    s = Sequencer("server 0")
    s.accept(b"c", *req(0))
    assert s.accept(b"c", *req(0, rid=99)) == []
    s.accept(b"c", *req(2))
    assert s.accept(b"c", *req(2, rid=98)) == []
    assert s.duplicates == 2
    assert ids(s.accept(b"c", *req(1))) == [1, 2]         # the first copy of 2, once


def test_unsequenced_requests_are_handled_as_they_come():
    s = Sequencer("server 0")
    s.accept(b"c", *req(1))
    for seq in (None, -1, True, "3"):
        header, arrays = req(None, rid=7)
        if seq is not None:
            header["seq"] = seq
        assert ids(s.accept(b"c", header, arrays)) == [7]


def test_a_rejected_request_uses_up_its_number_so_the_ones_after_it_go_on():
    s = Sequencer("server 0")
    s.accept(b"c", *req(1))
    s.accept(b"c", *req(2))
    assert ids(s.skip(b"c", 0)) == [1, 2]                 # 0 was malformed and answered
    assert s.skip(b"c", 4) == []                          # a later one rejected early: noted
    assert ids(s.accept(b"c", *req(3))) == [3]            # ...and passed over in turn
    assert ids(s.accept(b"c", *req(5))) == [5]
    assert s.skip(b"c", None) == [] and s.skip(b"c", 1) == []


def test_held_requests_are_counted_in_the_budget_and_dropped_after_the_timeout_without_progress():
    budget = MemoryBudget(None)
    s = Sequencer("server 0", budget)
    s.accept(b"c", *req(2, nbytes=100))
    s.accept(b"c", *req(3, nbytes=50))
    assert s.held_bytes(b"c") == 150 == budget.held
    assert s.expire(1000.0, 30.0) == 0                    # first seen holding now
    assert s.expire(1029.0, 30.0) == 0
    assert s.expire(1030.0, 30.0) == 2 and s.expired == 2
    assert s.held_bytes() == 0 == budget.held
    assert ids(s.accept(b"c", *req(0))) == [0]            # still waits for 1: 2 and 3 are gone
    assert ids(s.accept(b"c", *req(1))) == [1]


def test_progress_restarts_the_timeout():
    s = Sequencer("server 0")
    s.accept(b"c", *req(2))
    s.expire(0.0, 10.0)
    s.accept(b"c", *req(0))                              # progress at t=5
    assert s.expire(11.0, 10.0) == 0                      # its age counts from the next look
    assert s.expire(21.0, 10.0) == 1
