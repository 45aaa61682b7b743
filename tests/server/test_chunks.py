"""kvstore.server.chunks on its own: :class:`ChunkTable`, the one table of chunks the
server's collaborators share. Pinned from its docstring: an init of several chunks
is checked whole before any changes; a chunk is initialised once; values are copies
in the backend's memory; a restored chunk waits for its init, which keeps the
checkpoint's value if size and dtype match; ``existing`` names what is wrong
(uninitialised, row-sparse, size or dtype)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.errors import InvalidArgumentError
from kvstore.server.backend import HostBackend
from kvstore.server.chunks import ChunkTable
from kvstore.server.rounds import StoredChunk

pytestmark = pytest.mark.timeout(30)

A, B = ("w", 0), ("w", 1)


def test_the_docstring_example():
    table = ChunkTable("server 0", HostBackend())
    table.init([("w", 0)], [np.zeros(4, np.float32)])
    np.testing.assert_array_equal(table.existing([("w", 0)])[0].value, np.zeros(4, np.float32))


def test_init_copies_each_value_flat_into_memory_from_the_backends_allocator():
    sizes = []
    table = ChunkTable("server 0", HostBackend(lambda n, dtype: sizes.append(n) or np.empty(n, dtype)))
    given = np.arange(6, dtype=np.float64).reshape(2, 3)
    table.init([A], [given])
    value = table.chunks[A].value
    assert sizes == [6] and value.shape == (6,) and not np.shares_memory(value, given)
    given[:] = -1
    np.testing.assert_array_equal(value, np.arange(6))


def test_a_chunk_is_initialised_once_and_a_refused_init_changes_nothing():
    table = ChunkTable("server 0", HostBackend())
    table.init([A], [np.ones(2, np.float32)])
    with pytest.raises(InvalidArgumentError, match=r"key 'w' \(chunk 0\) is already initialised"):
        table.init([B, A], [np.zeros(2, np.float32), np.zeros(2, np.float32)])
    assert set(table.chunks) == {A}                           # B was not made either
    np.testing.assert_array_equal(table.chunks[A].value, 1)


def test_a_restored_chunk_keeps_its_value_at_its_init_if_size_and_dtype_match():
    table = ChunkTable("server 0", HostBackend())
    table.restore({A: StoredChunk(np.full(3, 7, np.float32)), B: StoredChunk(np.full(3, 8, np.float32))})
    assert table.restored == {A, B}
    with pytest.raises(InvalidArgumentError, match=r"got 4 x float32, stored is 3 x float32"):
        table.init([A, B], [np.zeros(3, np.float32), np.zeros(4, np.float32)])
    assert table.restored == {A, B}                           # checked whole: nothing confirmed
    table.init([A], [np.zeros(3, np.float32)])
    assert table.restored == {B}
    np.testing.assert_array_equal(table.chunks[A].value, 7)   # the checkpoint's value stays


def test_existing_names_what_is_wrong_with_a_chunk():
    table = ChunkTable("server 3", HostBackend())
    table.init([A, B], [np.zeros(2, np.float32), np.zeros(2, np.float32)])
    table.row_tables.add(B)
    with pytest.raises(InvalidArgumentError, match=r"key 7 \(chunk 0\) is not initialised on server 3; call init"):
        table.existing([A, (7, 0)])
    with pytest.raises(InvalidArgumentError, match="belongs to a row-sparse key: use push with rows"):
        table.existing([B])
    assert table.existing([B], rows_too=True)[0] is table.chunks[B]
    with pytest.raises(InvalidArgumentError, match=r"got 2 x int32, stored is 2 x float32"):
        table.existing([A], [np.zeros(2, np.int32)])
    assert table.existing([A], [np.zeros(2, np.float32)]) == [table.chunks[A]]
