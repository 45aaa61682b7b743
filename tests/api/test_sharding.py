"""Tests of kvstore.sharding: split() into near-equal chunks and the deterministic,
size-balanced Placement of those chunks on servers."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.sharding import Chunk, Placement, split

FUZZ = settings(max_examples=50, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])

MB = 1 << 20


def check_split(ranges, size, itemsize, chunk_bytes):
    """Every property split() promises, checked from the outside."""
    assert len(ranges) >= 1
    assert ranges[0][0] == 0 and ranges[-1][1] == size
    for (a, b), (c, _) in zip(ranges, ranges[1:]):
        assert b == c, "ranges are not contiguous"
    lengths = [b - a for a, b in ranges]
    assert all(n >= 0 for n in lengths)
    assert sum(lengths) == size
    if itemsize <= chunk_bytes:
        assert all(n * itemsize <= chunk_bytes for n in lengths)
    else:  # one element is bigger than a chunk: one element per chunk
        assert all(n == 1 for n in lengths) or size == 0
    assert max(lengths) - min(lengths) <= 1, "chunks are not near-equal"
    if size > 0:
        assert min(lengths) >= 1, "an empty chunk in a non-empty key"
    # the fewest ranges: one range fewer could not hold everything
    per = max(1, chunk_bytes // itemsize)
    assert len(ranges) == max(1, math.ceil(size / per))
    if len(ranges) > 1:
        assert math.ceil(size / (len(ranges) - 1)) > per


# -- split ------------------------------------------------------------------------------

@pytest.mark.parametrize("size,itemsize,chunk_bytes,expected", [
    (0, 4, 16, [(0, 0)]),
    (1, 4, 16, [(0, 1)]),
    (4, 4, 16, [(0, 4)]),
    (5, 4, 16, [(0, 2), (2, 5)]),
    (10, 4, 16, [(0, 3), (3, 6), (6, 10)]),
    (8, 4, 16, [(0, 4), (4, 8)]),
    (3, 8, 4, [(0, 1), (1, 2), (2, 3)]),      # element bigger than a chunk
    (0, 8, 4, [(0, 0)]),
    (7, 1, 1, [(i, i + 1) for i in range(7)]),
    (10, 4, 17, [(0, 3), (3, 6), (6, 10)]),   # chunk_bytes not a multiple of itemsize
])
def test_split_examples(size, itemsize, chunk_bytes, expected):
    ranges = split(size, itemsize, chunk_bytes)
    assert ranges == expected
    check_split(ranges, size, itemsize, chunk_bytes)


def test_split_big_tensor():
    # fc weight of ResNet-50: 2048 x 1000 fp32 = 8.2 MB in chunks of at most 1 MB
    ranges = split(2_048_000, 4, MB)
    check_split(ranges, 2_048_000, 4, MB)
    assert len(ranges) == 8


@pytest.mark.parametrize("args", [(-1, 4, 16), (4, 0, 16), (4, 4, 0), (4, -4, 16), (4, 4, -1)])
def test_split_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        split(*args)


@FUZZ
@given(st.integers(0, 10**6), st.sampled_from([1, 2, 4, 8, 16]), st.integers(1, 1 << 16))
def test_split_properties(size, itemsize, chunk_bytes):
    if size * itemsize // max(1, chunk_bytes) > 20_000:
        chunk_bytes = size * itemsize // 20_000 + 1  # keep the example cheap
    check_split(split(size, itemsize, chunk_bytes), size, itemsize, chunk_bytes)


# -- Placement --------------------------------------------------------------------------

def loads_of(chunks_by_key, num_servers, itemsize_of):
    """Bytes per server recomputed from the returned chunks (empty chunks count 1 byte,
    as the module documents, so that many empty keys spread out)."""
    load = [0] * num_servers
    for key, chunks in chunks_by_key:
        for c in chunks:
            load[c.server] += max(1, c.size * itemsize_of[key])
    return load


def check_key_chunks(chunks, key, size, itemsize, chunk_bytes, num_servers):
    assert all(isinstance(c, Chunk) for c in chunks)
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert all(c.key == key for c in chunks)
    assert [(c.start, c.stop) for c in chunks] == split(size, itemsize, chunk_bytes)
    assert all(0 <= c.server < num_servers for c in chunks)
    assert all(c.wire_id == [key, c.index] for c in chunks)


def resnet50_like(seed=0):
    """161 fp32 tensors like ResNet-50's: 109 small (biases, BN) and 52 big (conv/fc),
    about 25.5 M values in all, in a random but seeded order."""
    rng = np.random.default_rng(seed)
    small = rng.integers(64, 16_384, size=109)
    big = rng.integers(16_384, 2_400_000, size=52)
    sizes = np.concatenate([small, big])
    rng.shuffle(sizes)
    return [(f"layer{i}.param", int(n)) for i, n in enumerate(sizes)]


def place_all(placement, keys, itemsize=4):
    return [(k, placement.place(k, n, itemsize)) for k, n in keys]


def test_first_chunks_go_to_least_loaded_server_lowest_rank_on_ties():
    p = Placement(num_servers=3, chunk_bytes=100)
    assert [c.server for c in p.place("a", 10, 4)] == [0]   # loads 40 0 0
    assert [c.server for c in p.place("b", 5, 2)] == [1]    # 40 10 0
    assert [c.server for c in p.place("c", 10, 1)] == [2]   # 40 10 10
    assert [c.server for c in p.place("d", 1, 4)] == [1]    # tie 10/10 -> rank 1
    assert p.load == [40, 14, 10]


def test_many_empty_keys_spread_out():
    p = Placement(num_servers=3, chunk_bytes=64)
    servers = [p.place(i, 0, 4)[0].server for i in range(7)]
    assert servers == [0, 1, 2, 0, 1, 2, 0]
    assert all(len(p.place(f"e{i}", 0, 8)) == 1 for i in range(3))


def test_chunk_properties():
    c = Chunk("w", 2, 10, 25, 1)
    assert c.size == 15 and c.wire_id == ["w", 2]
    with pytest.raises(AttributeError):
        c.server = 0  # frozen: a placement cannot be changed behind the store's back


def test_placement_rejects_no_servers():
    with pytest.raises(ValueError):
        Placement(num_servers=0, chunk_bytes=MB)


@pytest.mark.parametrize("num_servers", [1, 2, 3, 4, 7, 16])
def test_deterministic(num_servers):
    keys = resnet50_like(seed=num_servers)
    a = place_all(Placement(num_servers, MB), keys)
    b = place_all(Placement(num_servers, MB), keys)
    assert a == b
    # int keys too, and a different interleaving of the same calls per worker
    pa, pb = Placement(num_servers, 4096), Placement(num_servers, 4096)
    assert [pa.place(i, 1000 * i, 4) for i in range(30)] == [pb.place(i, 1000 * i, 4) for i in range(30)]


@pytest.mark.parametrize("num_servers", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_balanced_for_resnet50_mix(num_servers, seed):
    keys = resnet50_like(seed)
    chunk_bytes = MB
    p = Placement(num_servers, chunk_bytes)
    placed = place_all(p, keys)
    for (k, n), (_, chunks) in zip(keys, placed):
        check_key_chunks(chunks, k, n, 4, chunk_bytes, num_servers)
    load = loads_of(placed, num_servers, {k: 4 for k, _ in keys})
    assert load == p.load
    assert sum(load) == 4 * sum(n for _, n in keys)
    largest = max(c.size * 4 for _, chunks in placed for c in chunks)
    assert largest <= chunk_bytes
    assert max(load) - min(load) <= largest, load
    # and every server got something (MXNet's hash placement can leave one idle)
    assert min(load) > 0


def test_balanced_where_hashing_small_keys_is_not():
    # 100 equal small keys + 4 servers: exactly 25 keys each
    p = Placement(4, MB)
    servers = [p.place(i, 1000, 4)[0].server for i in range(100)]
    assert np.bincount(servers).tolist() == [25, 25, 25, 25]


@pytest.mark.parametrize("num_servers", [2, 3, 4, 8])
def test_big_key_spreads_over_all_servers(num_servers):
    chunk_bytes = 64 * 1024
    p = Placement(num_servers, chunk_bytes)
    size = (chunk_bytes * num_servers) // 4 + 1   # fp32: just over chunk_bytes * S bytes
    chunks = p.place("big", size, 4)
    check_key_chunks(chunks, "big", size, 4, chunk_bytes, num_servers)
    assert len(chunks) == num_servers + 1
    assert {c.server for c in chunks} == set(range(num_servers))


@pytest.mark.parametrize("num_servers", [2, 3, 5])
def test_big_key_spreads_after_other_keys(num_servers):
    chunk_bytes = MB
    p = Placement(num_servers, chunk_bytes)
    place_all(p, resnet50_like(3))
    size = 2 * num_servers * chunk_bytes // 4   # 2S full chunks
    chunks = p.place("huge", size, 4)
    assert len(chunks) == 2 * num_servers
    assert {c.server for c in chunks} == set(range(num_servers))


def test_single_server_takes_everything():
    p = Placement(1, 1000)
    placed = place_all(p, [("a", 10_000), ("b", 0), ("c", 3)])
    assert {c.server for _, chunks in placed for c in chunks} == {0}


# -- properties ---------------------------------------------------------------------------

key_specs = st.lists(
    st.tuples(st.integers(0, 5000), st.sampled_from([1, 2, 4, 8])), min_size=1, max_size=25)


@FUZZ
@given(key_specs, st.integers(1, 8), st.integers(64, 4096), st.booleans())
def test_placement_properties(specs, num_servers, chunk_bytes, str_keys):
    keys = [(f"k{i}" if str_keys else i, size, itemsize) for i, (size, itemsize) in enumerate(specs)]
    p1, p2 = Placement(num_servers, chunk_bytes), Placement(num_servers, chunk_bytes)
    placed = []
    for key, size, itemsize in keys:
        chunks = p1.place(key, size, itemsize)
        assert p2.place(key, size, itemsize) == chunks, "two placements fed the same sequence disagree"
        check_key_chunks(chunks, key, size, itemsize, chunk_bytes, num_servers)
        placed.append((key, chunks))
    itemsizes = {k: i for k, _, i in keys}
    load = loads_of(placed, num_servers, itemsizes)
    assert load == p1.load == p2.load
    largest = max(max(1, c.size * itemsizes[k]) for k, chunks in placed for c in chunks)
    assert max(load) - min(load) <= largest, (load, largest)
    # a key of 2S full chunks now reaches every server whatever came before
    big = p1.place("big", 2 * num_servers * (chunk_bytes // 8), 8)
    assert {c.server for c in big} == set(range(num_servers))


@FUZZ
@given(st.lists(st.integers(1, 300_000), min_size=1, max_size=40), st.integers(1, 6))
def test_balance_bound_on_real_bytes(sizes, num_servers):
    chunk_bytes = 256 * 1024
    p = Placement(num_servers, chunk_bytes)
    per_server = [0] * num_servers
    largest = 0
    for i, n in enumerate(sizes):
        for c in p.place(i, n, 4):
            per_server[c.server] += c.size * 4
            largest = max(largest, c.size * 4)
    assert sum(per_server) == 4 * sum(sizes)
    assert max(per_server) - min(per_server) <= largest
