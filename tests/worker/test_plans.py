"""Call plans (kvstore.worker.plans): a repeated pushpull with the same keys and
arrays of the same kind is taken by the plan its first call recorded; every change
the plan depends on (a key initialised, the optimizer, its learning rate,
compression, the members, closing) forgets it; and a call that differs in any
checked way (a key, its type, a shape, a dtype, a device, a row-sparse value) is
not taken by it: it is refused exactly as without a plan, before anything is sent.

Plans are the store's own (``kv._plans``): these tests read how many it holds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvstore
from kvstore import RowSparse
from kvstore import optimizer as opt
from kvstore.errors import ArgumentTypeError, InvalidArgumentError
from kvstore.sharding import Placement
from kvstore.worker.arguments import KeyInfo
from kvstore.worker.exchange import by_server
from kvstore.worker.plans import Plans, Routes

pytestmark = pytest.mark.timeout(60)

F32 = np.float32
SHAPES = {0: (3,), 1: (2, 2), 2: (5,)}


def local_store():
    kv = kvstore.create("local")
    kv.init(list(SHAPES), [np.zeros(s, F32) for s in SHAPES.values()])
    return kv


def values(fill=1.0, dtype=F32):
    return [np.full(s, fill, dtype) for s in SHAPES.values()]


def test_a_repeated_pushpull_is_taken_by_its_plan_and_computes_the_same():
    kv = local_store()
    outs = values(0.0)
    for step in range(3):
        kv.pushpull(list(SHAPES), values(step + 1.0), out=outs)
        assert all((o == step + 1.0).all() for o in outs)
    assert len(kv._plans) == 1
    # a key listed twice sums its values, with the plan as without
    out = np.zeros(3, F32)
    for _ in range(2):
        kv.pushpull([0, 0], [np.ones(3, F32), np.full(3, 2.0, F32)], out=[out, out])
        assert (out == 3.0).all()
    # one key and one value: a plan of its own
    for _ in range(2):
        kv.pushpull(2, np.full(5, 4.0, F32), out=np.zeros(5, F32))
    assert len(kv._plans) == 3


def refusal(call) -> tuple[type, str]:
    with pytest.raises(Exception) as info:     # (a meta tensor raises torch's own error)
        call()
    return type(info.value), str(info.value)


BAD_CALLS = {
    "shape": lambda kv: kv.pushpull([0, 1, 2], [np.ones(4, F32), *values()[1:]], out=values()),
    "dtype": lambda kv: kv.pushpull([0, 1, 2], values(dtype=np.float64), out=values()),
    "out dtype": lambda kv: kv.pushpull([0, 1, 2], values(), out=[np.zeros(3, np.int32), *values()[1:]]),
    "out shape": lambda kv: kv.pushpull([0, 1, 2], values(), out=[np.zeros(3, F32), np.zeros(4, F32),
                                                                    np.zeros(5, F32)]),
    "key not initialised": lambda kv: kv.pushpull([0, 1, 7], values(), out=values()),
    "bool key": lambda kv: kv.pushpull([0, True, 2], values(), out=values()),
    "str key": lambda kv: kv.pushpull([0, "1", 2], values(), out=values()),
    "too few values": lambda kv: kv.pushpull([0, 1, 2], values()[:2], out=values()),
    "row-sparse written back": lambda kv: kv.pushpull(
        [0, 1, 2], [RowSparse(np.ones((1,), F32), np.array([1]), (3,)), *values()[1:]]),
    "bad row id": lambda kv: kv.pushpull(
        [0, 1, 2], [RowSparse(np.ones((1,), F32), np.array([5]), (3,)), *values()[1:]], out=values()),
    "torch sparse out": lambda kv: kv.pushpull(
        [0, 1, 2], values(), out=[torch.zeros(3).to_sparse(), *values()[1:]]),
    "a device the plan did not see": lambda kv: kv.pushpull(
        [0, 1, 2], [torch.ones(3, device="meta"), *values()[1:]], out=values()),
    "a closed store": lambda kv: (kv.close(), kv.pushpull([0, 1, 2], values(), out=values())),
}


@pytest.mark.parametrize("bad", sorted(BAD_CALLS))
def test_bad_input_after_a_plan_is_refused_as_without_one(bad):
    fresh = local_store()
    expected = refusal(lambda: BAD_CALLS[bad](fresh))
    kv = local_store()
    outs = values(0.0)
    for _ in range(2):
        kv.pushpull([0, 1, 2], values(), out=outs)
    before = [o.copy() for o in outs]
    assert len(kv._plans) == 1
    assert refusal(lambda: BAD_CALLS[bad](kv)) == expected
    assert all((o == b).all() for o, b in zip(outs, before))
    # and the good call still works (a plan is not confused by what it refused)
    if bad != "a closed store":
        kv.pushpull([0, 1, 2], values(2.0), out=outs)
        assert all((o == 2.0).all() for o in outs)


def test_torch_values_have_plans_and_a_layout_change_is_not_taken():
    kv = local_store()
    grads = [torch.ones(s) for s in SHAPES.values()]
    outs = [torch.zeros(s) for s in SHAPES.values()]
    for _ in range(2):
        kv.pushpull(list(SHAPES), grads, out=outs)
    assert len(kv._plans) == 1 and all(bool((o == 1).all()) for o in outs)
    with pytest.raises(InvalidArgumentError, match="no out="):
        kv.pushpull(list(SHAPES), [torch.ones(3).to_sparse(), *grads[1:]])


CHANGES = {
    "init": lambda kv: kv.init(9, np.zeros(2, F32)),
    "set_optimizer": lambda kv: kv.set_optimizer(opt.SGD(learning_rate=0.1)),
    "set_learning_rate": lambda kv: (kv.set_optimizer(opt.SGD(learning_rate=0.1)), refill(kv),
                                     kv.set_learning_rate(0.05)),
    "set_gradient_compression": lambda kv: kv.set_gradient_compression({"type": "fp16"}),
    "close": lambda kv: kv.close(),
}


def refill(kv):
    kv.pushpull(list(SHAPES), values(), out=values())
    assert len(kv._plans) == 1


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_each_change_of_the_store_forgets_its_plans(change):
    kv = local_store()
    refill(kv)
    CHANGES[change](kv)
    assert len(kv._plans) == 0


def test_an_optimizer_set_after_a_plan_still_refuses_integer_keys():
    kv = kvstore.create("local")
    kv.init([0, 1], [np.zeros(3, F32), np.zeros(3, np.int32)])
    for _ in range(2):
        kv.pushpull([0, 1], [np.ones(3, F32), np.ones(3, np.int32)], out=[np.zeros(3, F32), np.zeros(3, np.int32)])
    kv.set_optimizer(opt.SGD(learning_rate=0.1))
    with pytest.raises(InvalidArgumentError, match="optimizers update floating-point values only"):
        kv.pushpull([0, 1], [np.ones(3, F32), np.ones(3, np.int32)], out=[np.zeros(3, F32), np.zeros(3, np.int32)])


def test_plans_are_bounded_and_unplannable_forms_are_not_kept():
    plans = Plans(limit=2)
    info = KeyInfo(0, (3,), np.dtype(F32))
    for k in range(3):
        plans.record("pushpull", [k], [np.ones(3, F32)], None, [(KeyInfo(k, (3,), np.dtype(F32)), [None])])
    assert len(plans) == 2
    assert plans.find("pushpull", [0], [np.ones(3, F32)]) is None        # the oldest went
    assert plans.find("pushpull", [2], [np.ones(3, F32)]) is not None
    # a list of values for one key, and non-arrays, are never kept
    assert plans.record("pushpull", [0], [[np.ones(3, F32), np.ones(3, F32)]], None, [(info, [])]) is None
    assert plans.record("pushpull", [0], [[1.0, 2.0, 3.0]], None, [(info, [])]) is None
    # np.int64(2) and 2 are the same key, but not the same call form: no plan takes it
    assert plans.find("pushpull", [np.int64(2)], [np.ones(3, F32)]) is None


def test_routes_send_each_chunk_where_by_server_does():
    placement = Placement(3, 64)       # small chunks: keys cut over the servers
    infos = [KeyInfo(k, (n,), np.dtype(F32), placement.place(k, n, 4)) for k, n in enumerate([5, 40, 1, 100])]
    flats = [np.arange(info.size, dtype=F32) + 1000 * k for k, info in enumerate(infos)]
    want = by_server(list(zip(infos, flats)))
    got = Routes.of(infos).pick(flats)
    assert sorted(got) == sorted(want)
    for server in want:
        assert got[server][0] == want[server][0]
        assert all((a == b).all() for a, b in zip(got[server][1], want[server][1]))


SMALL_CHUNKS = 64


def test_dist_plans_exchange_right_values_and_refuse_bad_input_before_sending(make_cluster):
    cluster = make_cluster(2, 2, chunk_bytes=SMALL_CHUNKS)
    sizes = [3, 40, 1, 17]

    def work(kv):
        keys = list(range(len(sizes)))
        kv.init(keys, [np.zeros(n, F32) for n in sizes])
        outs = [np.zeros(n, F32) for n in sizes]
        for step in range(4):
            kv.pushpull(keys, [np.full(n, (kv.rank + 1) * (step + 1), F32) for n in sizes], out=outs)
            want = sum((r + 1) * (step + 1) for r in range(kv.num_workers))
            assert all((o == want).all() for o in outs), step
        planned = len(kv._plans)
        for step in range(3):           # push and pull, planned too (the push assigns the round's sum)
            kv.push(keys, [np.full(n, (kv.rank + 1) * (step + 1), F32) for n in sizes])
            kv.pull(keys, out=outs)
            want = sum((r + 1) * (step + 1) for r in range(kv.num_workers))
            assert all((o == want).all() for o in outs), step
        planned = (planned, len(kv._plans))
        sent = kv.comm_stats()["bytes_sent"]
        with pytest.raises(InvalidArgumentError, match="has shape"):
            kv.pushpull(keys, [np.ones(n + 1, F32) for n in sizes], out=outs)
        with pytest.raises(InvalidArgumentError, match="dtype"):
            kv.pushpull(keys, [np.ones(n, np.float64) for n in sizes], out=outs)
        assert kv.comm_stats()["bytes_sent"] == sent          # refused before anything was sent
        # the members changing forgets the plans (what each collective call reports), and
        # with them the layouts the links kept of the servers' replies (Plans.also_forget)
        def layouts():
            return sum(len(link._layouts) for link in kv._client.links if hasattr(link, "_layouts"))
        kept = layouts() > 0
        kv._now_members(kv.members + (99,))
        forgotten = (len(kv._plans), layouts())
        kv._now_members(kv.members[:-1])
        kv.barrier()
        return planned, kept, forgotten
    assert cluster.run(work) == [((1, 3), True, (0, 0))] * 2


def test_a_call_in_a_new_form_is_checked_in_full():
    kv = local_store()
    refill(kv)
    with pytest.raises(ArgumentTypeError):
        kv.pushpull([0, 1, 2], [np.ones(3, F32), "no array", np.ones(5, F32)])


PUSH_PULL_BAD = {
    "push shape": lambda kv: kv.push([0, 1, 2], [np.ones(4, F32), *values()[1:]]),
    "push dtype": lambda kv: kv.push([0, 1, 2], values(dtype=np.float64)),
    "push bad row id": lambda kv: kv.push([0, 1, 2], [RowSparse(np.ones((1,), F32), np.array([5]), (3,)),
                                                     *values()[1:]]),
    "pull shape": lambda kv: kv.pull([0, 1, 2], out=[np.zeros(4, F32), *values()[1:]]),
    "pull dtype": lambda kv: kv.pull([0, 1, 2], out=values(dtype=np.float16)),
    "pull key not initialised": lambda kv: kv.pull([0, 1, 8], out=values()),
    "pull sparse out": lambda kv: kv.pull([0, 1, 2], out=[torch.zeros(3).to_sparse(), *values()[1:]]),
}


@pytest.mark.parametrize("bad", sorted(PUSH_PULL_BAD))
def test_push_and_pull_have_plans_that_refuse_bad_input_as_without_one(bad):
    expected = refusal(lambda: PUSH_PULL_BAD[bad](local_store()))
    kv = local_store()
    outs = values(0.0)
    for step in range(2):
        kv.push([0, 1, 2], values(step + 1.0))
        kv.pull([0, 1, 2], out=outs)
        assert all((o == step + 1.0).all() for o in outs)
    assert len(kv._plans) == 2
    assert refusal(lambda: PUSH_PULL_BAD[bad](kv)) == expected
    assert all((o == 2.0).all() for o in outs)
    kv.pull([0, 1, 2], out=outs, ignore_sparse=False)      # the same dense keys, the same plan
    assert all((o == 2.0).all() for o in outs) and len(kv._plans) == 2


def test_a_call_of_no_keys_is_never_planned():
    kv = local_store()
    for _ in range(2):
        kv.push([], [])
        kv.pushpull([], [], out=[])
    assert len(kv._plans) == 0
