"""The servers' twins of torch.optim (kvstore.optimizer.torch_twin): each twin,
run through an Updater on chunks of every parameter (as servers hold them: a key
bigger than a chunk is updated chunk by chunk, here at odd chunk sizes), with
two param groups that differ in every hyper-parameter they can, equals
torch.optim's own step (CPU, float32, foreach=False) bit for bit, step after step;
their configs round trip through msgpack; what torch refuses they refuse."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvstore import optimizer as kvopt  # noqa: E402
from kvstore.errors import ConfigError  # noqa: E402

OPT = torch.optim
SHAPES = [(37,), (5, 13), (300,)]
GROUP_OF = [0, 1, 0]          # parameter -> param group

# (torch class, twin name, constructor arguments, [group 0's, group 1's hyper-parameters])
CASES = [
    (OPT.SGD, "torch_sgd", {}, [dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-2),
                              dict(lr=0.05, momentum=0.8, nesterov=True)]),
    (OPT.SGD, "torch_sgd", {}, [dict(lr=0.1, maximize=True), dict(lr=0.05, weight_decay=0.1)]),
    (OPT.Adam, "torch_adam", {}, [dict(lr=1e-2, weight_decay=1e-2, amsgrad=True),
                                dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, maximize=True)]),
    (OPT.AdamW, "torch_adamw", {}, [dict(lr=1e-2, weight_decay=1e-2), dict(lr=3e-3, weight_decay=0.0, amsgrad=True)]),
    (OPT.RMSprop, "torch_rmsprop", {}, [dict(lr=1e-2, centered=True, momentum=0.9, weight_decay=0.01),
                                      dict(lr=3e-3, alpha=0.9, maximize=True)]),
    (OPT.Adagrad, "torch_adagrad", {"initial_accumulator_value": 0.1},
     [dict(lr=0.1, lr_decay=0.01, weight_decay=0.01), dict(lr=3e-2, eps=1e-8, maximize=True)]),
    (OPT.Adadelta, "torch_adadelta", {}, [dict(lr=1.0, rho=0.8, weight_decay=0.01), dict(lr=0.5, maximize=True)]),
]
IDS = [f"{c[1]}-{i}" for i, c in enumerate(CASES)]


def twin_for(torch_opt, name, rescale_grad=1.0, perturb=1.0, bfloat16_keys=None):
    """The twin of ``torch_opt`` (its constructor's values on top, its groups), keys
    0, 1, 2 in the groups of GROUP_OF; ``perturb`` multiplies every group's lr."""
    cls = type(kvopt.from_config({"name": name}))
    top = {k: (list(v) if isinstance(v, tuple) else v) for k, v in torch_opt.defaults.items() if k in cls.fields}
    groups = [{k: v * perturb if k == "lr" else list(v) if isinstance(v, tuple) else v
               for k, v in g.items() if k in cls.fields} for g in torch_opt.param_groups]
    return kvopt.create(name, rescale_grad=rescale_grad, groups=groups, bfloat16_keys=bfloat16_keys,
                        key_groups={k: g for k, g in enumerate(GROUP_OF)}, **top)


def run(case, *, steps=5, chunk=17, dtype=torch.float32, rescale=1, perturb=1.0, twin_hook=None, mark_bf16=True):
    """torch.optim's parameters and the twin's (numpy, updated chunk by chunk) after
    ``steps`` steps on the same gradients (``rescale`` > 1: the twin gets the sum
    over ``rescale`` workers and rescale_grad 1/rescale, torch the sum ``div_``ided
    by ``rescale``, as the Trainer's workers average)."""
    cls, name, ctor, hyper = case
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]
    bf16 = dtype == torch.bfloat16            # the stores keep bfloat16 keys in float32
    flat = [(p.detach().float() if bf16 else p.detach()).numpy().reshape(-1).copy() for p in params]
    groups = [{"params": [p for p, g in zip(params, GROUP_OF) if g == i], **h} for i, h in enumerate(hyper)]
    torch_opt = cls(groups, foreach=False, **ctor)
    updater = kvopt.Updater(twin_for(torch_opt, name, 1.0 / rescale if rescale != 1 else 1.0, perturb,
                                     bfloat16_keys=list(range(len(SHAPES))) if bf16 and mark_bf16 else None))
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=gen).to(dtype) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone() if rescale == 1 else g.clone().div_(rescale)
        torch_opt.step()
        for key, (w, g) in enumerate(zip(flat, grads)):
            pushed = (g.float() if bf16 else g).numpy().reshape(-1)
            for c, start in enumerate(range(0, w.size, chunk)):
                updater((key, c), pushed[start:start + chunk], w[start:start + chunk])
        if twin_hook is not None:
            updater = twin_hook(updater)
    return [p.detach().float().numpy().reshape(-1) for p in params], flat, torch_opt, updater


def same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_each_twin_equals_torch_optim_bit_for_bit_chunk_by_chunk_with_param_groups(case):
    want, got, _, _ = run(case)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)
    # the comparison sees a 10% error: the same run with every lr 10% off differs
    _, off, _, _ = run(case, perturb=1.1)
    assert not same(off, want)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_average_over_workers_is_torchs_division(case):
    """rescale_grad 1/3 (the Trainer's average over 3 workers) divides the summed
    gradient by 3 with torch's div, as the workers' own average does."""
    want, got, _, _ = run(case, rescale=3)
    assert same(got, want)


@pytest.mark.parametrize("case", [c for c in CASES if c[1] in ("torch_sgd", "torch_adam", "torch_adadelta")],
                         ids=["sgd", "sgd-max", "adam", "adadelta"])
def test_float16_weights_are_updated_in_float16_as_torch(case):
    """torch steps a float16 parameter in float16 (its state too): so does the twin,
    bit for bit for chunks that start at multiples of 64 elements (torch's vectorised
    and scalar loops round float16 differently, so a chunk boundary elsewhere may move
    the last elements of a chunk by an ulp)."""
    want, got, _, _ = run(case, dtype=torch.float16, chunk=64)
    assert same(got, want)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_bfloat16_keys_are_stepped_in_bfloat16_as_torch(case):
    """A bfloat16 parameter, kept in float32 by the stores, listed in bfloat16_keys:
    the twin steps it (and its state) in bfloat16, as torch, bit for bit for chunks
    that start at multiples of 64 elements; at rescale 1/3 too (the summed gradient
    rounded to bfloat16, then torch's div, as the workers' .grad)."""
    want, got, _, _ = run(case, dtype=torch.bfloat16, chunk=64)
    assert same(got, want)
    # the comparison sees it: the keys not listed (stepped in float32) end elsewhere
    assert not same(run(case, dtype=torch.bfloat16, chunk=64, mark_bf16=False)[1], want)
    want, got, _, _ = run(case, dtype=torch.bfloat16, chunk=64, rescale=3)
    assert same(got, want)


def test_states_round_trip_through_the_updater_and_resume_exactly():
    """Mid-run, the twin's state (get_states, into a fresh Updater by set_states, as
    a checkpoint does) carries on exactly."""
    def restart(updater):
        fresh = kvopt.Updater(kvopt.from_config(updater.optimizer.to_config()))
        fresh.set_states({k: {"t": v["t"], "state": [s.copy() for s in v["state"]]}
                          for k, v in updater.get_states().items()})
        return fresh
    for case in CASES:
        want, got, _, _ = run(case, twin_hook=restart)
        assert same(got, want), case[1]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_configs_round_trip_through_msgpack(case):
    cls, name, ctor, hyper = case
    p = [torch.nn.Parameter(torch.zeros(2)) for _ in SHAPES]
    torch_opt = cls([{"params": [p[0], p[2]], **hyper[0]}, {"params": [p[1]], **hyper[1]}], **ctor)
    twin = twin_for(torch_opt, name)
    config = twin.to_config()
    wire = msgpack.unpackb(msgpack.packb(config, strict_types=False), strict_map_key=False)
    assert kvopt.from_config(wire).to_config() == config == wire
    assert twin.key_groups == {1: 1}        # group 0 is the default


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_twins_defaults_are_torchs(case):
    cls, name, _, _ = case
    twin_cls = type(kvopt.from_config({"name": name}))
    defaults = cls([torch.nn.Parameter(torch.zeros(1))]).defaults
    for field, (default, _) in twin_cls.fields.items():
        d = defaults[field]
        assert (list(d) if isinstance(d, tuple) else d) == default, (name, field)
    assert twin_cls.torch_name == cls.__name__


@pytest.mark.parametrize("name, bad, match", [
    ("torch_sgd", dict(lr=-0.1), "lr must be"),
    ("torch_sgd", dict(nesterov=True), "nesterov momentum requires a momentum"),
    ("torch_sgd", dict(momentum=0.9, dampening=0.1, nesterov=True), "zero dampening"),
    ("torch_adam", dict(betas=(0.9, 1.0)), r"betas\[1\] must be"),
    ("torch_adam", dict(betas=0.9), "betas must be a pair"),
    ("torch_adamw", dict(eps=-1.0), "eps must be"),
    ("torch_adamw", dict(amsgrad=1), "amsgrad must be True or False"),
    ("torch_adadelta", dict(rho=1.5), "rho must be"),
    ("torch_adagrad", dict(lr_decay=-1.0), "lr_decay must be"),
    ("torch_rmsprop", dict(momentum=-0.1), "momentum must be"),
    ("torch_sgd", dict(learning_rate=0.1), "unknown parameter"),
    ("torch_sgd", dict(wd=0.1), "unknown parameter"),
    ("torch_sgd", dict(groups=[{"betas": [0.9, 0.99]}]), r"groups\[0\] has unknown hyper-parameter\(s\) betas"),
    ("torch_sgd", dict(groups=[{}, {"lr": -1.0}]), r"groups\[1\]: lr must be"),
    ("torch_sgd", dict(groups=[]), "groups must be a non-empty list"),
    ("torch_sgd", dict(key_groups={0: 1}), r"key_groups\[0\] must be a group index in 0..0"),
    ("torch_sgd", dict(key_groups={1.5: 0}), "key_groups' keys must be store keys"),
])
def test_what_torch_refuses_the_twins_refuse(name, bad, match):
    with pytest.raises(ConfigError, match=match):
        kvopt.create(name, **bad)


def test_a_twin_takes_no_mxnet_schedule_and_is_never_lazy():
    with pytest.raises(ConfigError, match="torch's schedulers run on the workers"):
        kvopt.create("torch_sgd", lr_scheduler=kvopt.FactorScheduler(step=10))
    twin = kvopt.create("torch_adam")
    assert not twin.lazy_for(row_sparse_key=True) and not twin.lazy_for(row_sparse_key=False)
    assert twin.with_learning_rate(0.5).groups[0]["lr"] == 0.5


def test_state_layout_names_torchs_state_for_every_group():
    sgd = kvopt.create("torch_sgd", groups=[{"momentum": 0.9}, {"momentum": 0.0}])
    assert (sgd.num_states, sgd.state_layout(), sgd.used_states(sgd.groups[1])) == (1, ("momentum_buffer",), ())
    assert kvopt.create("torch_sgd").num_states == 0
    adam = kvopt.create("torch_adam", groups=[{}, {"amsgrad": True}])
    assert adam.state_layout() == ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    assert adam.used_states(adam.groups[0]) == ("exp_avg", "exp_avg_sq")
    rms = kvopt.create("torch_rmsprop", groups=[{"centered": True}, {}])
    assert rms.state_layout() == ("square_avg", "grad_avg")


def test_a_servers_checkpoint_of_a_twin_resumes_exactly():
    """The servers' side of a checkpoint (kvstore.server.server_optimizer.ServerOptimizer,
    pure): a twin's per-chunk state saved mid-run, restored into a fresh server with
    the checkpoint's config and the job's same set_optimizer, goes on as if never
    stopped; a set_optimizer with other groups and keep_state (a scheduler's change)
    keeps it too."""
    from kvstore.server.server_optimizer import ServerOptimizer

    twin = kvopt.create("torch_adamw", lr=1e-2, groups=[{}, {"weight_decay": 0.0, "amsgrad": True}],
                        key_groups={"b": 1})
    rng = np.random.default_rng(0)
    grads = [{k: rng.standard_normal(40).astype(np.float32) for k in "wb"} for _ in range(4)]

    def steps(index, values, rounds):
        for g in rounds:
            for k in "wb":
                for c in range(2):
                    index.updater((k, c), g[k][c * 20:(c + 1) * 20], values[k][c * 20:(c + 1) * 20])

    straight = ServerOptimizer()
    straight.set({"optimizer": twin.to_config()})
    want = {k: np.ones(40, np.float32) for k in "wb"}
    steps(straight, want, grads)

    first = ServerOptimizer()
    first.set({"optimizer": twin.to_config()})
    got = {k: np.ones(40, np.float32) for k in "wb"}
    steps(first, got, grads[:2])
    saved = {cid: {"t": e["t"], "state": [s.copy() for s in e["state"]]}
             for cid, e in first.updater.get_states().items()}
    resumed = ServerOptimizer()
    resumed.restore(first.config(), saved)
    resumed.set({"optimizer": twin.to_config()})          # the job's set_optimizer: the same twin, state kept
    steps(resumed, got, grads[2:])
    for k in "wb":
        np.testing.assert_array_equal(got[k], want[k])
    # new hyper-parameters for the same twin (keep_state) keep every chunk's state and count
    resumed.set({"optimizer": twin.with_groups([{"lr": 5e-3}, {"weight_decay": 0.0, "amsgrad": True}]).to_config(),
                 "keep_state": True})
    assert {cid: e["t"] for cid, e in resumed.updater.get_states().items()} == {(k, c): 4 for k in "wb"
                                                                               for c in range(2)}
