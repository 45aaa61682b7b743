"""kvstore.torch.Trainer with the servers updating for a torch optimizer (its twin:
kvstore.optimizer.torch_twin), in one process (the 'local' store, whose updater is
the servers'): every twin with two param groups and a scheduler trains as torch's
own loop bit for bit; ``state_dict()`` / ``load_state_dict()`` carry the state in
torch's format between the update modes and plain torch; what a twin cannot honour
is refused by name. The 2-worker job: test_torch_twins_job.py."""

import copy

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import kvstore  # noqa: E402
import kvstore.torch as kvtorch  # noqa: E402
from kvstore import optimizer as kvopt  # noqa: E402

STEPS = 6
OPT = torch.optim


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def two_groups(cls, **kw):
    """``cls`` over two param groups (weights; biases without decay at another rate)."""
    def make(params):
        ps = list(params)
        return cls([{"params": [p for p in ps if p.ndim > 1]},
                    {"params": [p for p in ps if p.ndim == 1], "weight_decay": 0.0, "lr": kw["lr"] / 3}], **kw)
    return make


def one_cycle(opt):          # cycles momentum (SGD, RMSprop) or beta1 (Adam, AdamW) by default
    return OPT.lr_scheduler.OneCycleLR(opt, max_lr=[10 * g["lr"] for g in opt.param_groups], total_steps=STEPS + 2)


def step_lr(opt):
    return OPT.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def momentum_on_weights_only(params):
    ps = list(params)
    return OPT.SGD([{"params": [p for p in ps if p.ndim > 1], "momentum": 0.9},
                    {"params": [p for p in ps if p.ndim == 1]}], lr=0.05, weight_decay=1e-2)


CASES = {
    "sgd": (two_groups(OPT.SGD, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-2), one_cycle),
    "sgd-some-momentum": (momentum_on_weights_only, step_lr),
    "sgd-nesterov": (two_groups(OPT.SGD, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2), one_cycle),
    "adam": (two_groups(OPT.Adam, lr=0.01, weight_decay=1e-2, amsgrad=True), one_cycle),
    "adamw": (two_groups(OPT.AdamW, lr=0.01, betas=(0.8, 0.99)), one_cycle),
    "rmsprop": (two_groups(OPT.RMSprop, lr=0.01, momentum=0.5, centered=True, weight_decay=1e-2), one_cycle),
    "adagrad": (two_groups(OPT.Adagrad, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1), step_lr),
    "adadelta": (two_groups(OPT.Adadelta, lr=1.0, rho=0.8, weight_decay=1e-2), step_lr),
}


def batches(steps=STEPS):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(steps)]


def loop(model, stepper, sched, data):
    for x, y in data:
        stepper.zero_grad()
        F.cross_entropy(model(x), y).backward()
        stepper.step()
        if sched is not None:
            sched.step()
    return [p.detach().clone() for p in model.parameters()]


def equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("case", CASES)
def test_every_twin_with_groups_and_a_scheduler_trains_as_torch_bit_for_bit(case):
    make_opt, make_sched = CASES[case]
    model = make_model()
    opt = make_opt(model.parameters())
    want = loop(model, opt, make_sched(opt), batches())
    with kvstore.create("local") as kv:
        model = make_model()
        opt = make_opt(model.parameters())
        trainer = kvtorch.Trainer(model.parameters(), kv, opt, update_on_kvstore=True)
        got = loop(model, trainer, make_sched(opt), batches())
    assert equal(got, want)
    # the comparison can fail: the same loop without the scheduler differs
    model = make_model()
    opt = make_opt(model.parameters())
    assert not equal(loop(model, opt, None, batches()), want)


def _run(make_opt, servers, data, start=None):
    """The Trainer's loop over ``data`` (local store) from ``start`` = (weights, state
    dict) if given (loaded with load_state_dict); returns (weights, state_dict())."""
    model = make_model()
    if start is not None:
        with torch.no_grad():
            for p, w in zip(model.parameters(), start[0]):
                p.copy_(w)
    opt = make_opt(model.parameters())
    with kvstore.create("local") as kv:
        trainer = kvtorch.Trainer(model.parameters(), kv, opt, update_on_kvstore=servers)
        if start is not None:
            trainer.load_state_dict(copy.deepcopy(start[1]))
        weights = loop(model, trainer, None, data)
        return weights, copy.deepcopy(trainer.state_dict())


def _same_state(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i, one in a["state"].items():
        assert one.keys() == b["state"][i].keys(), i
        for name, value in one.items():
            assert torch.equal(value, b["state"][i][name]), (i, name)


@pytest.mark.parametrize("case", CASES)
def test_state_dict_carries_the_state_between_modes_and_plain_torch(case):
    """Half a run in one mode, its state_dict() is torch's own; loaded into a Trainer
    of either mode (or a plain torch optimizer), the second half ends where torch's
    uninterrupted run ends, bit for bit."""
    make_opt, _ = CASES[case]
    data = batches()
    first, second = data[:STEPS // 2], data[STEPS // 2:]
    model = make_model()
    opt = make_opt(model.parameters())
    half = loop(model, opt, None, first)
    half_state = copy.deepcopy(opt.state_dict())
    want = loop(model, opt, None, second)
    want_state = opt.state_dict()
    for servers in (True, False):
        weights, state = _run(make_opt, servers, first)
        assert equal(weights, half)
        _same_state(state, half_state)
        for then in (True, False):
            got, got_state = _run(make_opt, then, second, start=(weights, state))
            assert equal(got, want), (servers, then)
            _same_state(got_state, want_state)
    # a plain torch optimizer takes the servers' state_dict
    weights, state = _run(make_opt, True, first)
    model = make_model()
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights):
            p.copy_(w)
    opt = make_opt(model.parameters())
    opt.load_state_dict(state)
    assert equal(loop(model, opt, None, second), want)


def _refused(make_opt, match, error=kvstore.InvalidArgumentError, model=None):
    model = model or make_model()
    with kvstore.create("local") as kv, pytest.raises(error, match=match):
        kvtorch.Trainer(model.parameters(), kv, make_opt(model), update_on_kvstore=True)


@pytest.mark.parametrize("make_opt, match", [
    (lambda m: OPT.Adam(m.parameters(), fused=True), "param group 0 has fused=True, which the servers' twin cannot "
                                                     "honour"),
    (lambda m: OPT.Adam(m.parameters(), capturable=True), "capturable=True"),
    (lambda m: OPT.SGD(m.parameters(), differentiable=True), "differentiable=True"),
    (lambda m: OPT.SGD(m.parameters(), lr=torch.tensor(0.1, requires_grad=True)), "lr = a tensor .* requires grad"),
    (lambda m: OPT.SGD(list(m.parameters())[:2], lr=0.1), "parameter 2 is in no param group of the torch SGD"),
    (lambda m: OPT.Adam([{"params": list(m.parameters())[:2]},
                         {"params": list(m.parameters())[2:], "decoupled_weight_decay": True}]),
     "param group 1 has decoupled_weight_decay=True"),
])
def test_what_a_twin_cannot_honour_is_refused_at_construction_by_name(make_opt, match):
    _refused(make_opt, match)


def test_an_unknown_hyper_parameter_is_refused_not_dropped():
    opt = OPT.SGD(make_model().parameters(), lr=0.1)
    opt.defaults["lookahead"] = 5          # a hyper-parameter torch's SGD would not have
    for g in opt.param_groups:
        g["lookahead"] = 5
    with pytest.raises(kvstore.InvalidArgumentError, match="hyper-parameter 'lookahead' .* does not know"):
        kvtorch.optimizer_from_torch(opt)


@pytest.mark.parametrize("case", ["sgd", "adamw", "rmsprop"])
def test_bfloat16_parameters_are_stepped_in_bfloat16_as_torch(case):
    """The stores keep a bfloat16 parameter in float32; its twin steps it, and its
    state, in bfloat16 as torch does: the same bits, state_dict() included (bfloat16)."""
    make_opt, make_sched = CASES[case]
    model = make_model().to(torch.bfloat16)
    opt = make_opt(model.parameters())
    data = [(x.to(torch.bfloat16), y) for x, y in batches()]
    want = loop(model, opt, make_sched(opt), data)
    want_state = opt.state_dict()
    with kvstore.create("local") as kv:
        model = make_model().to(torch.bfloat16)
        opt = make_opt(model.parameters())
        trainer = kvtorch.Trainer(model.parameters(), kv, opt, update_on_kvstore=True)
        assert kvtorch.optimizer_from_torch(opt, zip(model.parameters(), range(4))).bfloat16_keys == [0, 1, 2, 3]
        got = loop(model, trainer, make_sched(opt), data)
        _same_state(trainer.state_dict(), want_state)
    assert equal(got, want)


def test_changes_the_servers_cannot_follow_mid_run_are_refused_at_step():
    data = batches(2)
    with kvstore.create("local") as kv:
        model = make_model()
        opt = OPT.SGD(model.parameters(), lr=0.1)           # no momentum: the servers keep no buffer
        trainer = kvtorch.Trainer(model.parameters(), kv, opt, update_on_kvstore=True)
        loop(model, trainer, None, data[:1])
        opt.param_groups[0]["momentum"] = 0.9
        with pytest.raises(kvstore.InvalidArgumentError, match="change the state the servers keep for each key "
                                                               r"\(none -> momentum_buffer\)"):
            loop(model, trainer, None, data[1:])
    with kvstore.create("local") as kv:
        model = make_model()
        opt = OPT.SGD(list(model.parameters())[:2], lr=0.1)
        trainer = kvtorch.Trainer(list(model.parameters())[:2], kv, opt, update_on_kvstore=True)
        opt.add_param_group({"params": list(model.parameters())[2:]})
        with pytest.raises(kvstore.InvalidArgumentError, match="has 2 param groups, 1 when the Trainer was made"):
            loop(model, trainer, None, data[:1])


def test_state_dict_needs_a_torch_optimizer_and_no_flat_buckets():
    with kvstore.create("local") as kv:
        model = make_model()
        trainer = kvtorch.Trainer(model.parameters(), kv, kvopt.SGD(learning_rate=0.1))
        with pytest.raises(kvstore.InvalidArgumentError, match="state_dict: torch's format needs a torch optimizer"):
            trainer.state_dict()
    with kvstore.create("local") as kv:
        model = make_model()
        trainer = kvtorch.Trainer(model.parameters(), kv, OPT.Adam(model.parameters()), update_on_kvstore=True,
                                  flat_buckets=True)
        with pytest.raises(kvstore.InvalidArgumentError, match="load_state_dict: with flat_buckets"):
            trainer.load_state_dict({})


def test_flat_buckets_take_their_parameters_group():
    make_opt, make_sched = CASES["adamw"]
    model = make_model()
    opt = make_opt(model.parameters())
    want = loop(model, opt, make_sched(opt), batches())
    with kvstore.create("local") as kv:       # one bucket per parameter: each keeps its group
        model = make_model()
        opt = make_opt(model.parameters())
        trainer = kvtorch.Trainer(model.parameters(), kv, opt, update_on_kvstore=True, flat_buckets=True,
                                  bucket_bytes=1)
        assert equal(loop(model, trainer, make_sched(opt), batches()), want)
    with kvstore.create("local") as kv:       # one bucket for all: the groups differ
        model = make_model()
        with pytest.raises(kvstore.InvalidArgumentError, match=r"parameters \d \(param group \d\) and \d \(param "
                                                               r"group \d\) share bucket"):
            kvtorch.Trainer(model.parameters(), kv, make_opt(model.parameters()), update_on_kvstore=True,
                            flat_buckets=True)
