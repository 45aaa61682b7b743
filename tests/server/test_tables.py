"""kvstore.server.tables on its own: :class:`RowTables` built from the narrow
collaborators its docstring names (a ``ChunkTable`` over a ``HostBackend``, the
``Job``'s mode and ranks, a ``ServerOptimizer``, ``Members`` and a ``MemoryBudget``)
and driven through its own interface (``on_init``, ``on_push``, ``on_pull``,
``on_set``, ``workers_finished``, ``leave``, ``queued_rounds``), with headers as
``ServerState`` hands them over (tests/server/test_server_tables.py drives the same
tables through the whole state machine).

Pinned from its docstring: a table's rows are one chunk of the ChunkTable, marked as
a row table; sync pushes of one round (one from every worker) are merged, duplicates
summed, and assigned without an optimizer (other rows keep their values) or applied
lazily with one; a push is acknowledged when its round is applied and a pull waits
for its sender's pushes; async applies each push on arrival and needs an optimizer;
ssp refuses row-sparse keys at init; set_rows is refused while a round is open; a
finished worker's rounds fail naming it; a worker that left counts with no rows;
init is counted against the budget before anything is allocated; a numbered push
(replicated servers) is applied once.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import optimizer
from kvstore.errors import InvalidArgumentError, ProtocolError
from kvstore.modes import ASYNC, SSP, SYNC
from kvstore.protocol import ops
from kvstore.server.backend import HostBackend
from kvstore.server.budget import MemoryBudget
from kvstore.server.chunks import ChunkTable
from kvstore.server.members import Members
from kvstore.server.modes import Job
from kvstore.server.server_optimizer import ServerOptimizer
from kvstore.server.tables import RowTables

pytestmark = pytest.mark.timeout(30)

KEY, SERVER, SERVERS = "e", 1, 2
CID = (KEY, SERVER)            # server 1 of 2 holds the odd rows 1, 3, 5 of a 7 x 2 table
I64, F32 = np.int64, np.float32
_ids = iter(range(1, 1 << 30))


def make_tables(workers: int = 2, mode=SYNC, budget: int | None = None, opt=None) -> RowTables:
    """RowTables as ServerState makes them, configured for ``workers`` in ``mode``."""
    table = ChunkTable("server 1", HostBackend())
    server_opt = ServerOptimizer()
    if opt is not None:
        server_opt.set({"optimizer": opt.to_config()})
    return RowTables(table, Job(mode, workers), server_opt, Members(), MemoryBudget(budget))


def header(worker: int, **fields) -> dict:
    return {"id": next(_ids), "src": worker, "chunk": [KEY, SERVER], **fields}


def init(tables: RowTables, rows=(1, 3, 5), values=((0, 1), (2, 3), (4, 5)), shape=(7, 2), dtype="float32"):
    h = header(0, shape=list(shape), dtype=dtype, servers=SERVERS, init=None)
    arrays = [np.array(rows, I64), np.array(values, np.dtype(dtype)).reshape(len(rows), -1)]
    [reply] = tables.on_init(b"w0", h, arrays)
    assert reply.header == {"op": ops.OK, "id": h["id"]}
    return tables


def push(tables: RowTables, worker: int, rows, values, **fields):
    h = header(worker, **fields)
    return h["id"], tables.on_push(b"w%d" % worker, h, [np.array(rows, I64), np.array(values, F32)])


def pull(tables: RowTables, worker: int, rows):
    h = header(worker)
    return h["id"], tables.on_pull(b"w%d" % worker, h, [np.array(rows, I64)])


def weights(tables: RowTables) -> list:
    return tables.table.chunks[CID].value.reshape(-1, 2).tolist()


def by_id(replies) -> dict:
    out = {r.header["id"]: r for r in replies}
    assert len(out) == len(replies), "two replies to one request"
    return out


def refused(reply, *fragments):
    assert reply.header["op"] == ops.ERROR, reply.header
    for f in fragments:
        assert f in reply.header["message"], (f, reply.header["message"])


# -- init -------------------------------------------------------------------------------------
def test_init_makes_one_chunk_of_this_servers_rows_marked_as_a_row_table():
    tables = init(make_tables())
    assert CID in tables.table.row_tables and CID in tables.tables
    assert weights(tables) == [[0, 1], [2, 3], [4, 5]]         # local rows 0, 1, 2 = global 1, 3, 5
    with pytest.raises(InvalidArgumentError, match=r"key 'e'.* is already initialised"):
        init(tables)


def test_init_without_some_rows_leaves_them_zero_and_refuses_rows_of_other_servers():
    tables = init(make_tables(), rows=[3], values=[[7, 8]])
    assert weights(tables) == [[0, 0], [7, 8], [0, 0]]
    other = make_tables()
    with pytest.raises(InvalidArgumentError, match="row id 2 is not one of this server's rows"):
        init(other, rows=[2], values=[[1, 1]])
    assert CID not in other.table.chunks and CID not in other.tables


def test_ssp_refuses_row_sparse_keys_at_init_saying_why():
    tables = make_tables(mode=SSP)
    with pytest.raises(InvalidArgumentError) as e:
        init(tables)
    assert str(e.value) == SSP.no_rows and "ssp" in str(e.value)
    assert not tables.tables


@pytest.mark.parametrize("fields, fragment", [
    ({"shape": []}, "init_rows needs shape"),
    ({"shape": [7, -2]}, "init_rows needs shape"),
    ({"servers": 1}, "init_rows needs shape"),                 # server 1 of 1 does not exist
    ({"dtype": "object"}, "dtype 'object' is not one of the wire's numeric dtypes"),
    ({"dtype": "U4"}, "dtype 'U4' is not one of the wire's numeric dtypes"),
])
def test_init_refuses_a_declaration_the_wire_cannot_hold(fields, fragment):
    tables = make_tables()
    h = header(0, **{"shape": [7, 2], "dtype": "float32", "servers": SERVERS, "init": None, **fields})
    with pytest.raises(ProtocolError, match=fragment):
        tables.on_init(b"w0", h, [np.zeros(0, I64), np.zeros(0, F32)])
    assert not tables.tables


def test_init_is_counted_against_the_budget_before_anything_is_allocated():
    tables = make_tables(budget=16)                          # 3 rows x 2 x 4 bytes = 24 bytes
    with pytest.raises(InvalidArgumentError, match=r"init_rows of key 'e'.*server 1.*needs 24 bytes; .*budget of 16 bytes \(KVSTORE_SERVER_MEMORY\)"):
        init(tables)
    assert tables.budget.held == 0 and CID not in tables.table.chunks
    init(make_tables(budget=24))


# -- sync rounds -------------------------------------------------------------------------------
def test_a_round_merges_every_workers_rows_and_assigns_the_sums_without_an_optimizer():
    tables = init(make_tables(workers=2))
    id0, replies = push(tables, 0, [1, 5], [[1, 1], [5, 5]])
    assert replies == []                                      # waits for worker 1
    [(cid, rnd)] = list(tables.queued_rounds())
    assert cid == CID and rnd.workers == {0}
    idp, replies = pull(tables, 0, [1, 3, 5])
    assert replies == []                                      # worker 0 has a push pending here
    idq, replies = pull(tables, 1, [5])
    assert [r.arrays[0].tolist() for r in replies] == [[[4, 5]]]   # worker 1 has none: the old value
    assert replies[0].header["id"] == idq
    id1, replies = push(tables, 1, [5], [[10, 10]])
    by = by_id(replies)
    assert set(by) == {id0, id1, idp}
    assert by[id0].header == {"op": ops.OK, "id": id0} and by[id0].peer == b"w0"
    assert by[id1].peer == b"w1"
    # the merged rows: 1 -> worker 0's, 5 -> both summed; row 3 keeps its value
    assert by[idp].arrays[0].tolist() == [[1, 1], [2, 3], [15, 15]]
    assert list(tables.queued_rounds()) == []


def test_a_worker_that_pushes_again_starts_the_next_round():
    tables = init(make_tables(workers=2))
    push(tables, 0, [1], [[1, 1]])
    push(tables, 0, [1], [[100, 100]])
    assert [r.workers for _, r in tables.queued_rounds()] == [{0}, {0}]
    _, replies = push(tables, 1, [3], [[3, 3]])
    assert len(replies) == 2 and weights(tables) == [[1, 1], [3, 3], [4, 5]]
    _, replies = push(tables, 1, [], np.zeros((0, 2)))        # an empty push still counts
    assert len(replies) == 2 and weights(tables) == [[100, 100], [3, 3], [4, 5]]


def test_with_an_optimizer_a_round_updates_only_its_merged_rows():
    tables = init(make_tables(workers=2, opt=optimizer.SGD(learning_rate=0.5)))
    push(tables, 0, [3], [[2, 2]])
    _, replies = push(tables, 1, [3], [[2, 4]])
    assert len(replies) == 2
    assert weights(tables) == [[0, 1], [0, 0], [4, 5]]        # row 3: [2, 3] - 0.5 * [4, 6]


def test_a_push_of_badly_formed_rows_is_refused_and_opens_no_round():
    tables = init(make_tables())
    with pytest.raises(ProtocolError, match="row ids must be unique and sorted"):
        push(tables, 0, [5, 1], [[1, 1], [1, 1]])
    with pytest.raises(InvalidArgumentError, match="2 row ids with 2 x float32; each row holds 2 x float32"):
        push(tables, 0, [1, 3], [[1, 1]])
    with pytest.raises(InvalidArgumentError, match="row id 4 is not one of this server's rows"):
        push(tables, 0, [4], [[1, 1]])
    with pytest.raises(ProtocolError, match="'src' must be the sender's worker rank"):
        push(tables, 2, [1], [[1, 1]])
    assert list(tables.queued_rounds()) == []


def test_ops_on_a_key_without_rows_here_name_the_key_and_say_what_to_do():
    tables = make_tables()
    with pytest.raises(InvalidArgumentError, match=r"key 'e'.* is not initialised on server 1; call init\(\) first"):
        pull(tables, 0, [1])
    tables.table.init([CID], [np.zeros(4, F32)])              # a dense chunk of the same id
    with pytest.raises(InvalidArgumentError, match="belongs to a dense key: row-sparse operations need"):
        push(tables, 0, [1], [[1, 1]])
    with pytest.raises(ProtocolError, match=r"bad chunk id \['e'\]: expected \[key, server\]"):
        tables.on_pull(b"w0", {"id": 1, "src": 0, "chunk": ["e"]}, [np.zeros(0, I64)])


# -- async --------------------------------------------------------------------------------------
def test_async_needs_an_optimizer_and_then_applies_each_push_on_arrival():
    tables = init(make_tables(workers=2, mode=ASYNC))
    with pytest.raises(InvalidArgumentError, match=r"dist_async applies every push with an optimizer: "
                                                   r"call set_optimizer\(\) before push"):
        push(tables, 0, [1], [[1, 1]])
    assert weights(tables) == [[0, 1], [2, 3], [4, 5]]
    tables.optimizer.set({"optimizer": optimizer.SGD(learning_rate=1.0).to_config()})
    rid, [reply] = push(tables, 0, [5], [[1, 1]])
    assert reply.header == {"op": ops.OK, "id": rid}          # answered at once, no round
    assert weights(tables) == [[0, 1], [2, 3], [3, 4]]
    assert list(tables.queued_rounds()) == []


# -- set_rows ----------------------------------------------------------------------------------
def test_set_rows_is_refused_while_a_round_is_open_and_assigns_rows_between_steps():
    tables = init(make_tables(workers=2))
    push(tables, 1, [1], [[1, 1]])
    h = header(0)
    arrays = [np.array([3], I64), np.array([[9, 9]], F32)]
    with pytest.raises(InvalidArgumentError, match=r"set_rows on key 'e'.*a round of pushes is still open "
                                                   r"\(from worker\(s\) 1\); assign rows between steps"):
        tables.on_set(b"w0", h, arrays)
    push(tables, 0, [], np.zeros((0, 2)))
    [reply] = tables.on_set(b"w0", h, arrays)
    assert reply.header == {"op": ops.OK, "id": h["id"]}
    assert weights(tables) == [[1, 1], [9, 9], [4, 5]]


# -- workers that finished or left ---------------------------------------------------------------
def test_a_finished_workers_rounds_fail_naming_it_and_so_do_pulls_waiting_on_them():
    tables = init(make_tables(workers=2))
    id0, _ = push(tables, 0, [1], [[1, 1]])
    idp, _ = pull(tables, 0, [1])
    tables.table.gone.add(1)
    by = by_id(tables.workers_finished())
    assert set(by) == {id0, idp}
    for reply in by.values():
        refused(reply, "worker(s) 1 closed their store while a round of key 'e'",
                "every worker must take the same number of steps")
    assert list(tables.queued_rounds()) == [] and weights(tables) == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(InvalidArgumentError, match="worker.s. 1 closed their store"):
        push(tables, 0, [1], [[1, 1]])                        # a round worker 1 will never join


def test_a_worker_that_left_counts_with_no_rows_and_its_parked_requests_get_the_message():
    tables = init(make_tables(workers=3))
    id0, _ = push(tables, 0, [1], [[1, 1]])
    id1, _ = push(tables, 1, [3], [[3, 3]])
    idp, _ = pull(tables, 1, [3])
    by = by_id(tables.leave(2, "worker 2 left"))              # worker 2 counts with nothing
    assert set(by) == {id0, id1, idp} and by[idp].arrays[0].tolist() == [[3, 3]]
    assert weights(tables) == [[1, 1], [3, 3], [4, 5]]
    # worker 1 pushed to a round and left before it completed: its rows count, its
    # push and its parked pull get the message; the round then waits for worker 2
    id0, _ = push(tables, 0, [5], [[1, 1]])
    id1, _ = push(tables, 1, [5], [[2, 2]])
    idp, _ = pull(tables, 1, [5])
    by = by_id(tables.leave(1, "worker 1 left the elastic job"))
    assert set(by) == {id1, idp}
    for reply in by.values():
        refused(reply, "worker 1 left the elastic job")
    [reply] = tables.leave(2, "worker 2 left")
    assert reply.header == {"op": ops.OK, "id": id0}
    assert weights(tables)[2] == [3, 3]                       # no optimizer: the sum 1 + 2 assigned


def test_a_new_round_counts_the_ranks_that_are_not_members_as_empty():
    tables = init(make_tables(workers=3))
    tables.members.change(1, frozenset({0, 1}), num_workers=3)
    push(tables, 0, [1], [[1, 1]])
    [(_, rnd)] = list(tables.queued_rounds())
    assert rnd.workers == {0, 2} and rnd.filled == {2}
    _, replies = push(tables, 1, [1], [[1, 1]])
    assert len(replies) == 2 and weights(tables)[0] == [2, 2]


# -- numbered pushes (replicated servers) --------------------------------------------------------
def test_a_numbered_push_is_applied_once_and_one_out_of_order_is_refused():
    tables = init(make_tables(workers=1))
    _, replies = push(tables, 0, [1], [[1, 1]], rounds=[1])
    assert len(replies) == 1 and weights(tables)[0] == [1, 1]
    _, [reply] = push(tables, 0, [1], [[50, 50]], rounds=[1])      # re-sent after a failover
    assert reply.header["op"] == ops.OK and weights(tables)[0] == [1, 1]
    with pytest.raises(InvalidArgumentError, match=r"push 3 of key 'e'.* from worker 0: its next round is 2"):
        push(tables, 0, [1], [[1, 1]], rounds=[3])
    with pytest.raises(ProtocolError, match="'rounds' of a row push must be a list of one round number >= 1"):
        push(tables, 0, [1], [[1, 1]], rounds=[0])
