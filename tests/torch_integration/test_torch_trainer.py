"""kvstore.torch.Trainer: W workers on batches of b train exactly like one process
on batches of W*b (dist_sync, both update_on_kvstore modes), starting from rank 0's
parameters; the 'local' store runs the same loop."""

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import kvstore  # noqa: E402
import kvstore.torch as kvtorch  # noqa: E402
from kvstore import optimizer as kvopt  # noqa: E402

W, B, STEPS = 2, 4, 4


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def batches():
    rng = np.random.default_rng(42)
    for _ in range(STEPS):
        x = torch.from_numpy(rng.standard_normal((W * B, 6)).astype(np.float32))
        y = torch.from_numpy(rng.integers(0, 3, W * B))
        yield x, y


def train(model, trainer, rank, size):
    """The training loop users write; each worker takes its slice of every batch."""
    per = W * B // size
    for x, y in batches():
        trainer.zero_grad()
        F.cross_entropy(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
        trainer.step()
    return [p.detach().clone() for p in model.parameters()]


def reference_torch(make_opt):
    model = make_model()
    opt = make_opt(model.parameters())
    for x, y in batches():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def run_dist(make_cluster, make_trainer_args, store="dist_sync", loop=train):
    """Every worker's result of ``loop(model, trainer, rank, size)`` (the training
    loop; :func:`train` by default)."""
    models = [make_model(seed=0 if r == 0 else 100 + r) for r in range(W)]  # only rank 0's survive
    cluster = make_cluster(W, 2, chunk_bytes=64)

    def job(kv):
        model = models[kv.rank]
        opt, kwargs = make_trainer_args(model)
        trainer = kvtorch.Trainer(model.parameters(), kv, opt, **kwargs)
        return loop(model, trainer, kv.rank, kv.num_workers)
    return cluster.run(job, store)


def assert_same(got, want):
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


SGD = dict(lr=0.1, momentum=0.9, weight_decay=1e-3)


@pytest.mark.parametrize("overlap", [True, False])
def test_servers_run_the_optimizer(make_cluster, overlap):
    want = reference_torch(lambda ps: torch.optim.SGD(ps, **SGD))
    results = run_dist(make_cluster, lambda m: (torch.optim.SGD(m.parameters(), **SGD),
                                                {"update_on_kvstore": True, "overlap": overlap}))
    for got in results:
        assert_same(got, want)


@pytest.mark.parametrize("overlap", [True, False])
def test_workers_run_their_torch_optimizer_on_the_averaged_gradient(make_cluster, overlap):
    want = reference_torch(lambda ps: torch.optim.Adam(ps, lr=0.01))
    results = run_dist(make_cluster, lambda m: (torch.optim.Adam(m.parameters(), lr=0.01),
                                                {"overlap": overlap}))
    for got in results:
        assert_same(got, want)


def test_overlap_sends_buckets_during_backward(make_cluster):
    """With overlap=True each full bucket's pushpull starts from its gradient's hook,
    while backward goes on; backward returns with every exchange finished, so step()
    starts none."""
    cluster = make_cluster(W, 1)

    def job(kv):
        model = make_model()
        trainer = kvtorch.Trainer(model.parameters(), kv, torch.optim.SGD(model.parameters(), lr=0.1),
                                  bucket_bytes=1)         # every gradient is a full bucket
        arrived, when = [], []
        for p in model.parameters():       # after the Trainer's hooks: counts the gradients
            p.register_post_accumulate_grad_hook(lambda p: arrived.append(1))
        calls = kv.pushpull_async
        kv.pushpull_async = lambda *a, **k: when.append(len(arrived)) or calls(*a, **k)
        trainer.zero_grad()
        F.cross_entropy(model(torch.ones(B, 6)), torch.zeros(B, dtype=torch.long)).backward()
        started, pending = list(when), len(trainer._handles)
        trainer.step()
        return started, pending, len(when)
    for started, pending, after_step in cluster.run(job):
        # one per parameter, each before the next gradient arrived
        assert started == list(range(len(list(make_model().parameters()))))
        assert pending == 0 and after_step == len(started)


@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_gradients_accumulated_over_two_backward_passes(make_cluster, update_on_kvstore):
    """overlap=False and no_sync(): two backward passes on half batches (loss
    halved), the first inside no_sync(), then one step (a single pushpull, when the
    second backward ends), train like one process on the whole batch
    (test_torch_habits.py: every bucket layout)."""
    want = reference_torch(lambda ps: torch.optim.SGD(ps, **SGD))
    models = [make_model(seed=0 if r == 0 else 100 + r) for r in range(W)]
    cluster = make_cluster(W, 2, chunk_bytes=64)

    def job(kv):
        model, per = models[kv.rank], B
        trainer = kvtorch.Trainer(model.parameters(), kv, torch.optim.SGD(model.parameters(), **SGD),
                                  update_on_kvstore=update_on_kvstore, overlap=False)
        for x, y in batches():
            mine, labels = x[kv.rank * per:(kv.rank + 1) * per], y[kv.rank * per:(kv.rank + 1) * per]
            trainer.zero_grad()
            with trainer.no_sync():
                (F.cross_entropy(model(mine[:per // 2]), labels[:per // 2]) / 2).backward()
            (F.cross_entropy(model(mine[per // 2:]), labels[per // 2:]) / 2).backward()
            trainer.step()
        return [p.detach().clone() for p in model.parameters()]
    for got in cluster.run(job, "dist_sync"):
        assert_same(got, want)


def test_kvstore_optimizer_on_servers_equals_the_local_store(make_cluster):
    adam = kvopt.Adam(learning_rate=0.01, wd=1e-4)
    with kvstore.create("local") as kv:
        model = make_model()
        want = train(model, kvtorch.Trainer(model.parameters(), kv, adam), 0, 1)
    for got in run_dist(make_cluster, lambda m: (adam, {})):
        assert_same(got, want)


def test_local_store_runs_the_identical_loop():
    want = reference_torch(lambda ps: torch.optim.SGD(ps, **SGD))
    with kvstore.create("local") as kv:
        model = make_model()
        trainer = kvtorch.Trainer(model.named_parameters(), kv,
                                  torch.optim.SGD(model.parameters(), **SGD))
        assert_same(train(model, trainer, 0, 1), want)


def test_unsupported_server_optimizer_is_a_clear_error():
    class MySGD(torch.optim.SGD):       # a subclass may change the step: no twin
        pass
    with kvstore.create("local") as kv:
        model = make_model()
        for opt in (torch.optim.NAdam(model.parameters()), MySGD(model.parameters())):
            with pytest.raises(kvstore.ArgumentTypeError, match="twins of torch.optim.SGD, .* not .*update_on_kvstore"
                                                                "=False"):
                kvtorch.Trainer(model.parameters(), kv, opt, update_on_kvstore=True)


def test_states_save_and_load_resume_exactly(tmp_path):
    path = str(tmp_path / "states")
    for update_on_kvstore in (True, False):
        with kvstore.create("local") as kv:
            model = make_model()
            trainer = kvtorch.Trainer(model.parameters(), kv, torch.optim.SGD(model.parameters(), **SGD),
                                      update_on_kvstore=update_on_kvstore)
            data = list(batches())
            for x, y in data[:2]:
                trainer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                trainer.step()
            trainer.save_states(path)
            snapshot = [p.detach().clone() for p in model.parameters()]
            for x, y in data[2:]:
                trainer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                trainer.step()
            want = [p.detach().clone() for p in model.parameters()]
        with kvstore.create("local") as kv:
            model = make_model(seed=7)
            with torch.no_grad():
                for p, s in zip(model.parameters(), snapshot):
                    p.copy_(s)
            trainer = kvtorch.Trainer(model.parameters(), kv, torch.optim.SGD(model.parameters(), **SGD),
                                      update_on_kvstore=update_on_kvstore)
            trainer.load_states(path)
            for x, y in data[2:]:
                trainer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                trainer.step()
            assert_same([p.detach() for p in model.parameters()], want)


@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_frozen_parameters_are_neither_exchanged_nor_updated(update_on_kvstore):
    """As in plain torch (and DDP): weight decay and momentum never touch a frozen
    layer, and the trained layer follows the same steps."""
    def train(use_trainer):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        for p in model[0].parameters():
            p.requires_grad_(False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
        frozen = model[0].weight.detach().clone()
        x = torch.randn(8, 4)
        with kvstore.create("local") as kv:
            trainer = kvtorch.Trainer(model.parameters(), kv, opt,
                                      update_on_kvstore=update_on_kvstore) if use_trainer else None
            for _ in range(3):
                (trainer or opt).zero_grad()
                model(x).pow(2).mean().backward()
                (trainer or opt).step()
        assert torch.equal(model[0].weight, frozen)
        return model[1].weight.detach().clone()

    torch.testing.assert_close(train(True), train(False))


def train_with_scheduler(model, trainer, opt, rank, size, sched=None):
    """train() with a torch LR scheduler (by default StepLR, gamma 0.1) stepped after
    every step, as users do."""
    sched = sched or torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    per = W * B // size
    for x, y in batches():
        trainer.zero_grad()
        F.cross_entropy(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
        trainer.step()
        sched.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("update_on_kvstore", [True, False])
@pytest.mark.parametrize("overlap", [True, False])
def test_a_torch_lr_scheduler_is_followed_in_both_update_modes(make_cluster, update_on_kvstore, overlap):
    def reference():
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), **SGD)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
        for x, y in batches():
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()
        return [p.detach().clone() for p in model.parameters()]

    models = [make_model(seed=0 if r == 0 else 100 + r) for r in range(W)]

    def job(kv):
        model = models[kv.rank]
        opt = torch.optim.SGD(model.parameters(), **SGD)
        trainer = kvtorch.Trainer(model.parameters(), kv, opt, update_on_kvstore=update_on_kvstore,
                                  overlap=overlap)
        return train_with_scheduler(model, trainer, opt, kv.rank, kv.num_workers)

    want = reference()
    for got in make_cluster(W, 2, chunk_bytes=64).run(job):
        assert_same(got, want)


def test_set_learning_rate_keeps_the_momentum(make_cluster):
    def job(kv):
        kv.init("w", np.zeros(3, np.float32))
        kv.set_optimizer(kvopt.SGD(learning_rate=1.0, momentum=0.5))
        out = np.empty(3, np.float32)
        kv.pushpull("w", np.ones(3, np.float32), out=out)          # mom = -W; w = -W
        kv.set_learning_rate(0.1)
        kv.pushpull("w", np.ones(3, np.float32), out=out)          # mom = -W/2 - 0.1 W
        return out

    for kind in ("local", "dist_sync"):
        workers = 1 if kind == "local" else W
        if kind == "local":
            with kvstore.create("local") as kv:
                out = job(kv)
            results = [out]
        else:
            results = make_cluster(W, 2).run(job)
        for out in results:
            np.testing.assert_allclose(out, -workers - (0.5 * workers + 0.1 * workers), rtol=1e-6)
    with kvstore.create("local") as kv:
        with pytest.raises(kvstore.KVStoreError, match="set_learning_rate: no optimizer is set"):
            kv.set_learning_rate(0.1)


def test_the_communication_thread_starts_every_bucket_and_trains_the_same(make_cluster):
    """CUDA models start their exchanges from a communication thread (autograd runs
    their hooks on device threads); forced here on a CPU model, the thread starts
    every bucket and the weights are those of the inline path."""
    want = reference_torch(lambda ps: torch.optim.SGD(ps, **SGD))
    models = [make_model(seed=0 if r == 0 else 100 + r) for r in range(W)]
    threads = [set() for _ in range(W)]

    def job(kv):
        model = models[kv.rank]
        trainer = kvtorch.Trainer(model.parameters(), kv, torch.optim.SGD(model.parameters(), **SGD),
                                  bucket_bytes=1)
        trainer._use_comm = True
        start = trainer._start
        trainer._start = lambda indices, main=None: (threads[kv.rank].add(threading.current_thread().name),
                                                     start(indices, main))
        return train(model, trainer, kv.rank, kv.num_workers)

    for got in make_cluster(W, 2, chunk_bytes=64).run(job):
        assert_same(got, want)
    assert threads == [{"kvstore-trainer-comm"}] * W      # every bucket, none inline


def test_a_failure_on_the_communication_thread_is_raised_by_backward(make_cluster):
    """...which waits for the communication thread's exchanges as it ends."""
    def job(kv):
        model = make_model()
        trainer = kvtorch.Trainer(model.parameters(), kv, torch.optim.SGD(model.parameters(), lr=0.1),
                                  bucket_bytes=1)
        trainer._use_comm = True
        trainer._start = lambda indices, main=None: (_ for _ in ()).throw(RuntimeError("boom on the comm thread"))
        trainer.zero_grad()
        with pytest.raises(RuntimeError, match="boom on the comm thread"):
            F.cross_entropy(model(torch.ones(B, 6)), torch.zeros(B, dtype=torch.long)).backward()
    with kvstore.create("local") as kv:
        job(kv)


# -- per-parameter rates and weight decay on the servers (issue 44 item 6; torch's groups: issue 43) ---------------------

def _grouped(params):
    """The usual recipe: no weight decay on biases, the last layer at a tenth of the rate."""
    ps = list(params)
    biases = [p for p in ps if p.ndim == 1]
    last = [p for p in ps if p.ndim > 1][-1:]
    rest = [p for p in ps if p.ndim > 1 and all(p is not q for q in last)]
    return torch.optim.SGD([{"params": rest}, {"params": last, "lr": 0.01},
                            {"params": biases, "weight_decay": 0.0}], lr=0.1, momentum=0.9, weight_decay=1e-2)


def test_torch_param_groups_become_each_keys_group_on_the_servers(make_cluster):
    want = reference_torch(lambda ps: _grouped(ps))
    results = run_dist(make_cluster, lambda m: (_grouped(m.parameters()), {"update_on_kvstore": True}))
    for got in results:
        assert_same(got, want)
    # the groups matter: one group would train otherwise
    assert not torch.allclose(reference_torch(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9,
                                                                         weight_decay=1e-2))[0], want[0])
    # the servers' optimizer: torch's SGD, every group's hyper-parameters, each key's group
    model = make_model()
    o = kvtorch.optimizer_from_torch(_grouped(model.parameters()), zip(model.parameters(), range(4)))
    assert type(o) is kvopt.TorchSGD and o.key_groups == {1: 2, 2: 1, 3: 2}
    assert [(g["lr"], g["weight_decay"], g["momentum"]) for g in o.groups] == [(0.1, 1e-2, 0.9), (0.01, 1e-2, 0.9),
                                                                                (0.1, 0.0, 0.9)]


def _steps_alike(make_opt, sched=None):
    """The weights of torch's own loop and of the Trainer's (local store, servers
    updating) with the optimizer ``make_opt(params)`` and the scheduler ``sched(opt)``."""
    def loop(model, stepper, opt):
        s = sched(opt) if sched else None
        for x, y in batches():
            stepper.zero_grad()
            F.cross_entropy(model(x), y).backward()
            stepper.step()
            if s is not None:
                s.step()
        return [p.detach().clone() for p in model.parameters()]
    model = make_model()
    opt = make_opt(model.parameters())
    want = loop(model, opt, opt)
    with kvstore.create("local") as kv:
        model = make_model()
        opt = make_opt(model.parameters())
        got = loop(model, kvtorch.Trainer(model.parameters(), kv, opt, update_on_kvstore=True), opt)
    return got, want


def test_param_groups_follow_any_torch_scheduler_bit_for_bit():
    """A scheduler that changes each group its own way (LambdaLR with a lambda per
    group): every group's rate reaches the servers before the step it applies to."""
    got, want = _steps_alike(_grouped, lambda o: torch.optim.lr_scheduler.LambdaLR(
        o, [lambda e: 1.0, lambda e: 0.5 ** e, lambda e: 1.0 + e]))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_param_groups_that_differ_in_momentum_train_as_torch():
    def make(params):
        ps = list(params)
        return torch.optim.SGD([{"params": ps[:2]}, {"params": ps[2:], "momentum": 0.5, "dampening": 0.1}],
                               lr=0.1, momentum=0.9, nesterov=False)
    got, want = _steps_alike(make)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_kvstore_optimizer_takes_multipliers_by_parameter_name():
    """No weight decay on biases, by name (named_parameters: the keys are the names):
    what torch computes with a param group of biases at weight_decay=0."""
    want = reference_torch(lambda ps: _grouped(ps))
    with kvstore.create("local") as kv:
        model = make_model()
        names = [n for n, _ in model.named_parameters()]
        o = kvopt.SGD(learning_rate=0.1, momentum=0.9, wd=1e-2, nesterov=False,
                      wd_mult={n: 0.0 for n, p in model.named_parameters() if p.ndim == 1},
                      lr_mult={names[2]: 0.1})
        trainer = kvtorch.Trainer(model.named_parameters(), kv, o)
        assert_same(train(model, trainer, 0, 1), want)


def test_flat_buckets_carry_their_parameters_multipliers_or_refuse_a_mixed_bucket():
    want = reference_torch(lambda ps: _grouped(ps))
    with kvstore.create("local") as kv:       # one bucket per parameter: each keeps its own
        model = make_model()
        trainer = kvtorch.Trainer(model.parameters(), kv, _grouped(model.parameters()), update_on_kvstore=True,
                                  flat_buckets=True, bucket_bytes=1)
        assert_same(train(model, trainer, 0, 1), want)
    with kvstore.create("local") as kv:       # one bucket for all: biases and weights differ
        model = make_model()
        with pytest.raises(kvstore.InvalidArgumentError, match="flat_buckets: parameters .* share bucket"):
            kvtorch.Trainer(model.parameters(), kv, _grouped(model.parameters()), update_on_kvstore=True,
                            flat_buckets=True)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_sparse_embedding_with_torch_sgd_moves_every_row_as_torch(momentum):
    """torch's SGD keeps a sparse gradient's momentum for every row it ever named (row
    0 keeps moving after its last gradient): the servers' SGD is lazy_update=False."""
    def run(trainer_kv=None):
        torch.manual_seed(0)
        emb = nn.Embedding(5, 3, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1, momentum=momentum)
        trainer = kvtorch.Trainer(emb.parameters(), trainer_kv, opt, update_on_kvstore=True) if trainer_kv else None
        for ids in ([0, 2], [1], [1, 3]):
            (trainer or opt).zero_grad()
            emb(torch.tensor(ids)).sum().backward()
            (trainer or opt).step()
        return emb.weight.detach().clone()

    want = run()
    with kvstore.create("local") as kv:
        got = run(kv)
    torch.testing.assert_close(got, want)


def test_a_sparse_embedding_with_a_kvstore_sgd_moves_only_the_rows_of_each_gradient():
    """MXNet's lazy_update (SGD's default): row 0, named at the first step only, keeps
    the value of that step, weight decay and momentum included."""
    torch.manual_seed(0)
    emb = nn.Embedding(5, 3, sparse=True)
    with kvstore.create("local") as kv:
        trainer = kvtorch.Trainer(emb.parameters(), kv, kvopt.SGD(learning_rate=0.1, momentum=0.9, wd=0.1))
        seen = []
        for ids in ([0, 2], [1], [1, 3]):
            trainer.zero_grad()
            emb(torch.tensor(ids)).sum().backward()
            trainer.step()
            seen.append(emb.weight.detach().clone())
    torch.testing.assert_close(seen[2][0], seen[0][0], rtol=0, atol=0)
    torch.testing.assert_close(seen[2][4], seen[0][4], rtol=0, atol=0)     # never named
    assert not torch.equal(seen[1][1], seen[0][1])
