"""Message sizes of pipelined calls to network links (kvstore/transport/pace.py,
``KVSTORE_PIPELINE_BYTES=auto``): the rule in isolation, then a real job over tcp
whose messages follow it."""

from types import SimpleNamespace

import numpy as np
import pytest

from kvstore.sharding import pieces
from kvstore.transport import pace as pace_mod
from kvstore.transport.pace import MAX_BYTES, MIN_BYTES, Pace


def _links(*sizes):
    return [SimpleNamespace(pipeline_bytes=s) for s in sizes]


def test_until_a_call_is_timed_messages_are_the_largest():
    pace = Pace(_links("auto", 1 << 20, 0))
    assert pace.rate is None
    assert pace.limits() == [MAX_BYTES, 1 << 20, 0]   # fixed sizes (and 0: uncut) stay


def test_the_size_is_ten_ms_of_the_fastest_recent_call_within_bounds():
    pace = Pace(_links("auto"))
    pace.observe(100_000_000, 2.0)          # 50 MB/s: 500 kB
    assert pace.limits() == [500_000]
    pace.observe(100_000_000, 4.0)          # a slower call does not shrink it
    assert pace.limits() == [500_000]
    pace.observe(100_000_000, 0.1)          # 1 GB/s: 10 MB, capped
    assert pace.limits() == [MAX_BYTES]
    slow = Pace(_links("auto"))
    slow.observe(10_000_000, 10.0)          # 1 MB/s: 10 kB, raised to the floor
    assert slow.limits() == [MIN_BYTES]


def test_small_calls_and_zero_durations_measure_nothing():
    pace = Pace(_links("auto"))
    pace.observe(pace_mod.MIN_SAMPLE_BYTES - 1, 1.0)
    pace.observe(100_000_000, 0.0)
    assert pace.rate is None and pace.limits() == [MAX_BYTES]


def test_old_calls_are_forgotten():
    pace = Pace(_links("auto"))
    pace.observe(100_000_000, 0.5)          # 200 MB/s
    for _ in range(pace_mod.SAMPLES):
        pace.observe(100_000_000, 2.0)      # 50 MB/s, SAMPLES times
    assert pace.rate == pytest.approx(50e6)


def test_start_counts_only_the_bytes_to_paced_links():
    pace = Pace(_links("auto", 1 << 20, "auto"))
    parts = {0: ([1], [np.zeros(1000, np.float32)]), 1: ([1], [np.zeros(5000, np.float32)]),
             2: ([1, 2], [np.zeros(10, np.float64), np.zeros(5, np.uint8)])}
    assert pace.start(parts, "pushpull").nbytes == 4000 + 80 + 5


def _messages(kv, limit) -> int:
    """How many messages a pushpull of key 0 makes with messages of ``limit`` bytes
    (kvstore.sharding.pieces over the key's chunks)."""
    groups = {}
    for c in kv._keys[0].chunks:
        groups.setdefault(c.server, ([], []))[1].append(np.empty(c.size * 4, np.uint8))
    return len(pieces(groups, [limit] * len(groups)))


def test_a_tcp_job_times_its_calls_and_cuts_messages_to_the_pace(make_cluster):
    """Over tcp with the default (auto): the first pushpull goes in 8 MiB messages;
    once timed, the next is cut into messages of the measured pace, and every sum
    stays exact. With a fixed KVSTORE_PIPELINE_BYTES nothing adapts."""
    n = 6 << 20                                        # 24 MB of float32 per worker

    def job(kv):
        kv.init(0, np.zeros(n, np.float32))
        client, out = kv._client, np.empty(n, np.float32)
        assert client.transports == ["tcp", "tcp"] and client.pace.rate is None
        sent, expected, rates = [], [], []
        for step in range(2):
            seq, limits = sum(client._seq), client.pace.limits()
            assert limits[0] == limits[1]
            kv.pushpull(0, np.full(n, kv.rank + step, np.float32), out=out)
            np.testing.assert_array_equal(out, 1 + 2 * step)
            sent.append(sum(client._seq) - seq)
            expected.append(_messages(kv, limits[0]))
            rates.append(client.pace.rate)
        return sent, expected, rates, limits

    auto = make_cluster(2, 2, transport="tcp", chunk_bytes=256 << 10, timeout=60.0)
    for sent, expected, rates, limits in auto.run(job):
        assert sent == expected and expected[0] == _count(MAX_BYTES)
        assert None not in rates       # both calls were timed; the second used the first's rate
        assert limits[0] == min(MAX_BYTES, max(MIN_BYTES, int(rates[0] * pace_mod.PACE_SECONDS)))
    fixed = make_cluster(2, 2, transport="tcp", chunk_bytes=256 << 10, pipeline_bytes=1 << 20,
                         timeout=60.0)
    for sent, expected, _, limits in fixed.run(job):
        assert limits == [1 << 20, 1 << 20] and sent == expected == [_count(1 << 20)] * 2


def _count(limit: int) -> int:
    """Messages of one pushpull of the test's key: 12 MiB per server in 256 KiB chunks."""
    per_server = 12 << 20
    per_message = limit // (256 << 10) * (256 << 10)
    return 2 * -(-per_server // per_message)


def test_a_waiting_call_keeps_a_window_in_flight_per_server(make_cluster):
    """pushpull (which waits anyway) sends at most WINDOW messages ahead of each
    server's replies; pushpull_async (started from backward hooks: must not block)
    sends everything at once. Both give exact sums."""
    n = 6 << 20

    def job(kv):
        kv.init(0, np.zeros(n, np.float32))
        client, out = kv._client, np.empty(n, np.float32)
        client.pace.observe(100 << 20, 10.0)        # a slow link: 256 KiB messages
        assert client.pace.limits() == [MIN_BYTES, MIN_BYTES]
        request, peaks = client.request, {}

        def counted(server, *args, **kwargs):      # the real request, counted
            got = request(server, *args, **kwargs)
            flying = sum(1 for r in client._pending.values() if r.server == server)
            peaks[server] = max(peaks.get(server, 0), flying)
            return got
        client.request = counted
        try:
            kv.pushpull(0, np.full(n, kv.rank + 1, np.float32), out=out)
            np.testing.assert_array_equal(out, 3)
            windowed, peaks = max(peaks.values()), {}
            per_server = _messages(kv, client.pace.limits()[0]) // 2   # (now at this call's pace)
            kv.pushpull_async(0, np.full(n, kv.rank, np.float32), out=out).wait()
            np.testing.assert_array_equal(out, 1)
            return windowed, max(peaks.values()), per_server
        finally:
            client.request = request

    cluster = make_cluster(2, 2, transport="tcp", chunk_bytes=256 << 10, timeout=60.0)
    for windowed, unwindowed, per_server in cluster.run(job):
        assert windowed <= pace_mod.WINDOW < 48       # 48 messages of 256 KiB per server
        assert unwindowed == per_server
