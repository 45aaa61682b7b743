"""Deterministic sums (``KVSTORE_DETERMINISTIC=1``, ``create(..., deterministic=True)``):
a dist_sync round's pushes are added in worker-rank order whatever their arrival,
so the same job on the same data gives the same bits (kvstore.server.sync).

The values are chosen so that float32 addition in another order gives other bits
(1e8 + 1 - 1e8 + 1 is 1 in rank order, 0 or 2 in others): every test here fails
with the sums in arrival order, which ``test_arrival_order_changes_the_bits``
shows on the same values."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import kvstore
from kvstore.protocol import ops
from kvstore.server.state import ServerState
from state_driver import A, B, Server, by_id, expect_error, expect_ok, only, peer, sgd, vec

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("server_backend")]

F32 = np.float32
GRADS = [vec(1e8, 3.0), vec(1.0, 1e-7), vec(-1e8, -3.0), vec(1.0, 1e-7)]   # worker r pushes GRADS[r]


def rank_order(parts):
    total = parts[0].copy()
    for p in parts[1:]:
        total += p
    return total


class Ordered(Server):
    """A sync server of ``workers`` ranks configured with ``deterministic``."""

    def __init__(self, workers=4, deterministic=True, opt=None, write_in=False):
        self.state = ServerState(name="server 0", write_in=write_in)
        self._ids = itertools.count(1)
        _, r = self.send(0, ops.CONFIGURE, mode="sync", num_workers=workers, deterministic=deterministic)
        expect_ok(only(r), peer(0))
        if opt is not None:
            self.set_optimizer(opt)
        self.init({A: vec(0, 0), B: vec(0, 0, 0)})


def _round_in(order, deterministic=True):
    srv = Ordered(deterministic=deterministic)
    ids = {}
    for w in order:
        rid, replies = srv.push(w, {A: GRADS[w]})
        ids[rid] = w
    for rid, reply in by_id(replies).items():
        expect_ok(reply, peer(ids[rid]), rid)
    assert len(replies) == 4
    return srv.value(A)


def test_every_arrival_order_gives_the_rank_order_bits():
    want = rank_order(GRADS)
    for order in itertools.permutations(range(4)):
        np.testing.assert_array_equal(_round_in(order), want, err_msg=f"arrival order {order}")


def test_arrival_order_changes_the_bits():
    """The same pushes summed as they arrive: the reason for the option (and proof
    that the values above tell the orders apart)."""
    results = {_round_in(order, deterministic=False).tobytes() for order in itertools.permutations(range(4))}
    assert len(results) > 1


def test_an_early_push_is_held_as_it_came_and_added_in_its_turn():
    srv = Ordered()
    rid3, r = srv.push(3, {A: GRADS[3]})
    assert r == []
    rnd = srv.state.chunks[A].rounds[0]
    assert list(rnd.held) == [3] and rnd.first is None and rnd.acc is None    # nothing added yet
    srv.push(0, {A: GRADS[0]})
    assert rnd.first is not None and rnd.acc is None and rnd.folded == {0}    # rank 0 is next: taken
    assert list(rnd.held) == [3]
    srv.push(1, {A: GRADS[1]})
    assert list(rnd.held) == [3] and rnd.folded == {0, 1}
    _, r = srv.push(2, {A: GRADS[2]})
    assert len(r) == 4 and not rnd.held and rnd.folded == {0, 1, 2, 3}
    np.testing.assert_array_equal(srv.value(A), rank_order(GRADS))


def test_with_an_optimizer_the_update_sees_the_rank_order_sum():
    opt = sgd(learning_rate=1.0)
    for order in [(3, 2, 1, 0), (1, 3, 0, 2)]:
        srv = Ordered(opt=opt)
        for w in order:
            srv.push(w, {A: GRADS[w]})
        np.testing.assert_array_equal(srv.value(A), -rank_order(GRADS))


def test_a_worker_that_leaves_lets_the_held_pushes_after_it_in():
    """Elastic: worker 1 leaves while worker 2's and 3's pushes wait for its turn."""
    srv = Ordered()
    assert srv.state.set_members(0, range(4)) == []
    srv.push(0, {A: GRADS[0]})
    srv.push(3, {A: GRADS[3]})
    srv.push(2, {A: GRADS[2]})
    rnd = srv.state.chunks[A].rounds[0]
    assert sorted(rnd.held) == [2, 3]
    replies = srv.state.set_members(1, [0, 2, 3])        # worker 1 left
    assert len([r for r in replies if r.header["op"] == ops.OK]) == 3
    np.testing.assert_array_equal(srv.value(A), rank_order([GRADS[0], GRADS[2], GRADS[3]]))


def test_a_hosts_sum_takes_the_turn_of_its_lowest_rank():
    srv = Ordered()
    parts = {1: GRADS[1] + GRADS[3]}                      # a host of workers 1 and 3
    r = srv.state.handle(peer(1), {"op": ops.PUSH, "id": 90, "src": 1, "chunks": [list(A)], "group": [1, 3]},
                         [parts[1]])
    assert r == []
    srv.push(2, {A: GRADS[2]})
    _, r = srv.push(0, {A: GRADS[0]})
    assert len(r) == 3
    np.testing.assert_array_equal(srv.value(A), rank_order([GRADS[0], parts[1], GRADS[2]]))


def test_writing_in_is_refused_and_dist_async_refuses_the_option():
    srv = Ordered(write_in=True)
    rid, r = srv.send(0, ops.WRITE, [A], values=True)
    expect_error(only(r), peer(0), rid, "InvalidArgumentError", "rank order", "push instead")
    state = ServerState(name="server 0")
    r = state.handle(peer(0), {"op": ops.CONFIGURE, "id": 1, "src": 0, "mode": "async", "num_workers": 2,
                               "deterministic": True}, [])
    expect_error(only(r), peer(0), 1, "InvalidArgumentError", "dist_async applies each push as it arrives")
    assert state.mode is None and state.consistency is None
    r = state.handle(peer(0), {"op": ops.CONFIGURE, "id": 2, "src": 0, "mode": "sync", "num_workers": 2,
                               "deterministic": "yes"}, [])
    expect_error(only(r), peer(0), 2, "ProtocolError", "'deterministic' must be true or false")


def test_a_second_configure_cannot_switch_the_order():
    srv = Ordered()
    rid, r = srv.send(1, ops.CONFIGURE, mode="sync", num_workers=4)
    expect_error(only(r), peer(1), rid, "InvalidArgumentError", "already sums in rank order")


# -- a real job: the workers' pushes arrive in whatever order the threads make ------------------
def test_dist_sync_with_deterministic_sums_gives_the_rank_order_bits_every_round(make_cluster):
    rounds = 30
    rng = np.random.default_rng(5)
    scale = np.array([1e8, 1.0, -1e8, 1.0], F32)
    data = (rng.standard_normal((rounds, 4, 64)).astype(F32) * scale[None, :, None]).astype(F32)

    def job(kv):
        kv.init("w", np.zeros(64, F32))
        out = np.empty(64, F32)
        got = []
        for t in range(rounds):
            kv.pushpull("w", data[t, kv.rank].copy(), out=out)
            got.append(out.copy())
        return got

    results = make_cluster(4, 2, chunk_bytes=128, deterministic=True).run(job)
    for t in range(rounds):
        want = rank_order(list(data[t]))
        for rank, got in enumerate(results):
            np.testing.assert_array_equal(got[t], want, err_msg=f"round {t}, worker {rank}")


def test_create_takes_the_option_and_refuses_it_where_pushes_apply_on_arrival():
    # refused before this worker contacts anything: the job's address need not exist
    config = kvstore.Config(role="worker", scheduler_host="127.0.0.1", scheduler_port=9, num_workers=1,
                            num_servers=1)
    with pytest.raises(kvstore.InvalidArgumentError, match="deterministic sums .* need dist_sync"):
        kvstore.create("dist_async", config=config, deterministic=True)
    with pytest.raises(kvstore.InvalidArgumentError, match="deterministic sums .* need dist_sync"):
        kvstore.create("dist_ssp", config=config.replace(deterministic=True), staleness=2)
    with pytest.raises(kvstore.ArgumentTypeError, match="deterministic must be True or False"):
        kvstore.create("dist_sync", config=config, deterministic=1)
    assert kvstore.create("local", deterministic=True).type == "local"


def test_a_resumed_job_of_four_workers_ends_on_the_uninterrupted_bits(make_cluster, tmp_path):
    """The point of the option for a week-long job: with 4 workers (sums of 4 floats,
    where arrival order changes bits) a crash and a resume from the checkpoint end
    bit for bit where an uninterrupted run ends, and so do two uninterrupted runs."""
    n, total = 512, 10
    scale = np.array([1e4, 1.0, -1e4, 3.0], F32)

    def steps(kv, first, last, save=True):
        w = np.empty(n, F32)
        for step in range(first, last):
            grad = (np.cos(np.arange(n, dtype=F32) * (kv.rank + 2) + step) * scale[kv.rank]).astype(F32)
            kv.push("w", grad)
            kv.pull("w", out=w)
            if save:
                kv.save_checkpoint({"step": step + 1})    # collective: every worker
        return w

    def start(kv):
        kv.init("w", np.ones(n, F32))
        kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=1e-3, momentum=0.9))
        return kv.resume_meta.get("step", 0)

    def whole(kv):
        return steps(kv, start(kv), total, save=False).tobytes()

    settings = dict(chunk_bytes=1024, deterministic=True)
    references = {w for _ in range(2) for w in make_cluster(4, 2, **settings).run(whole)}
    assert len(references) == 1                    # two runs, four workers: one set of bits

    ckpt = str(tmp_path / "ckpt")
    make_cluster(4, 2, checkpoint_dir=ckpt, **settings).run(lambda kv: steps(kv, start(kv), 4).tobytes())
    resumed = make_cluster(4, 2, checkpoint_dir=ckpt, resume=True, **settings).run(
        lambda kv: (start(kv), steps(kv, kv.resume_meta["step"], total).tobytes())[1])
    assert set(resumed) == references
