"""kvstore.server.requests on its own: reading a request's common fields, each
refusal a ProtocolError naming the field, and the plain replies."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.errors import ProtocolError
from kvstore.protocol import ops
from kvstore.server.backend import HostBackend
from kvstore.server.requests import chunk_ids, ok, reply_values, worker_of
from kvstore.server.rounds import StoredChunk

pytestmark = pytest.mark.timeout(30)


def test_ok_answers_the_request_by_id_to_its_peer_with_arrays_and_fields():
    a = np.ones(2)
    reply = ok(b"w1", 9, (a,), modes=["copy"])
    assert reply.peer == b"w1" and reply.header == {"op": ops.OK, "id": 9, "modes": ["copy"]}
    assert reply.arrays == [a] and reply.arrays[0] is a


def test_chunk_ids_are_distinct_key_index_pairs_one_per_buffer():
    assert chunk_ids({"chunks": [["w", 0], [7, 2]]}, None) == [("w", 0), (7, 2)]
    assert chunk_ids({"chunks": [["w", 0]]}, [np.zeros(1)]) == [("w", 0)]
    for header, arrays, fragment in [
        ({"chunks": "w"}, None, "'chunks' must be a list"),
        ({"chunks": [["w", 0, 1]]}, None, "bad chunk id"),
        ({"chunks": [["w", True]]}, None, "bad chunk id"),
        ({"chunks": [[1.5, 0]]}, None, "bad chunk id"),
        ({"chunks": [["w", 0], ["w", 0]]}, None, "a chunk appears twice in one request"),
        ({"chunks": [["w", 0]]}, [], "1 chunks but 0 buffers"),
    ]:
        with pytest.raises(ProtocolError, match=fragment):
            chunk_ids(header, arrays)


def test_worker_of_is_the_senders_rank_among_the_ranks():
    assert worker_of({"src": 2}, 3) == 2
    for src in (3, -1, True, "1", None):
        with pytest.raises(ProtocolError, match=r"'src' must be the sender's worker rank \(0..2\)"):
            worker_of({"src": src}, 3)


def test_reply_values_carries_the_values_only_when_asked_and_copies_only_when_told():
    chunks = [StoredChunk(np.arange(3.0)), StoredChunk(np.arange(2.0))]
    backend = HostBackend()
    views = reply_values(b"w0", 4, backend, chunks, want_values=True, copy=False)
    assert views.header == {"op": ops.OK, "id": 4} and [a is c.value for a, c in zip(views.arrays, chunks)] == [True] * 2
    copies = reply_values(b"w0", 5, backend, chunks, want_values=True, copy=True)
    assert not any(np.shares_memory(a, c.value) for a, c in zip(copies.arrays, chunks))
    np.testing.assert_array_equal(copies.arrays[0], [0, 1, 2])
    assert reply_values(b"w0", 6, backend, chunks, want_values=False, copy=True).arrays == []
