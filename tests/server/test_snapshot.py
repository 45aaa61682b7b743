"""kvstore.server.snapshot on its own: a server's checkpoint as data. Pinned from its
docstring: ``take`` holds each chunk's value after its last applied round, the
optimizer and each chunk's state, the mode, ranks and meta; ``load`` gives them
back in fresh memory from the allocator it is handed, and sets the optimizer with
its states (both pure functions; the files are kvstore.server.checkpoint's)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import optimizer
from kvstore.server.server_optimizer import ServerOptimizer
from kvstore.server.rounds import StoredChunk
from kvstore.server.snapshot import load, take

pytestmark = pytest.mark.timeout(30)

A, B = ("w", 0), (3, 1)


def test_a_snapshot_taken_then_loaded_gives_back_values_optimizer_and_states():
    server_opt = ServerOptimizer()
    server_opt.set({"optimizer": optimizer.SGD(learning_rate=0.5, momentum=0.9).to_config()})
    chunks = {A: StoredChunk(np.arange(4, dtype=np.float32)), B: StoredChunk(np.array([7, 8], np.float64))}
    for _ in range(2):                                     # two updates of A: a momentum state
        server_opt.updater(A, np.ones(4, np.float32), chunks[A].value)
    snap = take("server 0", "sync", 3, chunks, server_opt, np.asarray, {"epoch": 4})
    assert (snap["server"], snap["mode"], snap["num_workers"], snap["meta"]) == ("server 0", "sync", 3, {"epoch": 4})
    allocated = []

    def alloc(size, dtype):
        allocated.append((size, np.dtype(dtype)))
        return np.empty(size, dtype)

    def upload(host, out):
        np.copyto(out, host)
    fresh = ServerOptimizer()
    restored = load(snap, fresh, alloc, upload)
    assert (restored.mode, restored.num_workers, restored.meta) == ("sync", 3, {"epoch": 4})
    assert sorted(allocated, key=repr) == sorted([(4, np.dtype(np.float32)), (2, np.dtype(np.float64))], key=repr)
    for cid in (A, B):
        got = restored.chunks[cid].value
        assert got.dtype == chunks[cid].value.dtype and not np.shares_memory(got, chunks[cid].value)
        np.testing.assert_array_equal(got, chunks[cid].value)
    assert fresh.config() == server_opt.config()
    before, after = server_opt.updater.get_states(), fresh.updater.get_states()
    assert set(after) == {A} and int(after[A]["t"]) == int(before[A]["t"])
    for x, y in zip(before[A]["state"], after[A]["state"]):
        np.testing.assert_array_equal(x, y)
    # the next update continues from the restored state: the same step as the original's
    server_opt.updater(A, np.ones(4, np.float32), chunks[A].value)
    fresh.updater(A, np.ones(4, np.float32), restored.chunks[A].value)
    np.testing.assert_array_equal(restored.chunks[A].value, chunks[A].value)


def test_a_snapshot_without_an_optimizer_restores_none():
    snap = take("server 1", None, None, {A: StoredChunk(np.zeros(2, np.float32))}, ServerOptimizer(), np.asarray, {})
    fresh = ServerOptimizer()
    restored = load(snap, fresh, lambda n, dtype: np.empty(n, dtype), lambda host, out: np.copyto(out, host))
    assert fresh.updater is None and snap["optimizer"] is None
    assert (restored.mode, restored.num_workers) == (None, None)
    np.testing.assert_array_equal(restored.chunks[A].value, [0, 0])
