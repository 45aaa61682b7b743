"""kvstore.rows.layout on its own: row ``r`` of a row-sparse table lives on server
``r % S`` at local position ``r // S``; ``split`` gives each server's positions of
a request's rows. Pure functions of (row, S)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.errors import InvalidArgumentError
from kvstore.rows.layout import RowLayout, split

pytestmark = pytest.mark.timeout(30)


def test_the_servers_shares_are_round_robin_and_differ_by_at_most_one_row():
    for rows in (0, 1, 7, 10, 11):
        for servers in (1, 3, 4):
            shares = [RowLayout(rows, 5, s, servers).local_rows for s in range(servers)]
            assert sum(shares) == rows and max(shares) - min(shares) <= 1
            assert shares == [len(range(s, rows, servers)) for s in range(servers)]


def test_local_positions_of_a_servers_rows_and_refusals_naming_the_first_bad_row():
    layout = RowLayout(num_rows=10, width=4, server=1, servers=3)
    np.testing.assert_array_equal(layout.local(np.array([1, 4, 7], np.int64), "pull"), [0, 1, 2])
    with pytest.raises(InvalidArgumentError, match=r"pull: row id 5 is not one of this server's rows "
                                                   r"\(server 1 of 3, table of 10 rows\)"):
        layout.local(np.array([4, 5, 7], np.int64), "pull")
    for bad in (10, -2):
        with pytest.raises(InvalidArgumentError, match=f"row id {bad} is not one"):
            layout.local(np.array([bad], np.int64), "push")
    with pytest.raises(InvalidArgumentError, match=r"row ids must be a 1-d int64 array, got int32\(1,\)"):
        layout.local(np.array([1], np.int32), "push")


def test_split_gives_each_servers_positions_in_the_order_of_the_request():
    rows = np.array([9, 2, 4, 3, 0, 8], np.int64)
    parts = split(rows, 3)
    assert [p.tolist() for p in parts] == [[0, 3, 4], [2], [1, 5]]        # positions, not rows
    for s, p in enumerate(parts):
        assert (rows[p] % 3 == s).all()
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(rows)))
    assert [p.tolist() for p in split(np.array([], np.int64), 2)] == [[], []]
