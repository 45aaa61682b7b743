"""Row-sparse and dynamic tables in dist_async on replicated servers
(KVSTORE_REPLICAS=1) in the state machine: every push the primary applies on
arrival goes to the backup, numbered per (worker, table shard), and the backup
applies it with the same lazy update (dynamic rows: the same DynTable code, so
rows are created and evicted alike), keeping each worker's last push applied. A
promoted replica answers a push sent again without applying it, applies the next
one, and refuses one that skips a number; a replacement's rebuild carries the
numbers; a joiner's numbers start again. Real ServerStates, driven as the node
drives them (a real job: tests/faults/test_replicated_async_rows.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import optimizer
from kvstore.protocol import ops
from kvstore.rows.dynamic import DynamicRows, owner
from kvstore.server.replication import replicate_request
from kvstore.server.state import ServerState
from state_driver import Server, expect_error, expect_ok, only, peer

pytestmark = pytest.mark.timeout(30)

W, SERVERS = 3, 2
I64, F32 = np.int64, np.float32
E, CID = ["e", 1], ("e", 1)           # row table "e" (10 x 3), server 1's shard of 2: rows 1, 3, 5, 7, 9
MINE = np.arange(400, dtype=I64)[owner(np.arange(400, dtype=I64), SERVERS) == 0]   # dynamic ids of server 0 of 2
EVICTING = DynamicRows(2, init=("normal", 0.1), seed=3, budget=6, evict_after=2)   # by budget and by age
D = ("d", 0)


def servers(n: int = 3, opt=lambda: optimizer.Adam(learning_rate=0.05)):
    """Primary 0 (backed up by server 1), its backup, and a reference server that gets
    the same pushes without a failover; dist_async, each with its own ``opt()``."""
    out = [Server(mode="async", num_workers=W, opt=opt()) for _ in range(n)]
    out[0].state.replication.backup = 1
    out[1].state.replicas.primaries = frozenset({0})
    return out


def forward(primary: Server, backup: Server, seq=[0]) -> None:
    """Hand what the primary's last event made it replicate to the backup, as the node does."""
    for fields, arrays in primary.state.replication.take():
        header = replicate_request(1000 + seq[0], 0, seq[0], fields)
        seq[0] += 1
        expect_ok(only(backup.state.handle(b"server 0", header, arrays)), b"server 0")


def init_rows(targets) -> None:
    for server in targets:
        rid, r = server.send(0, ops.INIT_ROWS, arrays=[np.array([1, 5], I64), np.ones(6, F32)], chunk=E,
                             shape=[10, 3], dtype="float32", servers=2,
                             init={"kind": "normal", "scale": 0.1, "shape": [10, 3], "seed": 2, "dtype": "float32"})
        expect_ok(only(r), peer(0), rid)


def init_dyn(targets) -> None:
    for server in targets:
        rid, r = server.send(0, ops.INIT_DYN, chunk=list(D), servers=SERVERS, spec=EVICTING.to_wire())
        expect_ok(only(r), peer(0), rid)


def row_push(rng):
    rows = np.array(sorted({1 + 2 * int(r) for r in rng.integers(0, 5, 2)}), I64)    # this shard's rows
    return rows, rng.standard_normal(3 * len(rows)).astype(F32)


def dyn_push(rng):
    ids = np.unique(rng.choice(MINE[:16], rng.integers(1, 4), replace=False))
    return ids, rng.standard_normal((len(ids), 2)).astype(F32)


def states(server: Server, cid):
    got = server.state.updater.get_states()[cid]
    return int(got["t"]), [np.asarray(a).tobytes() for a in got["state"]]


ORDER = (0, 2, 2, 1, 0, 1, 2, 0)     # any order, several pushes of a worker in a row
KINDS = {"rows": (ops.PUSH_ROWS, E, CID, init_rows, row_push),
         "dynamic": (ops.PUSH_DYN, list(D), D, init_dyn, dyn_push)}


def value(server: Server, kind: str, cid, replica: bool = False):
    """What decides a table's future: the row table's values, or the dynamic table's snapshot and stats."""
    if kind == "rows":
        return (server.state.replicas.held[0][cid][0] if replica else server.state.chunks[cid].value).tobytes()
    rows = server.state.replicas.dyn.held[0][cid].rows if replica else server.state.dyn.tables[cid].rows
    return rows.snapshot(), rows.stats()


@pytest.mark.parametrize("kind", KINDS)
def test_the_replica_follows_every_async_push_and_a_promoted_one_applies_none_twice(kind):
    op, chunk, cid, init, make = KINDS[kind]
    primary, backup, reference = servers()
    init([primary, reference])
    forward(primary, backup)
    rng = np.random.default_rng(7)
    numbers = {w: 0 for w in range(W)}
    sent = []
    for w in ORDER:
        numbers[w] += 1
        rows, data = make(rng)
        sent.append((w, numbers[w], rows, data))
        for server in (primary, reference):
            rid, r = server.send(w, op, chunk=chunk, arrays=[rows, data], rounds=[numbers[w]])
            expect_ok(only(r), peer(w), rid)
        forward(primary, backup)
        assert value(backup, kind, cid, replica=True) == value(primary, kind, cid)
    last = {0: 3, 1: 2, 2: 3}
    if kind == "rows":
        assert backup.state.replicas.held[0][cid][1:3] == [len(ORDER), last]
        assert states(backup, cid) == states(primary, cid)
    else:
        stats = primary.state.dyn.tables[cid].rows.stats()
        assert stats["evicted_by_budget"] and stats["evicted_by_age"], stats      # eviction replicated too
        held = backup.state.replicas.dyn.held[0][cid]
        assert (held.rounds, held.bases) == (len(ORDER), last)
    backup.state.promote(0)
    assert (backup.state.rows if kind == "rows" else backup.state.dyn).applied(cid) == (len(ORDER), last)
    before = value(backup, kind, cid)
    for w, n, rows, data in sent[-4:]:       # their acknowledgements were lost: sent again, not applied
        rid, r = backup.send(w, op, chunk=chunk, arrays=[rows, data], rounds=[n])
        expect_ok(only(r), peer(w), rid)
    assert value(backup, kind, cid) == before
    for w in (1, 0, 1):                      # the next pushes are applied, once each
        numbers[w] += 1
        rows, data = make(rng)
        for server in (backup, reference):
            rid, r = server.send(w, op, chunk=chunk, arrays=[rows, data], rounds=[numbers[w]])
            expect_ok(only(r), peer(w), rid)
    assert value(backup, kind, cid) == value(reference, kind, cid)
    rows, data = make(rng)
    rid, r = backup.send(2, op, chunk=chunk, arrays=[rows, data], rounds=[5])
    expect_error(only(r), peer(2), rid, "InvalidArgumentError", "push 5", "last one applied", "is 3")
    assert value(backup, kind, cid) == value(reference, kind, cid)


@pytest.mark.parametrize("kind", KINDS)
def test_a_replacements_rebuild_carries_each_workers_last_push_and_a_promoted_one_goes_on(kind):
    op, chunk, cid, init, make = KINDS[kind]
    primary, _, reference = servers()
    init([primary, reference])
    primary.state.replication.backup = None            # its backup died: nothing replicated
    rng = np.random.default_rng(3)
    pushes = [(w, n, *make(rng)) for n, w in ((1, 0), (1, 1), (2, 0), (1, 2), (3, 0))]
    for server in (primary, reference):
        for w, n, rows, data in pushes:
            expect_ok(only(server.send(w, op, chunk=chunk, arrays=[rows, data], rounds=[n])[1]), peer(w))
    new = Server.__new__(Server)                      # the replacement: never configured by a worker
    new.state, new._ids = ServerState(name="server 2"), iter(range(10 ** 6))
    new.state.replicas.primaries = frozenset({0})
    primary.state.replication.backup = 2
    primary.state.rebuild(None)
    forward(primary, new)
    assert value(new, kind, cid, replica=True) == value(primary, kind, cid)
    new.state.promote(0)
    for w, n, rows, data in pushes[-2:]:              # sent again: applied already
        expect_ok(only(new.send(w, op, chunk=chunk, arrays=[rows, data], rounds=[n])[1]), peer(w))
    rows, data = make(rng)
    for server in (new, reference):                   # worker 2's push 2: applied
        expect_ok(only(server.send(2, op, chunk=chunk, arrays=[rows, data], rounds=[2])[1]), peer(2))
    assert value(new, kind, cid) == value(reference, kind, cid)


@pytest.mark.parametrize("kind", KINDS)
def test_a_joiners_pushes_are_not_taken_for_its_predecessors_on_the_primary_or_the_replica(kind):
    """Worker 1 pushed twice and left; a new process joins in rank 1 and numbers from 1:
    its pushes are applied, on the primary and on the promoted replica alike."""
    op, chunk, cid, init, make = KINDS[kind]
    primary, backup, reference = servers(opt=lambda: optimizer.SGD(learning_rate=1.0))
    init([primary, reference])
    forward(primary, backup)
    rng = np.random.default_rng(5)
    plan = [make(rng) for _ in range(5)]
    for n in (1, 2):
        for server in (primary, reference):
            server.send(1, op, chunk=chunk, arrays=list(plan[n - 1]), rounds=[n])
        forward(primary, backup)
    for epoch, ranks in ((1, {0, 2}), (2, {0, 1, 2})):       # the new process in rank 1
        for server in (primary, backup, reference):
            assert server.state.set_members(epoch, ranks) == []
    for server in (primary, reference):
        expect_ok(only(server.send(1, op, chunk=chunk, arrays=list(plan[2]), rounds=[1])[1]), peer(1))
    forward(primary, backup)
    assert value(primary, kind, cid) == value(reference, kind, cid)
    backup.state.promote(0)
    backup.send(1, op, chunk=chunk, arrays=list(plan[2]), rounds=[1])      # sent again: applied already
    for server in (backup, reference):
        expect_ok(only(server.send(1, op, chunk=chunk, arrays=list(plan[3]), rounds=[2])[1]), peer(1))
    assert value(backup, kind, cid) == value(reference, kind, cid)
