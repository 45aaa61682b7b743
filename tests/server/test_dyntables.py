"""kvstore.server.dyntables on its own: :class:`DynTables` built as ``ServerState``
builds it (a ``ChunkTable`` over a ``HostBackend``, the ``Job``, a ``ServerOptimizer``,
``Members`` and a ``MemoryBudget``) and driven through its own interface
(``on_init``, ``on_push``, ``on_pull``, ``on_stats``, ``on_set``, ``snapshot``,
``restore``, ``summary``, ``optimizer_changed``).

Pinned from its docstring: RowTables' rounds over a DynTable (one push from every
worker, merged; pulls and stats wait for the sender's pushes), rows made by pushes
(never assigned), a row id any int64 in [0, 2**63) that hashes to this server; a
round past the budget with eviction off fails for each worker of the round naming
the key, server, budget and count, and changes nothing; so does an optimizer that
is not lazy; the slab and a pull's reply are counted against the server's budget;
a checkpoint carries the tables, restored at the key's init for the same spec only.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import optimizer
from kvstore.errors import InvalidArgumentError, ProtocolError
from kvstore.modes import ASYNC, SSP, SYNC
from kvstore.protocol import ops
from kvstore.rows.dynamic import DynamicRows, owner
from kvstore.server.backend import HostBackend
from kvstore.server.budget import MemoryBudget
from kvstore.server.chunks import ChunkTable
from kvstore.server.dyntables import DynTables
from kvstore.server.members import Members
from kvstore.server.modes import Job
from kvstore.server.server_optimizer import ServerOptimizer

pytestmark = pytest.mark.timeout(30)

KEY, SERVER, SERVERS = "emb", 1, 2
I64, F32 = np.int64, np.float32
IDS = np.arange(64, dtype=I64)
MINE = IDS[owner(IDS, SERVERS) == SERVER]           # ids that hash to server 1 of 2
OTHERS = IDS[owner(IDS, SERVERS) != SERVER]
A, B, C = (int(i) for i in MINE[:3])
_ids = iter(range(1, 1 << 30))


def make(workers: int = 2, mode=SYNC, budget: int | None = None, opt=None) -> DynTables:
    server_opt = ServerOptimizer()
    if opt is not None:
        server_opt.set({"optimizer": opt.to_config()})
    return DynTables(ChunkTable("server 1", HostBackend()), Job(mode, workers), server_opt, Members(),
                     MemoryBudget(budget))


def header(worker: int, **fields) -> dict:
    return {"id": next(_ids), "src": worker, "chunk": [KEY, SERVER], **fields}


def init(tables: DynTables, spec: DynamicRows | None = None) -> DynTables:
    h = header(0, servers=SERVERS, spec=(spec or DynamicRows(2)).to_wire())
    [reply] = tables.on_init(b"w0", h, [])
    assert reply.header == {"op": ops.OK, "id": h["id"]}
    return tables


def push(tables: DynTables, worker: int, ids, rows):
    h = header(worker)
    return h["id"], tables.on_push(b"w%d" % worker, h, [np.array(ids, I64), np.array(rows, F32).reshape(len(ids), 2)])


def pull(tables: DynTables, worker: int, ids):
    h = header(worker)
    return h["id"], tables.on_pull(b"w%d" % worker, h, [np.array(ids, I64)])


def stats(tables: DynTables, worker: int = 0):
    h = header(worker)
    return h["id"], tables.on_stats(b"w%d" % worker, h, [])


def by_id(replies) -> dict:
    out = {r.header["id"]: r for r in replies}
    assert len(out) == len(replies), "two replies to one request"
    return out


def test_rows_are_made_by_a_rounds_pushes_and_pulls_wait_for_their_senders_pushes():
    tables = init(make(workers=2))
    _, [reply] = pull(tables, 1, [A, B])
    assert reply.arrays[0].tolist() == [[0, 0], [0, 0]]             # no rows yet: the initial value
    id0, replies = push(tables, 0, [A, B], [[1, 1], [2, 2]])
    assert replies == []
    idp, replies = pull(tables, 0, [A, B, C])
    ids, replies2 = stats(tables, 0)
    assert replies == [] and replies2 == []                          # both wait for worker 0's push
    id1, replies = push(tables, 1, [B], [[10, 10]])
    by = by_id(replies)
    assert set(by) == {id0, id1, idp, ids}
    assert by[idp].arrays[0].tolist() == [[1, 1], [12, 12], [0, 0]]  # merged: B summed, C has no row
    assert by[ids].header["stats"]["rows"] == 2 and by[ids].header["stats"]["rounds"] == 1
    _, [reply] = stats(tables, 1)
    assert reply.header["stats"]["created"] == 2
    assert tables.table.chunks == {}                                 # no chunk: the rows live in a DynTable
    [line] = tables.summary()
    assert line.startswith("dynamic rows of key 'emb'") and "2 rows, 2 created" in line and "1 rounds" in line


def test_an_id_of_another_server_or_negative_is_refused_naming_it_and_the_rule():
    tables = init(make(workers=1))
    with pytest.raises(InvalidArgumentError, match=rf"row id {int(OTHERS[0])} is not one of this server's rows "
                                                   r"\(server 1 of 2, dynamic rows: ids in \[0, 2\*\*63\) "
                                                   r"placed by splitmix64\(id\) % servers\)"):
        push(tables, 0, [int(OTHERS[0])], [[1, 1]])
    with pytest.raises(ProtocolError, match="row ids must be 1-d int64"):
        tables.on_pull(b"w0", header(0), [np.array([A], np.int32)])
    with pytest.raises(InvalidArgumentError, match="row id -3 is not one of this server's rows"):
        tables.on_push(b"w0", header(0), [np.array([-3], I64), np.ones((1, 2), F32)])
    assert tables.tables[(KEY, SERVER)].rows.stats()["rows"] == 0


def test_dynamic_rows_are_never_assigned_and_other_keys_are_not_dynamic_tables():
    tables = init(make())
    with pytest.raises(InvalidArgumentError, match="key 'emb'.* holds dynamic rows: they are made by pushes, "
                                                   "not assigned"):
        tables.on_set(b"w0", header(0), [np.array([A], I64), np.ones((1, 2), F32)])
    h = header(0)
    h["chunk"] = ["other", SERVER]
    with pytest.raises(InvalidArgumentError, match=r"key 'other'.* holds no dynamic rows on server 1: init the "
                                                   r"key with kvstore.DynamicRows first"):
        tables.on_pull(b"w0", h, [np.array([A], I64)])
    with pytest.raises(InvalidArgumentError, match="is already initialised"):
        init(tables)


def test_ssp_refuses_dynamic_rows_at_init_and_init_carries_no_buffers():
    with pytest.raises(InvalidArgumentError) as e:
        init(make(mode=SSP))
    assert str(e.value) == SSP.no_rows
    tables = make()
    with pytest.raises(ProtocolError, match="init_dyn needs servers .* and carries no buffers"):
        tables.on_init(b"w0", header(0, servers=SERVERS, spec=DynamicRows(2).to_wire()), [np.zeros(1)])
    assert tables.tables == {}


def test_a_round_past_the_budget_with_eviction_off_fails_for_each_worker_and_changes_nothing():
    tables = init(make(workers=2), DynamicRows(2, budget=2, evict=False))
    push(tables, 0, [A], [[1, 1]])
    push(tables, 1, [B], [[2, 2]])
    id0, _ = push(tables, 0, [C], [[3, 3]])
    id1, replies = push(tables, 1, [C], [[3, 3]])
    by = by_id(replies)
    assert set(by) == {id0, id1}
    for reply in by.values():
        assert reply.header["op"] == ops.ERROR and reply.header["kind"] == "InvalidArgumentError"
        message = reply.header["message"]
        for fragment in ("key 'emb' on server 1", "3 rows (2 held + 1 new)", "the budget of 2 rows per server",
                         "DynamicRows(evict=False)", "nothing changed"):
            assert fragment in message, (fragment, message)
    _, [reply] = pull(tables, 0, [A, B, C])
    assert reply.arrays[0].tolist() == [[1, 1], [2, 2], [0, 0]]
    assert tables.tables[(KEY, SERVER)].rows.stats()["rows"] == 2


def test_an_optimizer_that_is_not_lazy_is_refused_for_dynamic_rows_and_a_lazy_one_updates_them():
    tables = init(make(workers=1, mode=ASYNC, opt=optimizer.SGD(learning_rate=1.0, lazy_update=False)))
    with pytest.raises(InvalidArgumentError, match=r"key 'emb'.* holds dynamic rows, which exist only once pushed: "
                                                   r"SGD\(lazy_update=False\) would update every row"):
        push(tables, 0, [A], [[1, 1]])
    assert tables.tables[(KEY, SERVER)].rows.stats()["rows"] == 0
    tables.optimizer.set({"optimizer": optimizer.SGD(learning_rate=0.5).to_config()})
    _, [reply] = push(tables, 0, [A], [[2, 4]])                       # async: applied on arrival
    assert reply.header["op"] == ops.OK
    _, [reply] = pull(tables, 0, [A])
    assert reply.arrays[0].tolist() == [[-1, -2]]                     # 0 - 0.5 * [2, 4]


def test_the_slab_and_a_pulls_reply_are_counted_against_the_servers_budget():
    tables = make(budget=1000)                 # the first slab: 1024 rows x (2 x 4 + 8) bytes
    with pytest.raises(InvalidArgumentError, match=r"dynamic rows of key 'emb'.*on server 1 needs 16,384 "
                                                   r"bytes \(16 KiB\); .*budget of 1,000 bytes \(KVSTORE_SERVER_MEMORY\)"):
        init(tables)
    assert tables.budget.held == 0 and tables.tables == {}            # what it reserved is free again
    tables = init(make(budget=20_000))
    assert tables.budget.held == 1024 * 16
    many = np.repeat(A, 1000)                                         # 1000 ids x 2 x 4 bytes = 8000 bytes
    tables.budget.limit = tables.budget.held + 7999
    with pytest.raises(InvalidArgumentError, match=r"pull_dyn of 1,000 ids of key 'emb'.* \(rows of 2 x float32\) "
                                                   r"needs 8,000 bytes"):
        tables.on_pull(b"w0", header(0), [many])


def test_a_snapshot_restores_at_the_keys_init_for_the_same_spec_only():
    spec = DynamicRows(2, budget=10)
    tables = init(make(workers=1), spec)
    push(tables, 0, [A, C], [[1, 2], [3, 4]])
    saved = tables.snapshot()
    assert [entry[:3] for entry in saved] == [[KEY, SERVER, spec.to_wire()]]
    other = make(workers=1)
    other.restore(saved)
    assert other.snapshot() == saved                                  # waiting for init, still carried
    with pytest.raises(InvalidArgumentError, match=r"the checkpoint holds dynamic rows of \(2,\) float32, budget "
                                                   r"10.*init asks for dynamic rows of \(3,\)"):
        other.on_init(b"w0", header(0, servers=SERVERS, spec=DynamicRows(3, budget=10).to_wire()), [])
    init(other, spec)
    _, [reply] = pull(other, 0, [A, B, C])
    assert reply.arrays[0].tolist() == [[1, 2], [0, 0], [3, 4]]
    assert other.restored == {}


def test_a_new_optimizer_makes_the_rows_state_again_and_new_hyper_parameters_scale_it():
    tables = init(make(workers=1, mode=ASYNC, opt=optimizer.SGD(learning_rate=1.0, momentum=0.5)))
    push(tables, 0, [A], [[1, 1]])
    rows = tables.tables[(KEY, SERVER)].rows
    slab_row = int(rows.slab_rows[0])
    assert rows.state is not None and rows.state[0][slab_row].tolist() == [-1, -1]
    tables.optimizer_changed(fresh=False, scale=2.0)
    assert rows.state[0][slab_row].tolist() == [-2, -2]
    tables.optimizer_changed(fresh=True, scale=1.0)
    assert rows.state is None or not rows.state[0][slab_row].any()
