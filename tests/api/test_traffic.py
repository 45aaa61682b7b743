"""kv.comm_stats() counts the same bytes for one model whatever the transport:
headers plus array bytes, also for gradients that go through shared memory
(staged or written in) and replies that come through a data channel."""

import numpy as np
import pytest

SIZES = (10, 1000, 100000, 300000, 50, 2_000_000)       # small keys, fused; big ones, chunked


def job(kv):
    keys = [f"k{i}" for i in range(len(SIZES))]
    vals = [np.ones(n, np.float32) for n in SIZES]
    kv.init(keys, vals)
    before = kv.comm_stats()
    outs = [np.empty_like(v) for v in vals]
    for _ in range(2):
        kv.pushpull(keys, vals, out=outs)   # written in through shared memory where it can
        kv.push(keys, vals)
        kv.pull(keys, out=outs)
    after = kv.comm_stats()
    return ({k: after[k] - before[k] for k in ("bytes_sent", "bytes_received")},
            set(after["by_transport"]))


@pytest.mark.parametrize("transport, data_channel, kinds", [
    ("tcp", False, {"tcp"}), ("tcp", True, {"tcp", "channel"}), ("ipc", False, {"ipc"}),
    ("shm", False, {"shm"})])
def test_one_model_counts_the_same_bytes_on_every_transport(make_cluster, transport, data_channel, kinds):
    payload = 2 * 2 * sum(SIZES) * 4        # pushpull + push sent, pushpull + pull received, twice
    for (counted, seen) in make_cluster(2, 2, transport=transport, data_channel=data_channel,
                                        chunk_bytes=1 << 20).run(job):
        assert seen == kinds
        for direction in ("bytes_sent", "bytes_received"):
            # headers add a little; nothing of the arrays is missing or counted twice
            assert payload <= counted[direction] <= payload * 1.001, (direction, counted)
