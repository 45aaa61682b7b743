"""The pure pieces of row-sparse keys: RowSparse, merging gradients, row checks,
the seeded initializer and the row layout over servers (no stores, no sockets)."""

import numpy as np
import pytest
import torch

from kvstore.rows import keys as rowkeys
from kvstore.errors import ArgumentTypeError, InvalidArgumentError
from kvstore.rows.rowinit import RowInit
from kvstore.rows.layout import RowLayout, split
from kvstore.rows.sparse import RowSparse, gradient_rows, merge, unique_rows

pytestmark = pytest.mark.timeout(60)


def test_rowsparse_todense_sums_duplicates_and_keeps_the_family():
    g = RowSparse(np.arange(6, dtype=np.float32).reshape(3, 2), np.array([4, 1, 4]), (5, 2))
    dense = g.todense()
    assert dense.tolist() == [[0, 0], [2, 3], [0, 0], [0, 0], [4, 6]]
    t = RowSparse(torch.ones(1, 2), torch.tensor([2]), (3, 2))
    assert isinstance(t.todense(), torch.Tensor) and t.todense()[2].tolist() == [1, 1]
    z = RowSparse.zeros((7, 3), np.float16)
    assert z.dtype == np.float16 and len(z.indices) == 0 and not z.todense().any()


@pytest.mark.parametrize("data, indices, shape, match", [
    (np.ones((2, 3)), np.array([0, 1]), (4, 2), "does not fit"),
    (np.ones((2, 2)), np.array([0]), (4, 2), "does not fit"),
    (np.ones((1, 2)), np.array([0.5]), (4, 2), "integer"),
    (np.ones((1, 2)), np.array([[0]]), (4, 2), "1-d"),
])
def test_rowsparse_rejects_inconsistent_parts(data, indices, shape, match):
    with pytest.raises(InvalidArgumentError, match=match):
        RowSparse(data, indices, shape)


def test_merge_is_the_union_with_duplicates_summed_in_order():
    a = (np.array([5, 1, 5]), np.array([[1.], [2.], [3.]], np.float32))
    b = (np.array([1, 9]), np.array([[10.], [20.]], np.float32))
    rows, data = merge([a, b], (1,), np.float32)
    assert rows.tolist() == [1, 5, 9] and data[:, 0].tolist() == [12, 4, 20]
    rows, data = merge([(np.zeros(0, np.int64), np.zeros((0, 1), np.float32))], (1,), np.float32)
    assert rows.shape == (0,) and data.shape == (0, 1)
    rows, data = merge([], (2, 2), np.float64)
    assert data.shape == (0, 2, 2) and data.dtype == np.float64


def test_gradient_rows_accepts_rowsparse_torch_coo_and_dense():
    emb = torch.nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([7, 2, 7])).sum().backward()
    rows, data = gradient_rows(emb.weight.grad, (10, 3), np.float32, "key 'e'")
    assert sorted(rows.tolist()) == [2, 7, 7] and data.shape == (3, 3)   # uncoalesced: merge sums
    rows, data = merge([(rows, data)], (3,), np.float32)
    assert rows.tolist() == [2, 7] and data[:, 0].tolist() == [1, 2]
    dense = np.zeros((4, 2), np.float32)
    dense[3, 1] = 5
    rows, data = gradient_rows(dense, (4, 2), np.float32, "key 'e'")
    assert rows.tolist() == [3] and data.tolist() == [[0, 5]]


@pytest.mark.parametrize("value, match", [
    (RowSparse(np.ones((1, 2), np.float32), np.array([4]), (4, 2)), r"key 'e'.*row id 4 is out of range \[0, 4\)"),
    (RowSparse(np.ones((2, 2), np.float32), np.array([1, -3]), (4, 2)), "row id -3"),
    (RowSparse(np.ones((1, 2), np.float64), np.array([1]), (4, 2)), "dtype float64, the key has float32"),
    (RowSparse(np.ones((1, 3), np.float32), np.array([1]), (4, 3)), r"shape \(4, 3\), the key has \(4, 2\)"),
    (np.ones((3, 2), np.float32), r"shape \(3, 2\), the key has \(4, 2\)"),
])
def test_gradient_rows_names_the_key_and_the_first_bad_id(value, match):
    with pytest.raises(InvalidArgumentError, match=match):
        gradient_rows(value, (4, 2), np.float32, "key 'e'")


def test_unique_rows_takes_any_shape_and_order_and_whole_floats_only():
    assert unique_rows(np.array([[3, 1], [3, 0]]), 4, "ids").tolist() == [0, 1, 3]
    assert unique_rows(torch.tensor([2, 2]), 4, "ids").tolist() == [2]
    # MXNet's tests pass float32 ids (mx.nd.array): whole numbers are row ids
    assert unique_rows(np.array([3.0, 1.0, 3.0], np.float32), 4, "ids").tolist() == [1, 3]
    assert unique_rows(torch.tensor([2.0, 0.0]), 4, "ids").tolist() == [0, 2]
    for bad in ([1.5], [np.nan], [np.inf]):
        with pytest.raises(ArgumentTypeError, match=r"ids: row ids must be whole numbers; .* is not"):
            unique_rows(np.array([0.0] + bad), 4, "ids")
    for bad in (4.0, -1.0, 1e30):
        with pytest.raises(InvalidArgumentError, match=r"ids: row id .* is out of range \[0, 4\)"):
            unique_rows(np.array([bad]), 4, "ids")
    with pytest.raises(ArgumentTypeError, match="integers"):
        unique_rows(np.array(["1"]), 4, "ids")


def test_row_initializer_is_a_function_of_seed_row_and_column():
    spec = RowInit("normal", 0.5, (1000, 4, 2), seed=7)
    full = np.empty((1000, 4, 2), np.float32)
    spec.fill(full, np.arange(1000))
    assert abs(full.mean()) < 0.05 and abs(full.std() - 0.5) < 0.05
    for servers in (1, 3):                      # any layout gives the same rows
        for s in range(servers):
            mine = np.arange(s, 1000, servers)
            part = np.empty((len(mine), 4, 2), np.float32)
            spec.fill(part, mine)
            assert np.array_equal(part, full[mine])
    other = np.empty((1000, 4, 2), np.float32)
    RowInit("normal", 0.5, (1000, 4, 2), seed=8).fill(other, np.arange(1000))
    assert not np.array_equal(other, full)
    u = np.empty((1000, 8), np.float64)
    RowInit("uniform", 2.0, (1000, 8)).fill(u, np.arange(1000))
    assert -2 <= u.min() < -1.9 and 1.9 < u.max() < 2
    assert RowInit.from_wire(spec.to_wire()) == spec


@pytest.mark.parametrize("kwargs, match", [
    (dict(kind="xavier", scale=1, shape=(2, 2)), "kind"),
    (dict(kind="normal", scale=-1, shape=(2, 2)), "scale"),
    (dict(kind="normal", scale=1, shape=(2, 2), dtype="int32"), "float"),
    (dict(kind="normal", scale=1, shape=(), dtype="float32"), "shape"),
])
def test_row_initializer_rejects_bad_specs(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        RowInit(**kwargs)


def test_layout_is_round_robin_and_balanced():
    layouts = [RowLayout(10, 3, s, 3) for s in range(3)]
    assert [layout.local_rows for layout in layouts] == [4, 3, 3]
    assert layouts[1].local(np.array([1, 7], np.int64), "k").tolist() == [0, 2]
    with pytest.raises(InvalidArgumentError, match="row id 2 is not one of this server's rows"):
        layouts[1].local(np.array([1, 2], np.int64), "k")
    with pytest.raises(InvalidArgumentError, match="row id 10"):
        layouts[1].local(np.array([10], np.int64), "k")
    rows = np.array([9, 4, 3, 0, 5], np.int64)
    parts = split(rows, 3)
    assert [rows[p].tolist() for p in parts] == [[9, 3, 0], [4], [5]]
    assert RowLayout(2, 1, 2, 3).local_rows == 0


def test_pull_fill_writes_rows_and_zeroes_the_rest_of_a_dense_out():
    rows, data = np.array([1, 3]), np.array([[1., 1.], [3., 3.]], np.float32)
    dense = np.full((4, 2), 9, np.float32)
    rowkeys.fill(dense, rows, data)
    assert dense.tolist() == [[0, 0], [1, 1], [0, 0], [3, 3]]
    out = RowSparse(torch.zeros(0, 2), torch.zeros(0, dtype=torch.int64), (4, 2))
    rowkeys.fill(out, rows, data)
    assert isinstance(out.data, torch.Tensor) and out.indices.tolist() == [1, 3]
    union, wanted = rowkeys.pull_requests([dense, out], [[3, 3, 1], np.array([1])], (4, 2), np.float32, "pull")
    assert union.tolist() == [1, 3] and [w.tolist() for w in wanted] == [[1, 3], [1]]
    with pytest.raises(InvalidArgumentError, match="float32"):
        rowkeys.pull_requests([np.zeros((4, 2))], [[1]], (4, 2), np.float32, "pull")


def test_merge_sums_short_and_long_runs_of_duplicates():
    rng = np.random.default_rng(1)
    rows = np.concatenate([np.full(30, 4), rng.integers(0, 50, 300), np.arange(50, 60)])
    rng.shuffle(rows)
    data = rng.integers(-8, 8, (len(rows), 3)).astype(np.float32)     # exact in float32
    expected = np.zeros((60, 3), np.float32)
    np.add.at(expected, rows, data)
    got_rows, got = merge([(rows[:100], data[:100]), (rows[100:], data[100:])], (3,), np.float32)
    assert got_rows.tolist() == sorted(set(rows.tolist()))
    np.testing.assert_array_equal(got, expected[got_rows])


def test_from_dense_keeps_the_nonzero_rows():
    w = np.zeros((5, 2), np.float32)
    w[[1, 4]] = [[1, 2], [3, 0]]
    g = RowSparse.from_dense(w)
    assert g.indices.tolist() == [1, 4] and g.shape == (5, 2)
    np.testing.assert_array_equal(g.todense(), w)
    assert RowSparse.from_dense(torch.ones(3, 1)).indices.tolist() == [0, 1, 2]
