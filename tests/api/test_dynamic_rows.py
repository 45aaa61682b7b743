"""Dynamic rows (kvstore.DynamicRows): rows created on first push, evicted by age
and by budget, counted; in the local store (the oracle), in the server's state
machine (kvstore.server.dyntables, driven without sockets) and in dist_sync /
dist_async jobs (real sockets, in-process cluster), checkpoints included."""

import numpy as np
import pytest

import kvstore
from kvstore import DynamicRows, RowInit, RowSparse
from kvstore import optimizer as opt
from kvstore.rows.dynamic import ID_LIMIT, owner, split
from kvstore.rows.dyntable import DynTable
from kvstore.errors import ArgumentTypeError, InvalidArgumentError
from kvstore.protocol import ops

from state_driver import Server, by_id, expect_error, expect_ok, only, peer

pytestmark = pytest.mark.timeout(120)
D = 3
I64 = np.int64


def spec(**kw):
    return DynamicRows(D, init=("uniform", 1.0), seed=7, **kw)


def initial(ids):
    """The RowInit value of ``ids`` (what a new row starts as)."""
    out = np.empty((len(ids), D), np.float32)
    spec().rowinit().fill(out, np.asarray(ids, I64))
    return out


def grad(ids, scale=1.0):
    ids = np.asarray(ids, I64)
    data = np.stack([np.full(D, scale * (i % 97 + 1), np.float32) for i in ids]) if len(ids) else \
        np.zeros((0, D), np.float32)
    return RowSparse(data, ids, spec().shape)


def pull(kv, key, ids):
    out = RowSparse.zeros(spec().shape)
    kv.row_sparse_pull(key, out=out, row_ids=np.asarray(ids, I64))
    return dict(zip(out.indices.tolist(), out.data))


# -- the local store: the semantics ------------------------------------------------------
def test_rows_are_made_by_the_first_push_and_a_pull_does_not_make_them():
    kv = kvstore.create("local")
    kv.init("e", spec())
    big = [3, 2 ** 40 + 1, ID_LIMIT - 1]
    seen = pull(kv, "e", big)
    for i, row in zip(big, initial(big)):
        np.testing.assert_array_equal(seen[i], row)          # the RowInit value, no row made
    assert kv.row_stats("e")["rows"] == 0 and kv.row_stats("e")["misses"] == 3
    kv.push("e", grad(big[:2]))                               # no optimizer: assigned
    after = pull(kv, "e", big)
    np.testing.assert_array_equal(after[3], grad([3]).data[0])
    np.testing.assert_array_equal(after[ID_LIMIT - 1], initial([ID_LIMIT - 1])[0])
    s = kv.row_stats("e")
    assert (s["rows"], s["created"], s["hits"], s["misses"], s["rounds"]) == (2, 2, 2, 4, 1)
    assert s["hit_rate"] == pytest.approx(2 / 6)


@pytest.mark.parametrize("make", [lambda: opt.SGD(learning_rate=0.1, momentum=0.9, wd=0.01),
                                  lambda: opt.Adam(learning_rate=0.01),
                                  lambda: opt.AdaGrad(learning_rate=0.1)])
def test_without_eviction_a_dynamic_table_is_the_fixed_table_of_the_same_rowinit(make):
    """Rows that are never evicted behave exactly as a RowInit table's rows: lazy
    updates, state made at the first update, t counting rounds."""
    R = 200
    dyn, fixed = kvstore.create("local"), kvstore.create("local")
    dyn.init("e", spec())
    fixed.init("e", RowInit("uniform", 1.0, (R, D), seed=7))
    dyn.push("e", grad([5, 17]))                              # a round without an optimizer
    fixed.push("e", RowSparse(grad([5, 17]).data, np.array([5, 17]), (R, D)))
    for kv in (dyn, fixed):
        kv.set_optimizer(make())
    rng = np.random.default_rng(3)
    for step in range(6):
        ids = np.unique(rng.integers(0, R, 12))
        dyn.push("e", grad(ids, step + 1))
        fixed.push("e", RowSparse(grad(ids, step + 1).data, ids, (R, D)))
    got = pull(dyn, "e", np.arange(R))
    want = np.empty((R, D), np.float32)
    fixed.row_sparse_pull("e", out=want, row_ids=np.arange(R))
    np.testing.assert_array_equal(np.stack([got[i] for i in range(R)]), want)


def test_rows_not_updated_for_evict_after_rounds_are_evicted_and_come_back_fresh():
    kv = kvstore.create("local")
    kv.init("e", spec(evict_after=2))
    kv.set_optimizer(opt.SGD(learning_rate=0.5, momentum=0.9))
    kv.push("e", grad([1, 2]))            # round 1
    kv.push("e", grad([2, 3]))            # round 2: 1 was last updated 1 round ago
    assert sorted(pull(kv, "e", [1, 2, 3])) == [1, 2, 3] and kv.row_stats("e")["rows"] == 3
    survivor = pull(kv, "e", [3])[3].copy()
    kv.push("e", grad([2]))               # round 3: row 1 unused for 2 rounds -> evicted
    s = kv.row_stats("e")
    assert (s["rows"], s["evicted_by_age"], s["evicted_by_budget"]) == (2, 1, 0)
    np.testing.assert_array_equal(pull(kv, "e", [1])[1], initial([1])[0])    # gone: its initial value
    np.testing.assert_array_equal(pull(kv, "e", [3])[3], survivor)           # untouched survivor
    kv.push("e", grad([1]))               # round 4: 1 made again from RowInit, fresh momentum; 3 goes
    fresh = kvstore.create("local")       # the same single update of a new row, for reference
    fresh.init("e", spec())
    fresh.set_optimizer(opt.SGD(learning_rate=0.5, momentum=0.9))
    fresh.push("e", grad([1]))
    np.testing.assert_array_equal(pull(kv, "e", [1])[1], pull(fresh, "e", [1])[1])
    s = kv.row_stats("e")
    assert (s["rows"], s["created"], s["evicted_by_age"]) == (2, 4, 2)      # rows 1 and 2; 3 evicted


def test_past_the_budget_the_least_recently_updated_rows_go_ties_to_the_smaller_id():
    kv = kvstore.create("local")
    kv.init("e", spec(budget=4))
    kv.push("e", grad([10, 20, 30]))     # round 1
    kv.push("e", grad([40]))             # round 2
    kept = pull(kv, "e", [40])[40].copy()
    kv.push("e", grad([30, 50, 60]))     # round 3: 5 rows + 2 new -> 2 go: 10, 20 (round 1; 30 is in this round)
    s = kv.row_stats("e")
    assert (s["rows"], s["evicted_by_budget"], s["max_rows"]) == (4, 2, 4)
    values = pull(kv, "e", [10, 20, 30, 40, 50, 60])
    np.testing.assert_array_equal(values[10], initial([10])[0])
    np.testing.assert_array_equal(values[20], initial([20])[0])
    np.testing.assert_array_equal(values[40], kept)
    kv.push("e", grad([70]))             # round 4: one goes, 40 (round 2) before 30, 50, 60 (round 3)
    assert 40 not in [i for i, v in pull(kv, "e", [40]).items() if not np.array_equal(v, initial([40])[0])]
    kv.push("e", grad([80]))             # round 5: the oldest are 30, 50, 60 (round 3): 30, the smallest
    values = pull(kv, "e", [30, 50, 60])
    np.testing.assert_array_equal(values[30], initial([30])[0])
    assert not np.array_equal(values[50], initial([50])[0])


def test_the_budget_with_eviction_off_is_a_clear_error_and_changes_nothing():
    kv = kvstore.create("local")
    kv.init("e", spec(budget=3, evict=False))
    kv.set_optimizer(opt.Adam(learning_rate=0.1))
    kv.push("e", grad([1, 2]))
    before, stats = pull(kv, "e", [1, 2, 3, 4]), kv.row_stats("e")
    with pytest.raises(InvalidArgumentError, match=r"key 'e' in the local store: this round would make 4 rows "
                                                   r"\(2 held \+ 2 new\), past the budget of 3 rows per server"):
        kv.push("e", grad([2, 3, 4]))
    after = pull(kv, "e", [1, 2, 3, 4])
    for i in before:
        np.testing.assert_array_equal(before[i], after[i])
    now = kv.row_stats("e")
    assert {k: now[k] for k in ("rows", "created", "rounds", "updates")} == \
        {k: stats[k] for k in ("rows", "created", "rounds", "updates")}
    kv.push("e", grad([2, 3]))           # fits: goes on
    assert kv.row_stats("e")["rows"] == 3


@pytest.mark.parametrize("ids, error, fragment", [
    (np.array([5, -1]), InvalidArgumentError, "row id -1 is out of range"),
    (np.array([5, 2 ** 63], np.uint64), InvalidArgumentError, "row id 9223372036854775808 is out of range"),
    (np.array([5.0, 6.0]), ArgumentTypeError, "row ids must be integers"),
])
def test_malformed_ids_are_refused_naming_the_key(ids, error, fragment):
    kv = kvstore.create("local")
    kv.init("e", spec())
    with pytest.raises(error, match=f"key 'e'.*{fragment}"):
        kv.row_sparse_pull("e", out=RowSparse.zeros(spec().shape), row_ids=ids)
    if ids.dtype.kind != "f":            # (a RowSparse refuses float indices itself)
        with pytest.raises(error, match=f"key 'e'.*{fragment}"):
            kv.push("e", RowSparse(np.ones((2, D), np.float32), ids, spec().shape))
    assert kv.row_stats("e")["rows"] == 0


def test_calls_that_need_every_row_name_the_key_and_what_to_do():
    kv = kvstore.create("local")
    kv.init("e", spec())
    kv.set_optimizer(opt.SGD(learning_rate=0.1))
    with pytest.raises(InvalidArgumentError, match="key 'e' holds dynamic rows.*row_sparse_pull"):
        kv.pull("e", out=np.zeros(1), ignore_sparse=False)
    with pytest.raises(InvalidArgumentError, match="key 'e' holds dynamic rows.*not assigned"):
        kv.assign_rows("e", grad([1]))
    with pytest.raises(InvalidArgumentError, match="key 'e' holds dynamic rows.*servers' checkpoints"):
        kv.save_optimizer_states("/nonexistent/never-written")
    kv.init("d", np.zeros(2, np.float32))
    with pytest.raises(InvalidArgumentError, match="key 'd' has no dynamic rows"):
        kv.row_stats("d")
    with pytest.raises(InvalidArgumentError, match="budget must be an int >= 1"):
        DynamicRows(4, budget=0)


def test_a_table_snapshot_restores_a_table_that_continues_bit_for_bit():
    def rounds(table, start, stop, optimizer):
        rng = np.random.default_rng(start)
        for step in range(start, stop):
            ids = np.unique(rng.integers(0, 60, 9))
            table.apply(ids, grad(ids, step + 1).data, optimizer)
    s = DynamicRows(D, init=("normal", 0.1), budget=25, evict_after=4)
    optimizer = opt.Adam(learning_rate=0.05)
    a = DynTable(s, "a")
    rounds(a, 0, 10, optimizer)
    b = DynTable.restore(s, "b", a.snapshot())
    rounds(a, 10, 30, optimizer)
    rounds(b, 10, 30, optimizer)
    everything = np.arange(60)
    np.testing.assert_array_equal(a.ids, b.ids)
    np.testing.assert_array_equal(a.read(everything), b.read(everything))
    assert a.stats() == {**b.stats(), "capacity": a.stats()["capacity"]}
    assert a.stats()["evicted_by_budget"] > 0 and a.stats()["evicted_by_age"] > 0


# -- the server's state machine -------------------------------------------------------------
def ids_of(server, servers, count, start=0):
    """The first ``count`` ids >= start that hash to ``server``."""
    ids = np.arange(start, start + 50 * count * servers, dtype=I64)
    return ids[owner(ids, servers) == server][:count]


def dyn_server(workers=2, mode="sync", budget=None, evict=True, optimizer=None):
    s = Server(mode=mode, num_workers=workers, opt=optimizer)
    _, r = s.send(0, ops.INIT_DYN, chunk=["e", 1], servers=2,
                  spec=spec(budget=budget, evict=evict).to_wire())
    expect_ok(only(r), peer(0))
    return s


def push(s, src, ids, scale=1.0):
    g = grad(ids, scale)
    return s.send(src, ops.PUSH_DYN, arrays=[np.asarray(ids, I64), g.data], chunk=["e", 1])


@pytest.mark.usefixtures("server_backend")   # also the GPU server's code path (host device)
def test_the_server_merges_a_round_and_makes_its_rows_once():
    s = dyn_server()
    mine = ids_of(1, 2, 3)
    p0, r = push(s, 0, mine[:2])
    assert r == []                                   # waits for worker 1
    q, r = s.send(0, ops.PULL_DYN, arrays=[mine], chunk=["e", 1])
    assert r == []                                   # worker 0 has a push pending
    st, r = s.send(0, ops.DYN_STATS, chunk=["e", 1])
    assert r == []                                   # so do its counters
    p1, r = push(s, 1, mine[1:])
    got = by_id(r)
    assert set(got) == {p0, p1, q, st}
    want = np.stack([grad([mine[0]]).data[0], 2 * grad([mine[1]]).data[0], grad([mine[2]]).data[0]])
    np.testing.assert_array_equal(got[q].arrays[0], want)              # merged rows, assigned
    assert got[st].header["stats"]["rows"] == 3 and got[st].header["stats"]["rounds"] == 1


@pytest.mark.usefixtures("server_backend")   # also the GPU server's code path (host device)
def test_the_server_refuses_ids_that_are_not_its_own_or_not_unique_and_sorted():
    s = dyn_server()
    theirs, mine = ids_of(0, 2, 1), ids_of(1, 2, 2)
    for ids, kind, fragment in [(theirs, "InvalidArgumentError", f"row id {theirs[0]} is not one of this server's"),
                                (mine[::-1].copy(), "ProtocolError", "unique and sorted"),
                                (np.array([mine[0], mine[0]]), "ProtocolError", "unique and sorted"),
                                (np.array([-5], I64), "InvalidArgumentError", "row id -5"),
                                (mine.astype(np.float64), "ProtocolError", "1-d int64")]:
        rid, r = s.send(0, ops.PUSH_DYN, arrays=[ids, np.ones((len(ids), D), np.float32)], chunk=["e", 1])
        expect_error(only(r), peer(0), rid, kind, "key 'e'", fragment)
    rid, r = s.send(0, ops.PUSH_ROWS, arrays=[mine, np.ones((2, D), np.float32)], chunk=["e", 1])
    expect_error(only(r), peer(0), rid, "InvalidArgumentError", "not initialised")
    rid, r = s.send(0, ops.INIT_DYN, chunk=["e", 1], servers=2, spec=spec().to_wire())
    expect_error(only(r), peer(0), rid, "InvalidArgumentError", "already initialised")


@pytest.mark.usefixtures("server_backend")   # also the GPU server's code path (host device)
def test_a_round_past_the_budget_fails_for_every_worker_in_it_and_changes_nothing():
    s = dyn_server(budget=2, evict=False, optimizer=opt.SGD(learning_rate=0.1))
    mine = ids_of(1, 2, 3)
    push(s, 0, mine[:1])
    push(s, 1, mine[:1])
    p0, r = push(s, 0, mine[1:2])
    p1, r = push(s, 1, mine[2:3])
    got = by_id(r)
    for rid, to in ((p0, peer(0)), (p1, peer(1))):
        expect_error(got[rid], to, rid, "InvalidArgumentError", "key 'e' on server 0", "3 rows",
                     "budget of 2 rows per server", "eviction is off")
    _, r = s.send(0, ops.DYN_STATS, chunk=["e", 1])
    stats = only(r).header["stats"]
    assert (stats["rows"], stats["rounds"], stats["updates"]) == (1, 1, 1)


@pytest.mark.usefixtures("server_backend")   # also the GPU server's code path (host device)
def test_a_server_checkpoint_carries_the_rows_their_state_and_counters():
    s = dyn_server(workers=1, budget=4, optimizer=opt.Adam(learning_rate=0.1))
    mine = ids_of(1, 2, 8)
    for step in range(4):
        push(s, 0, mine[step:step + 3], step + 1)
    snap = s.state.snapshot({})
    t = Server(mode="sync", num_workers=1)
    t.state.restore(snap)
    _, r = t.send(0, ops.SET_OPTIMIZER, optimizer=opt.Adam(learning_rate=0.1).to_config())
    rid, r = t.send(0, ops.INIT_DYN, chunk=["e", 1], servers=2, spec=spec(budget=5).to_wire())
    expect_error(only(r), peer(0), rid, "InvalidArgumentError", "the checkpoint holds", "budget 4", "budget 5")
    _, r = t.send(0, ops.INIT_DYN, chunk=["e", 1], servers=2, spec=spec(budget=4).to_wire())
    expect_ok(only(r), peer(0))
    for server in (s, t):
        for step in range(4, 8):
            push(server, 0, mine[step - 2:step], step)
    reads = []
    for server in (s, t):
        _, r = server.send(0, ops.PULL_DYN, arrays=[mine], chunk=["e", 1])
        _, r2 = server.send(0, ops.DYN_STATS, chunk=["e", 1])
        reads.append((only(r).arrays[0], only(r2).header["stats"]))
    np.testing.assert_array_equal(reads[0][0], reads[1][0])
    assert reads[0][1] == reads[1][1] and reads[0][1]["evicted_by_budget"] > 0


def test_placement_by_hash_is_balanced_and_deterministic():
    ids = np.arange(100_000, dtype=I64)                    # sequential ids: the worst case for r % S
    counts = np.bincount(owner(ids, 4), minlength=4)
    assert counts.min() > 0.97 * len(ids) / 4
    parts = split(ids[::-1].copy(), 3)
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(ids)))
    assert owner(np.array([12345], I64), 7)[0] == owner(np.array([12345], I64), 7)[0]


# -- dist_sync and dist_async jobs ------------------------------------------------------------
STEPS, IDS = 6, 40
# the counters every worker sees alike (hits and misses also count the other workers' pulls,
# which may come before or after a worker's row_stats)
DET = ("rows", "created", "evicted", "evicted_by_age", "evicted_by_budget", "rounds", "updates", "max_rows")


def batch(rank, step):
    """Worker ``rank``'s ids at ``step``: huge ids, repeated across workers and steps."""
    rng = np.random.default_rng(100 * step + rank)
    base = rng.integers(0, IDS, 7)
    return (base.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) >> np.uint64(2)).astype(I64)


def everything():
    return np.unique(np.concatenate([batch(r, s) for r in range(3) for s in range(STEPS)]))


def train(kv, dyn_spec, make_opt, steps=STEPS, start=0, setup=True):
    if start == 0:
        kv.init("e", dyn_spec)
    if setup:
        kv.set_optimizer(make_opt())
    for step in range(start, steps):
        ids = batch(kv.rank, step)
        pull(kv, "e", ids)
        kv.push("e", grad(ids, step + 1))
    return pull(kv, "e", everything()), kv.row_stats("e")


def oracle(dyn_spec, make_opt, workers, steps=STEPS):
    kv = kvstore.create("local")
    kv.init("e", dyn_spec)
    kv.set_optimizer(make_opt())
    for step in range(steps):
        kv.push("e", [grad(batch(r, step), step + 1) for r in range(workers)])
    return pull(kv, "e", everything()), kv.row_stats("e")


def same(a, b):
    assert sorted(a) == sorted(b)
    for i in a:
        np.testing.assert_array_equal(a[i], b[i], err_msg=f"row {i}")


@pytest.mark.parametrize("evict_after", [None, 2])
def test_dist_sync_ends_where_the_local_store_does(make_cluster, evict_after):
    s = spec(evict_after=evict_after)
    make = lambda: opt.Adam(learning_rate=0.05)   # noqa: E731
    want, want_stats = oracle(s, make, 2)
    for got, stats in make_cluster(2, 2).run(lambda kv: train(kv, s, make)):
        same(got, want)
        for k in ("rows", "created", "evicted", "evicted_by_age"):
            assert stats[k] == want_stats[k], k
        assert stats["rounds"] == STEPS and len(stats["servers"]) == 2
    if evict_after:
        assert want_stats["evicted_by_age"] > 0


def test_dist_sync_keeps_each_server_under_its_budget(make_cluster):
    s = spec(budget=10)
    results = make_cluster(2, 2).run(lambda kv: train(kv, s, lambda: opt.SGD(learning_rate=0.1)))
    for _, stats in results:
        assert stats["max_rows"] <= 10 and all(p["rows"] <= 10 for p in stats["servers"])
        assert stats["evicted_by_budget"] > 0
    assert {k: results[0][1][k] for k in DET} == {k: results[1][1][k] for k in DET}


def test_dist_sync_budget_error_reaches_every_worker_naming_key_server_budget(make_cluster):
    s = spec(budget=2, evict=False)

    def job(kv):
        kv.init("e", s)
        with pytest.raises(kvstore.RemoteError) as info:
            kv.push("e", grad(ids_of(0, 1, 3)))           # one server: 3 rows > 2
            pull(kv, "e", [1])
        assert info.value.kind == "InvalidArgumentError"
        assert "key 'e' on server 0" in str(info.value) and "budget of 2 rows" in str(info.value)
        return kv.row_stats("e")["rows"]
    assert make_cluster(2, 1).run(job) == [0, 0]


def test_dist_async_applies_each_push_as_a_round(make_cluster):
    s = spec()

    def job(kv):
        kv.init("e", s)
        kv.set_optimizer(opt.SGD(learning_rate=0.5))
        kv.push("e", grad(batch(kv.rank, 0)))
        kv.barrier()
        return pull(kv, "e", everything()), kv.row_stats("e")
    results = make_cluster(2, 2).run(job, store_type="dist_async")
    local = kvstore.create("local")        # pushes of distinct workers commute for plain SGD
    local.init("e", s)
    local.set_optimizer(opt.SGD(learning_rate=0.5))
    for r in range(2):
        local.push("e", grad(batch(r, 0)))
    want = pull(local, "e", everything())
    for got, stats in results:
        assert sorted(got) == sorted(want)
        for i in want:
            np.testing.assert_allclose(got[i], want[i], rtol=1e-6)
        assert stats["rows"] == local.row_stats("e")["rows"]


def test_resume_from_a_checkpoint_continues_bit_for_bit(make_cluster, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    s = spec(budget=9, evict_after=2)
    make = lambda: opt.Adam(learning_rate=0.05)   # noqa: E731

    def original(kv):
        train(kv, s, make, steps=3)
        kv.save_checkpoint({"step": 3})
        return train(kv, s, make, steps=STEPS, start=3, setup=False)
    finals = make_cluster(2, 2, checkpoint_dir=ckpt).run(original)

    def resumed(kv):
        assert kv.resume_meta == {"step": 3}
        kv.init("e", s)
        return train(kv, s, make, steps=STEPS, start=3)
    for (got, stats), (want, want_stats) in zip(make_cluster(2, 2, checkpoint_dir=ckpt, resume=True).run(resumed),
                                                finals):
        same(got, want)
        assert {k: stats[k] for k in DET} == {k: want_stats[k] for k in DET}
    assert finals[0][1]["evicted"] > 0


@pytest.mark.parametrize("seed", range(4))
def test_a_table_matches_a_plain_python_model_of_lru_and_age_eviction(seed):
    """Random rounds against a dict: which rows live, their values, the counters."""
    rng = np.random.default_rng(seed)
    budget, evict_after = int(rng.integers(5, 15)), int(rng.integers(2, 6))
    s = DynamicRows(D, init=("uniform", 1.0), seed=7, budget=budget, evict_after=evict_after)
    table, model, clock, evicted = DynTable(s, "t", capacity=2), {}, 0, [0, 0]
    for _ in range(60):
        ids = np.unique(rng.integers(0, 40, int(rng.integers(0, budget + 1))))
        values = rng.standard_normal((len(ids), D)).astype(np.float32)
        table.apply(ids, values)
        new = [i for i in ids.tolist() if i not in model]
        over = len(model) + len(new) - budget
        if over > 0:           # least recently updated first, ties to the smaller id, never this round's
            order = sorted((last, i) for i, (_, last) in model.items() if i not in set(ids.tolist()))
            for _, i in order[:over]:
                del model[i]
            evicted[1] += over
        clock += 1
        for i, v in zip(ids.tolist(), values):
            model[i] = (v, clock)
        for i in [i for i, (_, last) in model.items() if clock - last >= evict_after]:
            del model[i]
            evicted[0] += 1
        assert table.ids.tolist() == sorted(model)
        probe = np.arange(40)
        got = table.read(probe)
        for i in range(40):
            want = model[i][0] if i in model else initial([i])[0]
            np.testing.assert_array_equal(got[i], want)
        stats = table.stats()
        assert (stats["evicted_by_age"], stats["evicted_by_budget"], stats["rows"]) == (*evicted, len(model))


def test_a_worker_that_leaves_an_elastic_job_counts_with_no_rows_in_the_open_round():
    s = dyn_server(workers=3)
    mine = ids_of(1, 2, 2)
    p0, _ = push(s, 0, mine[:1])
    p1, _ = push(s, 1, mine[1:])
    replies = by_id(s.state.set_members(1, {0, 1}))       # worker 2 left: the round completes without it
    assert set(replies) == {p0, p1}
    _, r = s.send(0, ops.DYN_STATS, chunk=["e", 1])
    assert only(r).header["stats"]["rows"] == 2
