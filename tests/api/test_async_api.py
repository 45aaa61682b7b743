"""The public async API: pushpull_async / pull_async return a Handle whose wait()
fills the outputs (and raises the call's errors); local stores complete at once."""

import numpy as np
import pytest

import kvstore


def test_local_handles_are_complete_and_wait_twice_is_harmless():
    with kvstore.create("local") as kv:
        kv.init("w", np.zeros(4, np.float32))
        out = np.empty(4, np.float32)
        h = kv.pushpull_async("w", np.ones(4, np.float32), out=out)
        h.wait()
        h.wait()
        assert h.done and (out == 1).all()
        got = np.empty(4, np.float32)
        kv.pull_async("w", out=got).wait()
        assert (got == 1).all()
        with pytest.raises(kvstore.KVStoreError, match="out= is required"):
            kv.pull_async("w")


def test_dist_pulls_and_pushpulls_in_flight_complete_in_any_order(make_cluster):
    def job(kv):
        kv.init(["a", "b"], [np.zeros(3000, np.float32), np.zeros(7, np.float32)])
        oa, ob = np.empty(3000, np.float32), np.empty(7, np.float32)
        ha = kv.pushpull_async("a", np.full(3000, kv.rank + 1.0, np.float32), out=oa)
        hb = kv.pushpull_async("b", np.full(7, 2.0 * (kv.rank + 1), np.float32), out=ob)
        hb.wait()
        ha.wait()
        pa, pb = np.empty(3000, np.float32), np.empty(7, np.float32)
        handles = [kv.pull_async("a", out=pa), kv.pull_async("b", out=pb)]
        for h in reversed(handles):
            h.wait()
        return oa, ob, pa, pb

    for oa, ob, pa, pb in make_cluster(2, 2, chunk_bytes=4096).run(job):
        assert (oa == 3).all() and (ob == 6).all() and (pa == 3).all() and (pb == 6).all()
