"""dist_ssp (bounded staleness): a worker's read waits until every worker has pushed
at least (its own pushes - s) times, so a fast worker is never more than s steps
ahead of the slowest; s = 0 is dist_sync bit for bit, s = inf is dist_async.

Values tell which pushes a read saw: worker r always pushes BASE**r (exact in
float32, and in fp16 and 2bit compression with threshold BASE**r), the optimizer
is plain SGD with learning rate 1 from 0, so a value is -sum_r n_r * BASE**r and
its base-BASE digits are the counts n_r of each worker's pushes applied. A slow
worker waits on an Event the test controls; nothing sleeps."""

from __future__ import annotations

import math
import threading
import traceback

import numpy as np
import pytest

import kvstore
from kvstore import optimizer as opt
from kvstore.errors import ArgumentTypeError, InvalidArgumentError, KVStoreError
from kvstore.protocol import ops
from kvstore.server.state import ServerState
from state_driver import expect_error, expect_ok, only, peer

BASE = 64
SIZE = 3000          # 12 kB of float32: 3 chunks of <= 4 kB over 2 servers
DEADLINE = 60.0      # seconds any wait of the test thread may take
SGD1 = opt.SGD(learning_rate=1.0)


def counts(value: np.ndarray, workers: int, base: int = BASE) -> np.ndarray:
    """(workers, len(value)): how many pushes of each worker ``value`` holds."""
    m = (-value.astype(np.float64)).astype(np.int64)
    assert np.array_equal(-m.astype(value.dtype), value), "not a sum of pushes"
    return np.stack([(m // base ** r) % base for r in range(workers)])


def run_workers(cluster, fn, store_type="dist_ssp", events=(), **create_args) -> list:
    """``fn(kv)`` in one thread per worker; their results by rank. A worker's
    exception is re-raised here with its traceback; every join has a deadline. A
    worker that fails sets ``events``, so that no other thread waits for it."""
    results, errors = [None] * cluster.num_workers, []

    def work(rank):
        try:
            with kvstore.create(store_type, config=cluster.config("worker", rank), **create_args) as kv:
                results[rank] = fn(kv)
        except BaseException as e:       # handed to the test thread
            errors.append(f"worker {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
            for event in events:
                event.set()

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(cluster.num_workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE)
        assert not t.is_alive(), "a worker hangs"
    assert not errors, "\n".join(errors)
    return results


def wait(event: threading.Event, what: str) -> None:
    assert event.wait(DEADLINE), f"no {what} within {DEADLINE}s"


def start(kv) -> np.ndarray:
    """Key "w" at 0 with plain SGD at learning rate 1; an output buffer for it."""
    kv.init("w", np.zeros(SIZE, np.float32))
    kv.set_optimizer(SGD1)
    return np.empty(SIZE, np.float32)


def step_after(event: threading.Event, what: str, kv, out: np.ndarray) -> np.ndarray:
    """The held worker: its first step once ``event`` is set."""
    wait(event, what)
    return step(kv, 1, out)


def step(kv, t: int, out: np.ndarray) -> np.ndarray:
    """Step ``t`` (1-based) of worker kv.rank: push BASE**rank, read the value."""
    kv.pushpull("w", np.full(SIZE, float(BASE ** kv.rank), np.float32), out=out)
    return counts(out, kv.num_workers)


# -- a slow worker: the fast ones run exactly s steps ahead, then wait ------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers, s, compression", [
    (2, 1, None), (2, 2, None), (3, 1, None), (2, 1, "fp16"), (2, 2, "2bit")])
def test_a_fast_worker_runs_at_most_s_steps_ahead_of_a_held_one(make_cluster, workers, s, compression):
    k = 3                                 # steps every worker takes before the slow one is held
    slow = workers - 1
    cluster = make_cluster(workers, 2, chunk_bytes=4096, staleness=s)
    held, release, fast_done = threading.Event(), threading.Event(), threading.Event()
    sent = [threading.Event() for _ in range(workers)]       # a fast worker sent step k+s+1
    returned = [threading.Event() for _ in range(workers)]   # ...and it returned

    def job(kv):
        out = start(kv)
        if compression == "2bit":         # every push is exactly +-threshold: no residual
            kv.set_gradient_compression({"type": "2bit", "threshold": float(BASE ** kv.rank)})
        elif compression:
            kv.set_gradient_compression({"type": compression})
        seen = []
        for t in range(1, k + 1):         # free running
            seen.append((t, step(kv, t, out)))
        if kv.rank == slow:
            held.set()
            wait(release, "release")
            seen.append((k + 1, step(kv, k + 1, out)))
            wait(fast_done, "end of the fast workers")
            return seen
        wait(held, "slow worker held")
        for t in range(k + 1, k + s + 1):  # up to s steps ahead of the held worker: no wait
            seen.append((t, step(kv, t, out)))
        sent[kv.rank].set()
        seen.append((k + s + 1, step(kv, k + s + 1, out)))   # s + 1 ahead: waits for the slow one
        returned[kv.rank].set()
        return seen

    checks = []

    def control():
        try:
            for r in range(slow):
                wait(sent[r], f"worker {r}'s step {k + s + 1}")
            # every fast worker got through steps k+1..k+s while the slow one was held, and
            # none of their step-(k+s+1) reads has come back (the values below prove it waited)
            checks.append(not any(e.is_set() for e in returned[:slow]))
            release.set()
            for r in range(slow):
                wait(returned[r], f"worker {r}'s step {k + s + 1} after the release")
        except AssertionError as e:      # handed to the test thread
            checks.append(str(e))
        finally:
            release.set()
            fast_done.set()
    controller = threading.Thread(target=control, daemon=True)
    controller.start()
    everything = [held, release, fast_done, *sent, *returned]
    result = run_workers(cluster, job, events=everything)
    controller.join(DEADLINE)
    assert checks == [True], checks

    for rank, seen in enumerate(result):
        for t, n in seen:
            assert (n[rank] == t).all(), (rank, t)                # its own pushes, exactly
            assert (n >= t - s).all(), (rank, t, n.min(axis=1))     # the bound: every worker >= t - s
            if rank != slow and k < t <= k + s:
                assert (n[slow] == k).all()                        # answered while it was held
            if rank != slow and t == k + s + 1:
                assert (n[slow] == k + 1).all()                    # answered after its next push only


@pytest.mark.timeout(60)
def test_staleness_argument_overrides_the_setting_and_workers_must_agree(make_cluster):
    cluster = make_cluster(2, 1, staleness=5)
    held = threading.Event()

    def job(kv):      # staleness 1 from create: worker 0 waits at step 2 for worker 1's step 1
        out = start(kv)
        if kv.rank == 1:
            return step_after(held, "worker 0's first step", kv, out)
        first = step(kv, 1, out)
        held.set()
        return first, step(kv, 2, out)
    (first, second), other = run_workers(cluster, job, events=[held], staleness=1)
    assert (first[1] == 0).all() and (second[1] == 1).all() and (other[0] >= 1).all()
    assert [(n.state.mode.name, n.state.consistency.bound) for n in cluster.nodes] == [("ssp", 1)]

    cluster2 = make_cluster(2, 1)
    errors = {}

    def work(rank):
        try:
            kvstore.create("dist_ssp", config=cluster2.config("worker", rank), staleness=1 + rank)
        except KVStoreError as e:
            errors[rank] = str(e)
    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE)
        assert not t.is_alive(), "create hangs"
    assert set(errors) == {0, 1} and all("staleness=1" in m and "staleness=2" in m for m in errors.values())


@pytest.mark.parametrize("given, bound", [(0, 0), (3, 3), (None, math.inf), ("inf", math.inf),
                                          (math.inf, math.inf), (np.int64(2), 2)])
def test_staleness_values(given, bound):
    from kvstore.worker.types import FROM_CONFIG, server_mode, staleness_bound
    assert staleness_bound(given, 1) == bound
    assert staleness_bound(FROM_CONFIG, bound) == bound
    assert server_mode("dist_ssp", bound).name == {0: "sync", math.inf: "async"}.get(bound, "ssp")
    assert (server_mode("dist_sync", None).name, server_mode("dist_async", None).name) == ("sync", "async")


def test_bad_staleness_arguments_fail_before_anything_starts():
    from kvstore.worker.types import staleness_bound
    for bad, error in [(-1, InvalidArgumentError), (1.5, ArgumentTypeError), (True, ArgumentTypeError),
                       ("fast", ArgumentTypeError)]:
        with pytest.raises(error, match="staleness"):
            staleness_bound(bad, 1)
    for store in ("local", "dist_sync", "dist_async", "device"):
        with pytest.raises(InvalidArgumentError, match="staleness applies to 'dist_ssp' only"):
            kvstore.create(store, staleness=1)


# -- s = 0 is dist_sync, s = inf is dist_async -----------------------------------------------
def trajectory(kv):
    """A few Adam steps with float gradients: any difference in merge order or
    update count would show in the bits."""
    kv.init(["a", "b"], [np.ones(SIZE, np.float32), np.zeros(7, np.float32)])
    kv.set_optimizer(opt.Adam(learning_rate=0.01, wd=1e-3))
    outs, seen = [np.empty(SIZE, np.float32), np.empty(7, np.float32)], []
    for t in range(4):
        grads = [np.cos(np.arange(SIZE, dtype=np.float32) * (kv.rank + 2) + t).astype(np.float32),
                 np.full(7, kv.rank + t * 0.1, np.float32)]
        kv.pushpull(["a", "b"], grads, out=outs)
        seen.append([o.copy() for o in outs])
        kv.push("b", grads[1])
        kv.pull("b", out=outs[1])
        seen.append([outs[1].copy()])
    return seen


@pytest.mark.timeout(90)
def test_staleness_zero_is_dist_sync_bit_for_bit(make_cluster):
    # two workers: a sum of two pushes has one order (with three, dist_sync itself adds
    # them in arrival order, so two dist_sync runs may differ in the last bit)
    sync = make_cluster(2, 2, chunk_bytes=4096)
    want = sync.run(trajectory, "dist_sync")
    ssp = make_cluster(2, 2, chunk_bytes=4096, staleness=0)
    got = run_workers(ssp, trajectory)
    assert [n.state.mode.name for n in ssp.nodes] == ["sync", "sync"]
    for w, g in zip(want, got):
        for a, b in zip(w, g):
            for x, y in zip(a, b):
                assert x.tobytes() == y.tobytes()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("given", [None, "inf"])
def test_infinite_staleness_is_dist_async(make_cluster, given):
    cluster = make_cluster(2, 2, chunk_bytes=4096)
    done = threading.Event()

    def job(kv):       # worker 1 takes no step until worker 0 has taken 10: nothing waits
        out = start(kv)
        if kv.rank == 1:
            return step_after(done, "worker 0's ten steps", kv, out)
        seen = [step(kv, t, out) for t in range(1, 11)]
        done.set()
        return seen
    fast, slow = run_workers(cluster, job, events=[done], staleness=given)
    for t, n in enumerate(fast, 1):
        assert (n[0] == t).all() and (n[1] == 0).all()
    assert (slow == [[10], [1]]).all()
    assert [n.state.mode.name for n in cluster.nodes] == ["async", "async"]


# -- failures -----------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_read_that_waits_for_a_finished_worker_fails_naming_it(make_cluster):
    cluster = make_cluster(2, 2, chunk_bytes=4096, staleness=1)

    def job(kv):
        out = start(kv)
        if kv.rank == 1:
            step(kv, 1, out)
            return None                   # closes its store after 1 step
        step(kv, 1, out)
        step(kv, 2, out)                   # needs worker 1 at 1: fine
        with pytest.raises(KVStoreError) as caught:
            step(kv, 3, out)               # needs worker 1 at 2: it finished
        return str(caught.value)
    message = run_workers(cluster, job)[0]
    assert "worker 1 (after 1 push) closed its store" in message, message
    assert "to have pushed it 2 times (dist_ssp, staleness 1" in message
    assert "every worker must take the same number of steps" in message


@pytest.mark.timeout(60)
def test_dist_ssp_needs_an_optimizer_and_refuses_row_sparse_keys(make_cluster):
    cluster = make_cluster(1, 1, staleness=2)

    def job(kv):
        kv.init("w", np.zeros(4, np.float32))
        with pytest.raises(InvalidArgumentError, match="dist_ssp applies every push with an optimizer"):
            kv.push("w", np.ones(4, np.float32))
        with pytest.raises(InvalidArgumentError, match="row-sparse keys do not work with dist_ssp"):
            kv.init("emb", kvstore.RowSparse(np.zeros((1, 2), np.float32), np.array([0]), (5, 2)))
        return kv.type
    assert run_workers(cluster, job) == ["dist_ssp"]


# -- checkpoints: values and optimizer state kept, clocks start again at 0 ----------------------
@pytest.mark.timeout(120)
def test_resume_keeps_the_values_and_starts_the_clocks_again(make_cluster, tmp_path):
    ckpt = str(tmp_path / "ckpt")

    def original(kv):
        out = start(kv)
        for t in range(1, 4 + kv.rank):   # worker 1 takes one step more: clocks 3 and 4
            step(kv, t, out)
        kv.save_checkpoint({"step": 3})
        kv.pull("w", out=out)
        return counts(out, 2)
    at_checkpoint = run_workers(make_cluster(2, 2, chunk_bytes=4096, checkpoint_dir=ckpt, staleness=1),
                                original)
    assert all((n == [[3], [4]]).all() for n in at_checkpoint)

    held = threading.Event()

    def resumed(kv):     # staleness 2 now; worker 1 holds: worker 0 runs exactly 2 steps ahead
        assert kv.resumed and kv.resume_meta == {"step": 3}
        out = start(kv)
        if kv.rank == 1:
            return step_after(held, "worker 0's two steps", kv, out)
        seen = [step(kv, t, out) for t in (1, 2)]
        held.set()
        return seen + [step(kv, 3, out)]
    fast, slow = run_workers(make_cluster(2, 2, chunk_bytes=4096, checkpoint_dir=ckpt, resume=True,
                                          staleness=2), resumed, events=[held])
    for t, n in enumerate(fast, 1):
        assert (n[0] == 3 + t).all()                         # the checkpoint's 3, then its own
    assert (fast[0][1] == 4).all() and (fast[1][1] == 4).all()   # 2 ahead of the held one: no wait
    assert (fast[2][1] == 5).all()                            # 3 ahead: after worker 1's next push
    assert (slow[1] == 5).all()


# -- the state machine alone ------------------------------------------------------------------
A, B = ("w", 0), ("w", 1)
ONE = np.ones(2, np.float32)


def send(state, w, op, rid, chunks=(A,), arrays=None, **fields):
    """Worker ``w``'s request to ``state``; the replies it makes ready. Pushes carry
    ONE per chunk unless ``arrays`` says otherwise."""
    if arrays is None:
        arrays = [ONE] * len(chunks) if op in (ops.PUSH, ops.PUSHPULL) else []
    header = {"op": op, "id": rid, "src": w, **fields}
    if op != ops.CONFIGURE:
        header["chunks"] = [list(c) for c in chunks]
    return state.handle(peer(w), header, list(arrays))


def configure(state, w, rid, **fields):
    return send(state, w, ops.CONFIGURE, rid, **fields)


def ssp_state(workers=2, s=1, opt_=SGD1, dtype=np.float32) -> ServerState:
    state = ServerState(name="server 0")
    expect_ok(only(configure(state, 0, 1, mode="ssp", num_workers=workers, staleness=s)), peer(0), 1)
    expect_ok(only(send(state, 0, ops.INIT, 2, [A, B], [np.zeros(2, dtype)] * 2)), peer(0), 2)
    if opt_ is not None:
        expect_ok(only(send(state, 0, ops.SET_OPTIMIZER, 3, (), optimizer=opt_.to_config())), peer(0), 3)
    return state


@pytest.mark.parametrize("fields", [
    {"mode": "ssp"}, {"mode": "ssp", "staleness": 0}, {"mode": "ssp", "staleness": 1.0},
    {"mode": "ssp", "staleness": True}, {"mode": "sync", "staleness": 1}, {"mode": "async", "staleness": 2}])
def test_bad_ssp_configurations(fields):
    state = ServerState()
    expect_error(only(configure(state, 0, 4, num_workers=2, **fields)), peer(0), 4,
                 "InvalidArgumentError", "bad configuration")
    assert state.mode is None and state.consistency is None


def test_reconfiguring_another_staleness_is_refused():
    state = ssp_state(s=2)
    expect_error(only(configure(state, 1, 9, mode="ssp", num_workers=2, staleness=3)), peer(1), 9,
                 "InvalidArgumentError",
                 "already runs in ssp mode (staleness 2) for 2 workers; cannot switch to ssp/2 (staleness 3)")
    expect_ok(only(configure(state, 1, 10, mode="ssp", num_workers=2, staleness=2)), peer(1), 10)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("workers, s", [(2, 1), (3, 2), (4, 1)])
def test_random_schedules_follow_the_rule(seed, workers, s):
    """Random pushes, pulls and pushpulls of random chunk sets: each read is answered
    exactly when every worker's count on each of its chunks reaches the reader's
    count - s (a model replays the rule), with the values of the pushes applied."""
    rng, base = np.random.default_rng(seed), 1000     # float64: up to 999 pushes per worker
    state = ssp_state(workers, s, dtype=np.float64)
    clocks = {cid: [0] * workers for cid in (A, B)}
    parked = {}            # request id -> (worker, chunks, {cid: need})
    blocked = set()        # workers with a read parked (they send nothing until it returns)
    for req in range(100, 400):
        free = [w for w in range(workers) if w not in blocked]
        if not free:   # workers pushing different chunks wait for each other (so in dist_sync):
            break      # the checks below have shown that no read due was held back
        w = int(rng.choice(free))
        # mostly both chunks, as a training step; one alone lets the chunks' clocks differ
        chunks = [A, B] if rng.random() < 0.8 else [(A, B)[int(rng.integers(2))]]
        op = [ops.PUSH, ops.PULL, ops.PUSHPULL][int(rng.integers(3))]
        grads = [np.full(2, float(base ** w))] * len(chunks) if op != ops.PULL else []
        replies = send(state, w, op, req, chunks, grads)
        if op != ops.PULL:
            for cid in chunks:
                clocks[cid][w] += 1
        if op != ops.PUSH:
            parked[req] = (w, chunks, {cid: clocks[cid][w] - s for cid in chunks})
        answered = {rep.header["id"]: rep for rep in replies}
        if op == ops.PUSH:
            expect_ok(answered.pop(req), peer(w), req)
        for rid, (who, cids, needs) in list(parked.items()):
            due = all(min(clocks[cid]) >= need for cid, need in needs.items())
            assert (rid in answered) == due, (rid, who, needs, clocks)
            if due:
                rep = answered.pop(rid)
                expect_ok(rep, peer(who), rid)
                for cid, value in zip(cids, rep.arrays):      # every push applied so far, no other
                    assert (counts(np.asarray(value), workers, base)[:, 0] == clocks[cid]).all()
                del parked[rid]
                blocked.discard(who)
            else:
                blocked.add(who)
        assert not answered
    assert state.mode.name == "ssp" and state.consistency.clocks == clocks


def test_finished_workers_fail_the_reads_that_wait_for_them():
    state = ssp_state(workers=3, s=1)
    for w, rid in [(0, 10), (1, 11), (2, 12), (0, 13), (2, 14)]:
        expect_ok(only(send(state, w, ops.PUSH, rid)), peer(w), rid)
    # clocks 2, 1, 2; worker 0 reaches 3 and reads twice with need 2: worker 1 lags
    assert send(state, 0, ops.PUSHPULL, 20) == [] and send(state, 0, ops.PULL, 23) == []
    assert state.workers_finished({2}) == []       # worker 2 reached 2 already: nothing fails
    replies = state.workers_finished({1, 2})
    assert sorted(r.header["id"] for r in replies) == [20, 23]
    for rep in replies:
        expect_error(rep, peer(0), rep.header["id"], "RemoteError",
                     "worker 1 (after 1 push) closed its store, but worker 0's read of key 'w' (chunk 0)")
    before = state.chunks[A].value.copy()
    expect_error(only(send(state, 0, ops.PUSHPULL, 24)), peer(0), 24, "InvalidArgumentError",
                 "workers 1 (after 1 push), 2 (after 2 pushes) closed their store")   # it would need 3
    np.testing.assert_array_equal(state.chunks[A].value, before)   # refused before applying
    expect_ok(only(send(state, 0, ops.PUSH, 25)), peer(0), 25)      # a push waits for nobody


def test_the_stall_inspector_names_the_slow_workers():
    state = ssp_state(workers=3, s=1)
    for w, rid in [(0, 1), (0, 2), (1, 3)]:
        send(state, w, ops.PUSH, rid, [B])
    assert send(state, 0, ops.PULL, 4, [B]) == []
    assert state.stalled(100.0, 30.0) == []
    assert state.stalled(131.0, 30.0) == [
        "a pull of worker 0 has waited 31s for worker(s) 2 to push key 'w' (chunk 1) 1 times "
        "(dist_ssp, staleness 1: no worker reads more than 1 step ahead of the slowest; "
        "they pushed it 0 times)"]
    assert state.stalled(200.0, 30.0) == []          # reported once


def test_without_an_optimizer_pushes_are_refused():
    expect_error(only(send(ssp_state(opt_=None), 0, ops.PUSH, 5)), peer(0), 5, "InvalidArgumentError",
                 "dist_ssp applies every push with an optimizer")


def test_a_restored_ssp_server_waits_for_configure_and_starts_clocks_at_zero():
    state = ssp_state(s=1)
    for rid in (4, 5):
        send(state, 0, ops.PUSH, rid)
    fresh = ServerState(name="server 0")
    fresh.restore(state.snapshot({"step": 2}))
    expect_error(only(send(fresh, 0, ops.PULL, 6)), peer(0), 6, "InvalidArgumentError", "not configured")
    expect_ok(only(configure(fresh, 0, 7, mode="ssp", num_workers=2, staleness=3)), peer(0), 7)
    assert fresh.mode.name == "ssp" and fresh.consistency.bound == 3 and fresh.consistency.clocks == {}
    np.testing.assert_array_equal(only(send(fresh, 0, ops.PULL, 8)).arrays[0], [-2, -2])


@pytest.mark.parametrize("s, expected_lr", [(0, 0.05), (2, 0.025)])
def test_the_examples_scale_the_learning_rate_unless_ssp_runs_as_sync(make_cluster, s, expected_lr):
    """examples/common.py: each worker's push is its own update under ssp (s > 0), so the
    learning rate is scaled by 1/W; dist_ssp with s = 0 is dist_sync, unscaled."""
    import argparse
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples"))
    from common import add_fit_args, make_optimizer
    args = add_fit_args(argparse.ArgumentParser()).parse_args(["--lr", "0.05"])
    cluster = make_cluster(2, 1, staleness=s)
    lrs = cluster.run(lambda kv: make_optimizer(args, 10, kv).learning_rate, store_type="dist_ssp")
    assert lrs == [pytest.approx(expected_lr)] * 2
