"""kvstore.server.members on its own: :class:`Members`, an elastic job's member ranks
as one server knows them (pure: epochs and ranks in, answers out). Each test pins a
sentence of its docstring: epochs only grow and one epoch has one set of members;
members must be ranks; a rank that is not a member is counted from the start of a
new round; only members push, and a refusal says whether the worker left or has not
joined yet; a joiner is active on a chunk from its first push there; without
members every rank is a member and active everywhere."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidArgumentError
from kvstore.server.members import Members

pytestmark = pytest.mark.timeout(30)


def test_without_members_every_rank_is_a_member_and_active_everywhere():
    m = Members()
    assert m.everyone(3) and m.absent(3) == frozenset() and m.active(2, ("w", 0))
    m.refuse(2)                                   # nobody is refused
    assert not m.start(2, ("w", 0))


def test_the_docstring_example():
    m = Members()
    assert m.change(1, frozenset({0, 2}), num_workers=3) == [1]      # worker 1 left
    assert m.change(2, frozenset({0, 1, 2}), num_workers=3) == []    # worker 1 joined again
    assert m.absent(num_workers=3) == frozenset()                     # every rank is a member


def test_epochs_only_grow_and_one_epoch_has_one_set_of_members():
    m = Members()
    assert m.newer(1, frozenset({0, 1}))
    m.change(1, frozenset({0, 1}), 3)
    assert not m.newer(1, frozenset({0, 1})) and not m.newer(0, frozenset({0}))   # seen, or older
    assert m.newer(2, frozenset({0}))
    with pytest.raises(InvalidArgumentError, match="epoch 1 of the elastic job came with two sets of members: "
                                                   "0, 1 and 0"):
        m.newer(1, frozenset({0}))
    with pytest.raises(InvalidArgumentError, match="members must be an integer epoch and worker ranks"):
        m.newer("2", frozenset({0}))
    m.pending = (5, frozenset({1}))               # given before configure: the latest there is
    assert not m.newer(5, frozenset({1})) and m.newer(6, frozenset({1}))


def test_members_must_be_worker_ranks():
    with pytest.raises(InvalidArgumentError, match=r"members 3, 4 of the elastic job are not worker ranks 0..2 "
                                                   r"\(configure said num_workers=3"):
        Members().change(1, frozenset({0, 3, 4}), num_workers=3)


def test_a_rank_that_is_no_member_counts_from_the_start_and_is_refused_naming_why():
    m = Members()
    m.change(1, frozenset({0, 1}), 4)             # the first members: ranks 2, 3 never held
    assert m.absent(4) == frozenset({2, 3}) and not m.everyone(4)
    with pytest.raises(InvalidArgumentError, match=r"worker 3 is not a member of the elastic job \(a worker that "
                                                   r"joins pushes after its first barrier\) \(members 0, 1 at epoch 1\)"):
        m.refuse(3)
    assert m.change(2, frozenset({0}), 4) == [1]
    with pytest.raises(InvalidArgumentError, match="worker 1 is no longer a member of the elastic job: it left "
                                                   r"\(members 0 at epoch 2\)"):
        m.refuse(1)
    m.refuse(0)
    m.refuse("not a rank")                        # malformed senders are refused elsewhere (worker_of)


def test_a_joiner_is_active_on_a_chunk_from_its_first_push_there():
    m = Members()
    m.change(1, frozenset({0}), 2)
    m.change(2, frozenset({0, 1}), 2)             # worker 1 joined
    a, b = ("w", 0), ("w", 1)
    assert m.absent(2) == frozenset() and not m.everyone(2)     # waited for, but not active yet
    assert not m.active(1, a) and m.active(0, a)
    assert m.start(1, a) and not m.start(1, a)    # its first push to a, then not again
    assert m.active(1, a) and not m.active(1, b)
