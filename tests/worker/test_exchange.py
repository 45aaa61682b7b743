"""kvstore.worker.exchange on its own: an :class:`Exchange` over a real
:class:`~kvstore.worker.client.Client` and in-process servers (tests/worker/client_job.py),
made and called the way DistStore does: keys placed by
:class:`kvstore.sharding.Placement`, calls of ``[(KeyInfo, flat)]`` sources and
``[(KeyInfo, [outputs])]`` targets.

What each message carried is read from the client's :class:`kvstore.timeline.Timeline`
(the "request" events of the lanes "to server S": op, server, chunks, bytes), the
public record of every request a worker sent.

Pinned from its docstring: a call's values are cut into their keys' chunks, grouped
by server and sent in messages of about the size each link prefers (small keys
packed together, one message per server; a large key cut into chunks over the
servers, the messages taken round-robin across servers); ``fill`` fills every
output of each key from the replies; errors are raised by the call that waits.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvstore.errors import RemoteError
from kvstore.modes import SYNC
from kvstore.protocol import ops
from kvstore.sharding import Placement
from kvstore.timeline import Timeline
from kvstore.worker.arguments import KeyInfo
from kvstore.worker.exchange import Exchange, Wire, by_server

from client_job import jobs

pytestmark = pytest.mark.timeout(60)

F32 = np.float32


@pytest.fixture
def job(make_cluster):
    yield from jobs(make_cluster)


class Setup:
    """One worker's exchange with ``servers`` servers; every request it sends is traced."""

    def __init__(self, job, tmp_path, servers: int = 2, **settings):
        j = job(1, servers, **settings)
        self.client, self.config = j.clients[0], j.configs[0]
        self.timeline = self.client.timeline = Timeline(str(tmp_path), "worker", 0)
        self.exchange = Exchange(self.client, self.config, SYNC, leads=lambda: True, wire=lambda: Wire())
        self.placement = Placement(servers, self.config.chunk_bytes)
        self._seen = 0

    def key(self, key, shape, dtype=F32) -> KeyInfo:
        size = int(np.prod(shape))
        return KeyInfo(key, tuple(shape), np.dtype(dtype),
                       self.placement.place(key, size, np.dtype(dtype).itemsize))

    def requests(self) -> list[dict]:
        """The requests answered since the last call, in the order they were sent."""
        self.timeline.flush()
        with open(self.timeline.path) as f:
            lines = f.read().splitlines()[1:]                  # after '{"traceEvents":['
        events = [json.loads(line.rstrip(",")) for line in lines if line.strip()]
        sent = sorted((e for e in events if e.get("cat") == "request" and e["name"] != "queued"),
                      key=lambda e: e["ts"])
        new, self._seen = sent[self._seen:], len(sent)
        return [{"op": e["name"], "server": e["args"]["server"], "bytes": e["args"]["bytes"],
                 "chunks": [tuple(c) for c in e["args"].get("chunks", [])]} for e in new]


def test_a_calls_small_keys_are_packed_into_one_message_per_server(job, tmp_path):
    s = Setup(job, tmp_path, servers=2, chunk_bytes=1024, pipeline_bytes=0)
    sizes = {"a": 10, "b": 20, "c": 30, "d": 40, "e": 50, "f": 60}
    infos = [s.key(k, (n,)) for k, n in sizes.items()]
    assert all(len(info.chunks) == 1 for info in infos)         # each smaller than a chunk
    where = {info.key: info.chunks[0].server for info in infos}
    assert set(where.values()) == {0, 1}                          # spread over both servers
    s.exchange.init("init", [(info, np.zeros(info.size, F32)) for info in infos])
    s.requests()
    grads = {info.key: np.arange(info.size, dtype=F32) + 100 * i for i, info in enumerate(infos)}
    outs = {info.key: np.full(info.size, np.nan, F32) for info in infos}
    pending = s.exchange.send(ops.PUSHPULL, "pushpull of 6 keys", [(info, grads[info.key]) for info in infos],
                              [(info, [outs[info.key]]) for info in infos])
    s.exchange.fill(pending)
    sent = s.requests()
    assert sorted(r["server"] for r in sent) == [0, 1]          # one message per server
    for r in sent:
        assert r["op"] == ops.PUSHPULL
        mine = [k for k in sizes if where[k] == r["server"]]      # its keys, in the call's order
        assert r["chunks"] == [(k, 0) for k in mine]
        assert r["bytes"] == 4 * sum(sizes[k] for k in mine)
    for key in sizes:                # one worker, no optimizer: the value is its push
        np.testing.assert_array_equal(outs[key], grads[key])


@pytest.mark.parametrize("pipeline, messages", [
    (1024, [(0, [0]), (1, [1]), (0, [2]), (1, [3])]),    # a chunk a message, round-robin over the servers
    (0, [(0, [0, 2]), (1, [1, 3])]),                     # no cut: one message per server
])
def test_a_large_key_is_cut_into_chunks_over_the_servers_and_messages_of_the_pipeline_size(
        job, tmp_path, pipeline, messages):
    s = Setup(job, tmp_path, servers=2, chunk_bytes=1000, pipeline_bytes=pipeline)
    info = s.key("w", (10, 100))                         # 4000 bytes: 4 chunks of 250 values
    assert [(c.index, c.start, c.stop, c.server) for c in info.chunks] == \
        [(0, 0, 250, 0), (1, 250, 500, 1), (2, 500, 750, 0), (3, 750, 1000, 1)]
    s.exchange.init("init of w", [(info, np.zeros(1000, F32))])
    s.requests()
    grad = np.arange(1000, dtype=F32).reshape(10, 100)
    out = np.full((10, 100), np.nan, F32)
    s.exchange.fill(s.exchange.send(ops.PUSHPULL, "pushpull of w", [(info, grad.reshape(-1))], [(info, [out])]))
    sent = s.requests()
    assert [(r["server"], [index for _, index in r["chunks"]]) for r in sent] == messages
    assert all(r["bytes"] == 1000 * len(r["chunks"]) for r in sent)
    np.testing.assert_array_equal(out, grad)             # the chunks' replies, put back together


def test_fill_writes_a_keys_value_into_every_output_whatever_its_layout(job, tmp_path):
    s = Setup(job, tmp_path, servers=2, chunk_bytes=64)
    info = s.key(7, (6, 5))                               # 120 bytes: two chunks, one per server
    assert {c.server for c in info.chunks} == {0, 1}
    value = np.arange(30, dtype=F32).reshape(6, 5)
    s.exchange.init("init of 7", [(info, value.reshape(-1))])
    plain = np.full((6, 5), np.nan, F32)                  # C-contiguous: replies land in it
    fortran = np.full((6, 5), np.nan, F32, order="F")     # not: filled from a buffer after
    column = np.full((6, 10), np.nan, F32)[:, ::2]        # a strided view
    s.exchange.fill(s.exchange.send(ops.PULL, "pull of 7", None, [(info, [fortran, plain, column])], paced=True))
    for out in (plain, fortran, column):
        np.testing.assert_array_equal(out, value)
    assert [r["op"] for r in s.requests()] == [ops.INIT, ops.INIT, ops.PULL, ops.PULL]


def test_a_push_is_applied_before_a_later_pull_reads_and_a_servers_error_is_raised_by_the_waiting_call(
        job, tmp_path):
    s = Setup(job, tmp_path, servers=2, chunk_bytes=64)
    info = s.key("w", (40,))
    s.exchange.init("init of w", [(info, np.zeros(40, F32))])
    s.exchange.push("push of w", [(info, np.full(40, 3, F32))])
    out = np.full(40, np.nan, F32)
    s.exchange.fill(s.exchange.send(ops.PULL, "pull of w", None, [(info, [out])], paced=True))
    np.testing.assert_array_equal(out, 3)
    never = s.key("never", (4,))                          # placed, never initialised
    pending = s.exchange.send(ops.PUSHPULL, "pushpull of never", [(never, np.ones(4, F32))],
                              [(never, [np.empty(4, F32)])])
    with pytest.raises(RemoteError, match=rf"^pushpull of never: server {never.chunks[0].server} rejected the "
                                          "request: InvalidArgumentError: key 'never'"):
        s.exchange.fill(pending)
    s.exchange.flush("flush")                             # nothing else in flight, nothing raised again


def test_by_server_groups_a_calls_chunks_by_server_as_views_of_the_values():
    placement = Placement(2, chunk_bytes=40)
    big = KeyInfo("big", (25,), np.dtype(F32), placement.place("big", 25, 4))     # 3 chunks
    small = KeyInfo("small", (3,), np.dtype(F32), placement.place("small", 3, 4))
    flats = {"big": np.arange(25, dtype=F32), "small": np.arange(3, dtype=F32)}
    groups = by_server([(big, flats["big"]), (small, flats["small"])])
    for server, (wire_ids, parts) in groups.items():
        infos = [(info, c) for info in (big, small) for c in info.chunks if c.server == server]
        assert wire_ids == [c.wire_id for _, c in infos]
        for (info, c), part in zip(infos, parts):
            np.testing.assert_array_equal(part, flats[info.key][c.start:c.stop])
            assert np.shares_memory(part, flats[info.key])       # views, no copies
    [(_, (_, small_parts))] = [(s, g) for s, g in groups.items() if s == small.chunks[0].server]
    assert any(p is flats["small"] for p in small_parts)         # a key of one chunk goes as it is


def test_a_wire_without_compression_sends_values_as_they_are_and_splits_only_keys_cut_over_servers():
    placement = Placement(2, chunk_bytes=16)
    cut = KeyInfo("cut", (8,), np.dtype(F32), placement.place("cut", 8, 4))
    whole = KeyInfo("whole", (2,), np.dtype(F32), placement.place("whole", 2, 4))
    plain, norms = Wire(), Wire(splits_norms=True)
    parts = [np.ones(2, F32)]
    assert plain.compress([["whole", 0]], parts) is parts and plain.fields() == {}
    assert not plain.layerwise(cut) and not norms.layerwise(whole) and norms.layerwise(cut)
