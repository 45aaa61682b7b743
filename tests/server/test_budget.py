"""kvstore.server.budget on its own: :class:`MemoryBudget` (``KVSTORE_SERVER_MEMORY``),
counted in Python integers before anything is allocated. Pinned from its docstring:
a request past the room left is refused naming what asked, the bytes, the budget and
the setting, and changes nothing; ``holding`` gives its bytes back if the block
raises; no allocation past LARGEST is allowed even without a limit."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidArgumentError
from kvstore.server.budget import LARGEST, MemoryBudget

pytestmark = pytest.mark.timeout(30)


def test_a_request_past_the_room_left_is_refused_naming_it_and_changes_nothing():
    budget = MemoryBudget(4096)
    budget.take(3000, "init of key 'a' (chunk 0)")
    assert budget.room() == 1096
    with pytest.raises(InvalidArgumentError, match=r"^init of key 'b' \(chunk 0\) needs 2,000 bytes \(1.95 KiB\); this server "
                                                   r"holds 3,000 bytes \(2.93 KiB\) of its budget of 4,096 bytes "
                                                   r"\(4 KiB\) \(KVSTORE_SERVER_MEMORY\): the request was refused"):
        budget.take(2000, "init of key 'b' (chunk 0)")
    assert budget.held == 3000
    with pytest.raises(InvalidArgumentError):
        budget.check(1097, "init of key 'b' (chunk 0)")   # one byte past the room
    budget.take(1096, "init of key 'b' (chunk 0)")        # exactly the room fits
    assert budget.room() == 0


def test_holding_gives_the_bytes_back_when_the_allocation_fails():
    budget = MemoryBudget(1 << 20)
    with pytest.raises(MemoryError):
        with budget.holding(1000, "init of key 'w'"):
            assert budget.held == 1000
            raise MemoryError
    assert budget.held == 0
    with budget.holding(1000, "init of key 'w'"):
        pass
    assert budget.held == 1000                             # kept once the allocation is made


def test_no_limit_still_refuses_what_no_allocation_can_hold_and_negative_sizes():
    budget = MemoryBudget(None)
    budget.check(LARGEST, "init_rows of key 'e'")
    with pytest.raises(InvalidArgumentError, match="more than any allocation can hold .* whatever "
                                                   "KVSTORE_SERVER_MEMORY says"):
        budget.check(LARGEST + 1, "init_rows of key 'e'")
    with pytest.raises(InvalidArgumentError, match="a size of -1 bytes is negative"):
        budget.check(-1, "init_rows of key 'e'")


def test_a_restored_checkpoint_is_counted_unchecked_and_the_setting_reads_bytes_or_zero():
    budget = MemoryBudget(100)
    budget.count(500)                                      # what a resume holds already
    assert budget.held == 500 and budget.room() == 0
    assert MemoryBudget.from_setting(0).limit is None and MemoryBudget.from_setting(123).limit == 123
    assert "no memory budget" == MemoryBudget(None).describe()
    with pytest.raises(ValueError, match="KVSTORE_SERVER_MEMORY must be auto or a number of bytes"):
        MemoryBudget.from_setting("lots")
