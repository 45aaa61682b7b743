"""kvstore.server.stalls on its own: :class:`StallInspector`, with made-up times (it
is pure: ``now`` comes from the caller). Pinned from its docstring: a round that
waited longer than the limit is reported once, naming its key and the missing
workers (and a writer that has not said 'written', or a layer-wise round waiting
for the leader's norms); its age counts from the first call that saw it."""

from __future__ import annotations

import pytest

from kvstore.server.rounds import Round
from kvstore.server.stalls import StallInspector

pytestmark = pytest.mark.timeout(30)

A, B = ("w", 0), (3, 1)


def test_a_round_is_reported_once_after_the_limit_counted_from_when_it_was_first_seen():
    inspector, rnd = StallInspector(), Round(None, {0, 2})
    assert inspector.stalled(100.0, 60.0, [(A, rnd)], 4) == []       # first seen now
    assert inspector.stalled(159.0, 60.0, [(A, rnd)], 4) == []
    assert inspector.stalled(160.0, 60.0, [(A, rnd)], 4) == [
        "key 'w' (chunk 0) has waited 60s for worker(s) 1, 3 to push (worker(s) 0, 2 did)"]
    assert inspector.stalled(500.0, 60.0, [(A, rnd)], 4) == []       # once


def test_a_round_that_completed_is_forgotten_and_a_new_one_counts_from_its_own_start():
    inspector = StallInspector()
    first = Round(None, {0})
    inspector.stalled(0.0, 10.0, [(A, first)], 2)
    inspector.stalled(5.0, 10.0, [], 2)                                # it completed
    second = Round(None, {1})
    assert inspector.stalled(20.0, 10.0, [(A, second)], 2) == []
    assert inspector.stalled(30.0, 10.0, [(A, second)], 2) == [
        "key 'w' (chunk 0) has waited 10s for worker(s) 0 to push (worker(s) 1 did)"]
    inspector.stalled(31.0, 10.0, [], 2)                               # not listed: forgotten
    assert inspector.stalled(35.0, 10.0, [(A, first)], 2) == []        # seen anew: counts from now


def test_the_line_names_a_writer_and_ranks_counted_without_a_push():
    inspector = StallInspector()
    writing = Round(None, {0, 2}, writer=1, filled=frozenset({2}))   # rank 2 is no member
    norms = Round(None, {0, 1, 2}, terms=[1.0, 2.0])
    inspector.stalled(0.0, 1.0, [(A, writing), (B, norms)], 3)
    assert inspector.stalled(2.0, 1.0, [(A, writing), (B, norms)], 3) == [
        "key 'w' (chunk 0) has waited 2s for worker(s) 1 to push (worker(s) 0 did; worker 1 was granted "
        "its sum to write into and has not said 'written')",
        "key 3 (chunk 1) has waited 2s for the key's norms: every worker pushed, and worker 0 (the leader) "
        "has not sent apply_norms"]
