"""kvstore.rows.rowinit on its own: :class:`RowInit`, seeded initial values of a
row-sparse table computed where the rows live. Pinned from its docstring: each
value is a pure function of (seed, row, column), so a row's values do not depend on
which rows are filled with it, on the server, or on the block size; ``normal`` has
standard deviation ``scale`` and ``uniform`` lies in [-scale, scale); the wire form
reads back; bad arguments are refused naming them."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.errors import InvalidArgumentError
from kvstore.rows import rowinit
from kvstore.rows.rowinit import RowInit

pytestmark = pytest.mark.timeout(30)


def filled(init: RowInit, rows) -> np.ndarray:
    out = np.empty((len(rows),) + init.shape[1:], init.dtype)
    init.fill(out, rows)
    return out


def test_a_rows_values_depend_only_on_the_seed_the_row_and_the_column():
    init = RowInit("normal", 0.5, (1000, 3, 4), seed=7)
    everything = filled(init, range(1000))
    picked = np.array([999, 3, 500], np.int64)
    np.testing.assert_array_equal(filled(init, picked), everything[picked])
    # on two servers (rows r % 2), each computing its own rows alone
    for server in (0, 1):
        mine = np.arange(server, 1000, 2, dtype=np.int64)
        np.testing.assert_array_equal(filled(init, mine), everything[mine])
    assert not np.array_equal(filled(RowInit("normal", 0.5, (1000, 3, 4), seed=8), picked), everything[picked])


def test_the_block_size_does_not_change_the_values(monkeypatch):
    init = RowInit("uniform", 1.0, (50, 30), seed=3)
    whole = filled(init, range(50))
    monkeypatch.setattr(rowinit, "_BLOCK", 7)            # blocks of fewer elements than a row
    np.testing.assert_array_equal(filled(init, range(50)), whole)


def test_normal_and_uniform_have_the_spread_they_promise():
    rows = range(20_000)
    normal = filled(RowInit("normal", 0.1, (20_000, 10), "float64", seed=1), rows)
    # 200,000 samples: the mean and deviation are within 1% of 0.1 (a 10% error fails)
    assert abs(normal.mean()) < 0.001 and abs(normal.std() - 0.1) < 0.001
    uniform = filled(RowInit("uniform", 2.0, (20_000, 10), "float64", seed=1), rows)
    assert uniform.min() >= -2.0 and uniform.max() < 2.0
    assert abs(uniform.std() - 2.0 / np.sqrt(3)) < 0.01           # uniform on [-a, a): a / sqrt(3)
    zeros = np.ones((3, 2), np.float32)
    RowInit("zeros", 1.0, (5, 2)).fill(zeros, [0, 1, 4])
    assert not zeros.any()


def test_the_wire_form_reads_back_and_bad_arguments_are_refused_naming_them():
    init = RowInit("uniform", 0.25, (10, 2), "float16", seed=5)
    assert RowInit.from_wire(init.to_wire()) == init
    for args, fragment in [
        (("gaussian", 1.0, (3,)), "kind must be one of zeros, normal, uniform"),
        (("normal", -1.0, (3,)), "scale must be finite and >= 0"),
        (("normal", float("inf"), (3,)), "scale must be finite"),
        (("normal", 1.0, ()), "shape must be"),
        (("normal", 1.0, (3,), "int32"), "dtype must be a float type"),
        (("normal", 1.0, (3,), "float32", -1), r"seed must be in \[0, 2\*\*63\)"),
    ]:
        with pytest.raises(InvalidArgumentError, match=fragment):
            RowInit(*args)
    with pytest.raises(InvalidArgumentError, match="bad row initializer"):
        RowInit.from_wire({"kind": "normal"})
    with pytest.raises(InvalidArgumentError, match=r"cannot fill 6 values for 2 rows"):
        init.fill(np.empty(6, np.float16), [0, 1])
