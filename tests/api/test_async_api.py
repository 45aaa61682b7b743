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


@pytest.mark.parametrize("transport", ["auto", "write-in", "tcp"])
@pytest.mark.parametrize("optimizer", [None, "sgd"])
def test_pushpulls_in_flight_on_one_key_each_get_their_own_rounds_values(make_cluster, transport, optimizer):
    """Several pushpull_async calls on one key before any is waited for: each output
    gets its own round's values. A sync reply may point at the server's value itself
    (shared memory; a data channel's sender reads it after the reply is queued), so
    the worker reads it before its next push of that chunk can change it. Before
    that rule, most of these cases got a later round's values."""
    from kvstore import optimizer as opt
    n = 100_000                      # large: replies by reference (shm) or on the data channel (tcp)
    # write-in: the gradients go straight into the server's sums (write, written)
    cluster = make_cluster(1, 1, **({"write_in_bytes": 4096} if transport == "write-in" else
                                    {"transport": transport, "write_in": False}))

    def job(kv):
        kv.init("w", np.zeros(n, np.float32))
        if optimizer is not None:
            kv.set_optimizer(opt.SGD(learning_rate=1.0))
        outs = [np.empty(n, np.float32) for _ in range(4)]
        calls = [kv.pushpull_async("w", np.full(n, step + 1.0, np.float32), out=out)
                 for step, out in enumerate(outs)]
        for call in calls:
            call.wait()
        return outs
    [outs] = cluster.run(job)
    for step, out in enumerate(outs):
        want = step + 1.0 if optimizer is None else -sum(s + 1.0 for s in range(step + 1))
        np.testing.assert_array_equal(out, want)
