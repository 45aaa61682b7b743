"""Dynamic rows (kvstore.DynamicRows) on replicated servers (KVSTORE_REPLICAS=1,
dist_sync) in the state machine: a primary's ``replicate`` requests applied by a
backup's state keep each dynamic table's replica (kvstore.server.dyn_replicas)
equal to the primary's table bit for bit (ids, rows, ``last`` round stamps,
evictions by age and by budget, optimizer state, counters) through rows created,
evicted and a round refused for the budget; a promoted replica applies no round
twice and completes the open one, as the same rounds on a server without a
failover; a replacement's rebuild and a resumed table carry the whole table.
Real ServerStates, driven as the node drives them (the failover of a real job:
tests/faults/test_replicated_dyn.py)."""

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
MINE = np.arange(400, dtype=I64)[owner(np.arange(400, dtype=I64), SERVERS) == 0]   # ids of server 0 of 2
EVICTING = DynamicRows(2, init=("normal", 0.1), seed=3, budget=9, evict_after=2)   # by budget and by age
REFUSING = DynamicRows(2, budget=10, evict=False)                                 # a round past it: refused
D, R = ("d", 0), ("r", 0)
OPTIMIZERS = {"adam": lambda: optimizer.Adam(learning_rate=0.05),
              "sgd-momentum": lambda: optimizer.SGD(learning_rate=0.1, momentum=0.9),
              "none": lambda: None}


def pair(opt, mode="sync"):
    """Server 0 (primary, backed up by server 1) and server 1, and a reference server 0
    that sees the same rounds without a failover; each with its own ``opt()``."""
    primary, backup, reference = (Server(mode=mode, num_workers=W, opt=opt()) for _ in range(3))
    primary.state.replication.backup = 1
    backup.state.replicas.primaries = frozenset({0})
    return primary, backup, reference


def forward(primary: Server, backup: Server, seq=[0]) -> None:
    """Hand what the primary's last event made it replicate to the backup, as the node does."""
    for fields, arrays in primary.state.replication.take():
        header = replicate_request(1000 + seq[0], 0, seq[0], fields)
        seq[0] += 1
        expect_ok(only(backup.state.handle(b"server 0", header, arrays)), b"server 0")


def init(servers, cid, spec: DynamicRows, **fields) -> None:
    for server in servers:
        rid, r = server.send(0, ops.INIT_DYN, chunk=list(cid), servers=SERVERS, spec=spec.to_wire(), **fields)
        expect_ok(only(r), peer(0), rid)


def table(server: Server, cid):
    return server.state.dyn.tables[cid].rows


def replica(backup: Server, cid):
    return backup.state.replicas.dyn.held[0][cid]


def same(a, b) -> None:
    """Two DynTables equal bit for bit in everything that decides what comes next."""
    assert a.snapshot() == b.snapshot() and a.stats() == b.stats()


def rounds_of(rng, n: int):
    """Each worker's pushes of ``n`` rounds: a few ids of server 0 (often the same ones)."""
    out = []
    for _ in range(n):
        out.append([np.unique(rng.choice(MINE[:14], rng.integers(1, 4), replace=False)) for _ in range(W)])
    return out


def push(servers, cid, worker: int, ids, number: int, forward_to=None, data=None):
    data = np.cos(ids[:, None] + np.arange(2) + number).astype(F32) if data is None else data
    replies = []
    for server in servers:
        replies += server.send(worker, ops.PUSH_DYN, chunk=list(cid), arrays=[ids, data], rounds=[number])[1]
        if forward_to is not None and server is forward_to[0]:
            forward(*forward_to)
    return replies


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_replica_equals_the_primarys_table_through_creation_eviction_and_a_refused_round(name):
    primary, backup, _ = pair(OPTIMIZERS[name])
    init([primary], D, EVICTING)
    init([primary], R, REFUSING)
    forward(primary, backup)
    same(replica(backup, D).rows, table(primary, D))
    rng = np.random.default_rng(5)
    refused = 0
    for number, pushes in enumerate(rounds_of(rng, 8), 1):
        # hits and misses (reads are not replicated: the next round carries the counters)
        rid, r = primary.send(0, ops.PULL_DYN, chunk=list(D), arrays=[MINE[:20]])
        expect_ok(only(r), peer(0), rid)
        for cid in (D, R):
            for w, ids in enumerate(pushes):
                ids = MINE[np.arange(number * 3 + w, number * 3 + w + 3)] if cid == R else ids
                for r in push([primary], cid, w, ids, number, forward_to=(primary, backup)):
                    refused += r.header["op"] != ops.OK
        for cid in (D, R):
            same(replica(backup, cid).rows, table(primary, cid))
            assert replica(backup, cid).rounds == number == primary.state.dyn.applied(cid)[0]
    s = table(primary, D).stats()
    assert s["evicted_by_budget"] and s["evicted_by_age"] and s["hits"] and s["misses"], s
    assert refused == 6 * W and table(primary, R).stats()["rows"] == 8      # rounds 3..8 would pass 10 rows


def test_a_promoted_replica_applies_no_round_twice_and_completes_the_open_one():
    primary, backup, reference = pair(OPTIMIZERS["adam"])
    init([primary, reference], D, EVICTING)
    forward(primary, backup)
    rng = np.random.default_rng(9)
    plan = rounds_of(rng, 6)
    for number, pushes in enumerate(plan[:4], 1):
        for w, ids in enumerate(pushes):
            push([primary, reference], D, w, ids, number, forward_to=(primary, backup))
    for w in (0, 1):                      # round 5 opens on the primary: then it dies
        push([primary], D, w, plan[4][w], 5, forward_to=(primary, backup))
    backup.state.promote(0)
    rid, r = backup.send(1, ops.INIT_DYN, chunk=list(D), servers=SERVERS, spec=EVICTING.to_wire(), share=0)
    expect_ok(only(r), peer(1), rid)      # an init sent again: the replica's table stays
    before = table(backup, D).snapshot()
    rid, r = backup.send(2, ops.PUSH_DYN, chunk=list(D), arrays=[plan[3][2], np.ones((len(plan[3][2]), 2), F32)],
                         rounds=[4])
    expect_ok(only(r), peer(2), rid)      # round 4 applied already: answered, not applied again
    assert table(backup, D).snapshot() == before
    for number in (5, 6):
        for w in range(W):
            push([backup, reference], D, w, plan[number - 1][w], number)
    same(table(backup, D), table(reference, D))
    rid, r = backup.send(0, ops.PULL_DYN, chunk=list(D), arrays=[MINE[:10]])
    rid2, r2 = reference.send(0, ops.PULL_DYN, chunk=list(D), arrays=[MINE[:10]])
    assert expect_ok(only(r), peer(0), rid).arrays[0].tobytes() == expect_ok(only(r2), peer(0), rid2).arrays[0].tobytes()
    rid, r = backup.send(0, ops.DYN_STATS, chunk=list(D))
    assert expect_ok(only(r), peer(0), rid).header["stats"]["rounds"] == 6
    rid, r = backup.send(0, ops.PUSH_DYN, chunk=list(D), arrays=[MINE[:1], np.ones((1, 2), F32)], rounds=[9])
    expect_error(only(r), peer(0), rid, "InvalidArgumentError", "push 9", "its next round is 7")
    # a checkpoint saves the promoted table as the dead server's part, never as this one's
    assert [t[:2] for t in backup.state.snapshot({}, share=0)["dyn_tables"]] == [list(D)]
    assert backup.state.snapshot({})["dyn_tables"] == []


def test_a_replacements_rebuild_carries_every_table_and_the_rounds_after_it():
    primary, backup, reference = pair(OPTIMIZERS["sgd-momentum"])
    init([primary, reference], D, EVICTING)
    primary.state.replication.backup = None           # its backup died: nothing replicated
    rng = np.random.default_rng(2)
    plan = rounds_of(rng, 6)
    for number, pushes in enumerate(plan[:3], 1):
        for w, ids in enumerate(pushes):
            push([primary, reference], D, w, ids, number)
    new = Server.__new__(Server)                      # the replacement: never configured by a worker
    new.state, new._ids = ServerState(name="server 2"), iter(range(10 ** 6))
    new.state.replicas.primaries = frozenset({0})
    primary.state.replication.backup = 2
    assert primary.state.rebuild(None) == 1
    forward(primary, new)
    same(replica(new, D).rows, table(primary, D))
    assert replica(new, D).rounds == 3
    for number, pushes in enumerate(plan[3:5], 4):
        for w, ids in enumerate(pushes):
            push([primary, reference], D, w, ids, number, forward_to=(primary, new))
    same(replica(new, D).rows, table(primary, D))
    new.state.promote(0)
    for w in range(W):                                # round 5 sent again: not applied twice
        push([new], D, w, plan[4][w], 5)
    for w in range(W):
        push([new, reference], D, w, plan[5][w], 6)
    same(table(new, D), table(reference, D))


def test_a_resumed_table_reaches_the_replica_with_its_init():
    primary, backup, _ = pair(OPTIMIZERS["adam"])
    init([primary], D, EVICTING)
    for w in range(W):
        push([primary], D, w, MINE[w:w + 3], 1)
    snap = primary.state.snapshot({"step": 1})
    restored, fresh_backup, _ = pair(OPTIMIZERS["adam"])
    restored.state.restore(snap)
    init([restored], D, EVICTING)                     # the resumed job's init: the checkpoint's rows
    forward(restored, fresh_backup)
    same(replica(fresh_backup, D).rows, table(restored, D))
    same(table(restored, D), table(primary, D))

