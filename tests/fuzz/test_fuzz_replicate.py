"""Every kind of ``replicate`` request (replicated servers, kvstore/server/replication.py)
with every field set to every bad value, sent to a server that does back up the
sender: each must be answered (a typed error, or ok), never raise out of the state
machine, and an error must change no replica. The templates are the requests a real
primary made (an init of a dense key, a row-sparse key and a key of dynamic rows, a
sync round of each): whatever kinds the primary sends, the fuzz covers them.
(test_fuzz_every_op.py sends `replicate` to a server that backs nobody up.)"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import optimizer
from kvstore.protocol import ops
from kvstore.rows.dynamic import DynamicRows
from kvstore.server.replication import replicate_request
from state_driver import Server
from test_fuzz_every_op import BAD, TYPED

F32, I64 = np.float32, np.int64
A = ("w", 0)
ROWS = ["e", 0]
DYN = ["d", 0]


def primary_and_backup() -> tuple[Server, Server, list[tuple[dict, list]]]:
    """Server 0 backed up by server 1 (2 workers, sync, SGD), and every replicate request
    the primary made for an init of each kind of key and one round of each."""
    primary = Server(num_workers=2, opt=optimizer.SGD(learning_rate=0.1, momentum=0.5))
    backup = Server(num_workers=2, opt=optimizer.SGD(learning_rate=0.1, momentum=0.5))
    primary.state.replication.backup = 1
    backup.state.replicas.primaries = frozenset({0})
    sent: list[tuple[dict, list]] = []

    def forward() -> None:
        for fields, arrays in primary.state.replication.take():
            sent.append((fields, arrays))
            header = replicate_request(900 + len(sent), 0, len(sent) - 1, fields)
            replies = backup.state.handle(b"server 0", header, arrays)
            assert [r.header["op"] for r in replies] == [ops.OK], replies

    primary.init({A: np.arange(6, dtype=F32)})
    forward()
    for op, fields, arrays in [
            (ops.INIT_ROWS, {"chunk": ROWS, "shape": [7, 2], "dtype": "float32", "servers": 1, "init": None},
             [np.array([1, 3], I64), np.ones((2, 2), F32)]),
            (ops.INIT_DYN, {"chunk": DYN, "servers": 1, "spec": DynamicRows(2, seed=7).to_wire()}, [])]:
        _, replies = primary.send(0, op, arrays=arrays, **fields)
        assert [r.header["op"] for r in replies] == [ops.OK], replies
        forward()
    for w in range(2):
        primary.send(w, ops.PUSH, [A], [np.full(6, w + 1, F32)], rounds=[1])
        primary.send(w, ops.PUSH_ROWS, arrays=[np.array([1, 5], I64), np.ones((2, 2), F32)], chunk=ROWS,
                     rounds=[1])
        primary.send(w, ops.PUSH_DYN, arrays=[np.array([9, 2 ** 40], I64), np.ones((2, 2), F32)], chunk=DYN,
                     rounds=[1])
        forward()
    return primary, backup, sent


def replicas(backup: Server) -> dict:
    """What the backup holds (values, counts and numbers), comparable across a request."""
    out = {}
    for share, chunks in backup.state.replicas.held.items():
        for cid, entry in chunks.items():
            out[(share, cid)] = (np.array(entry[0], copy=True).tobytes(), entry[1], dict(entry[2]))
    return out


def cases(fields: dict, arrays: list):
    for name in dict.fromkeys([*fields, "kind", "src", "share"]):
        for value in BAD:
            yield f"{name}={value!r:.60}", {**fields, name: value}, arrays
        yield f"without {name}", {k: v for k, v in fields.items() if k != name}, arrays
    for label, bufs in [("no buffers", []), ("an extra buffer", [*arrays, np.zeros(3, F32)]),
                        ("int8 buffers", [np.asarray(a).astype(np.int8) for a in arrays])]:
        yield label, fields, bufs


KINDS = [fields["kind"] for fields, _ in primary_and_backup()[2]]   # the requests' kinds, in order


def test_the_templates_cover_the_kinds_of_rounds_and_inits():
    assert {"init", "dyn_init", "rounds", "row_rounds", "dyn_rounds"} <= set(KINDS), KINDS


@pytest.mark.parametrize("index", range(len(KINDS)), ids=[f"{i}-{k}" for i, k in enumerate(KINDS)])
def test_a_backup_answers_every_bad_field_of_every_replicate_kind(index):
    primary, backup, sent = primary_and_backup()
    fields, arrays = sent[index]
    before = replicas(backup)
    seq = 10_000
    for label, bad, bufs in cases(fields, arrays):
        seq += 1
        header = replicate_request(seq, 0, seq, {k: v for k, v in bad.items()})
        if "src" in bad:
            header["src"] = bad["src"]
        try:
            replies = backup.state.handle(b"server 0", header, list(bufs))
        except Exception as e:   # the node would answer InternalError: a bug
            pytest.fail(f"replicate {fields['kind']} with {label}: {type(e).__name__} escaped: {e}")
        for r in replies:
            assert r.header["op"] in (ops.OK, ops.ERROR), (label, r.header)
            if r.header["op"] == ops.ERROR:
                assert r.header.get("kind") in TYPED, (fields["kind"], label, r.header)
        if replies and all(r.header["op"] == ops.ERROR for r in replies):
            assert replicas(backup) == before, f"replicate {fields['kind']} with {label} was refused but changed a replica"
        else:                    # accepted: start the next case from a fresh pair
            primary, backup, sent = primary_and_backup()
            fields, arrays = sent[index]
            before = replicas(backup)
