"""Write MXNet 1.9.1's own optimizer updates to a JSON fixture for the tests.

Runs under MXNet's interpreter (not ours: it imports nothing from this repository),
e.g. the peers' virtual environment::

    python -m venv benchmarks/.venv-mxnet       # or: python -m benchmarks.pushpull --setup-peers
    benchmarks/.venv-mxnet/bin/pip install mxnet==1.9.1 numpy==1.23.5
    benchmarks/.venv-mxnet/bin/python benchmarks/harness/peers/mxnet_optimizer_fixture.py \\
        tests/data/mxnet_optimizers.json

For every case below it runs ``mx.optimizer.create(name, **params)`` on one weight
for a few steps of fixed gradients (``update_multi_precision``, so float16 cases go
through MXNet's float32 master copy) and records the weight after every step and
the state arrays after the last (MXNet's order, ``None`` entries dropped, the
master copy first: SGD's, NAG's and LARS's reordered). tests/optimizer/test_optimizer_mxnet.py replays the cases through
``kvstore.optimizer``. SGLD's noise is replaced by recorded standard normals
(``normal`` in MXNet's optimizer module returns ``loc + scale * z``), so the
fixture checks the deterministic part and the noise's scale; the test feeds our
SGLD the same ``z``. The ``ftrl`` row-sparse case updates a row-sparse weight
with row-sparse gradients: MXNet's lazy ``ftrl_update``.

Besides the cases (issue 44): ``scenarios``, MXNet runs of one weight whose learning
rate changes (a scheduler of any kind, ``set_learning_rate`` before some steps), with
the rate of every step; ``schedules``, MXNet's schedulers called for ``t = 1, 2, ...``;
``kvstore_row_sparse``, MXNet's local KVStore with an optimizer fed row-sparse pushes,
some of no rows; ``kvstore_lazy``, row-sparse pushes to a dense key (and to a row-sparse
key) with ``lazy_update`` True and False, the weight after every step (issue 44 item 2);
``multipliers``, per-parameter ``lr_mult`` / ``wd_mult`` / ``param_idx2name`` /
``param_dict`` / ``begin_num_update`` through MXNet's local KVStore (issue 44 item 6).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import mxnet as mx
import mxnet.optimizer.optimizer as mx_opt
import numpy as np

N, STEPS = 10, 5

# (optimizer, params, extras); extras: dtype, scheduler (FactorScheduler kwargs), slot (the
# weight's name). A case's data are seeded by its position: add new cases at the end.
CASES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [   # (optimizer, its parameters, extras)
    ("signum", {}, {}),
    ("signum", {"learning_rate": 0.05, "momentum": 0.8, "wd": 0.01, "wd_lh": 0.02,
                "rescale_grad": 0.5, "clip_gradient": 0.4}, {}),
    ("signum", {"learning_rate": 0.1, "momentum": 0.0, "wd": 0.05}, {}),
    ("ftml", {}, {}),
    ("ftml", {"learning_rate": 0.05, "beta1": 0.5, "beta2": 0.99, "epsilon": 1e-6, "wd": 0.01,
              "rescale_grad": 0.5, "clip_gradient": 0.6}, {}),
    ("ftml", {"learning_rate": 0.02}, {"scheduler": {"step": 2, "factor": 0.5, "base_lr": 0.02}}),
    ("dcasgd", {}, {}),
    ("dcasgd", {"learning_rate": 0.1, "lamda": 0.5, "wd": 0.01, "rescale_grad": 2.0,
                "clip_gradient": 1.5}, {}),
    ("sgld", {"learning_rate": 0.01}, {}),
    ("sgld", {"learning_rate": 0.05, "wd": 0.1, "rescale_grad": 0.5, "clip_gradient": 0.5}, {}),
    ("adadelta", {}, {}),
    ("adadelta", {"rho": 0.8, "epsilon": 1e-3, "wd": 0.01, "rescale_grad": 2.0,
                  "clip_gradient": 1.0}, {}),
    ("ftrl", {}, {}),
    ("ftrl", {"learning_rate": 0.5, "lamda1": 0.5, "beta": 0.5, "wd": 0.1, "rescale_grad": 0.5,
              "clip_gradient": 0.8}, {}),
    ("ftrl", {"learning_rate": 0.2}, {"scheduler": {"step": 2, "factor": 0.5, "base_lr": 0.2}}),
    ("adamax", {}, {}),
    ("adamax", {"learning_rate": 0.01, "beta1": 0.8, "beta2": 0.9, "wd": 0.01, "rescale_grad": 0.5,
                "clip_gradient": 0.5}, {}),
    ("nadam", {}, {}),
    ("nadam", {"learning_rate": 0.01, "beta1": 0.8, "beta2": 0.99, "epsilon": 1e-6,
               "schedule_decay": 0.1, "wd": 0.01, "rescale_grad": 0.5, "clip_gradient": 0.7}, {}),
    ("nadam", {"learning_rate": 0.01}, {"scheduler": {"step": 2, "factor": 0.5, "base_lr": 0.01}}),
    # float16 weights through MXNet's float32 master copy
    ("signum", {"learning_rate": 0.01, "wd_lh": 0.01, "multi_precision": True},
     {"dtype": "float16"}),
    ("nadam", {"learning_rate": 0.01, "wd": 0.01, "multi_precision": True}, {"dtype": "float16"}),
    ("dcasgd", {"learning_rate": 0.05, "multi_precision": True}, {"dtype": "float16"}),
    # layer-wise: LARS and LAMB scale each key's step by its norms; LBSGD accumulates
    # batch_scale pushes and warms its learning rate up (or scales it by norms: "lars")
    ("lars", {"learning_rate": 0.1}, {}),
    ("lars", {"learning_rate": 0.1, "momentum": 0.9, "eta": 0.01, "eps": 1e-6, "wd": 0.01,
              "rescale_grad": 0.5, "clip_gradient": 0.8}, {}),
    ("lars", {"learning_rate": 0.1, "momentum": 0.9, "eta": 0.02},
     {"scheduler": {"step": 2, "factor": 0.5, "base_lr": 0.1}}),
    ("lars", {"learning_rate": 0.1, "momentum": 0.9, "eta": 0.02, "momentum_correction": False},
     {"scheduler": {"step": 2, "factor": 0.5, "base_lr": 0.1}}),
    # named as a bias: no layer-wise scaling (MXNet would also zero wd for every name not
    # ending in "_weight", a symbol-naming rule torch's names do not follow: so no wd here)
    ("lars", {"learning_rate": 0.1, "momentum": 0.9}, {"slot": "fc_bias"}),
    ("lamb", {}, {}),
    ("lamb", {"learning_rate": 0.01, "beta1": 0.8, "beta2": 0.99, "epsilon": 1e-4, "wd": 0.01,
              "rescale_grad": 0.5, "clip_gradient": 0.9}, {}),
    ("lamb", {"learning_rate": 0.01, "lower_bound": 3.5, "upper_bound": 5.0}, {}),
    ("lamb", {"learning_rate": 0.01, "lower_bound": 0.1, "upper_bound": 0.5}, {}),
    ("lamb", {"learning_rate": 0.01, "bias_correction": False, "wd": 0.1}, {}),
    ("lamb", {"learning_rate": 0.01}, {"scheduler": {"step": 2, "factor": 0.5, "base_lr": 0.01}}),
    ("lbsgd", {"learning_rate": 0.1, "momentum": 0.9, "batch_scale": 2, "warmup_epochs": 1,
               "updates_per_epoch": 4, "warmup_strategy": "linear"}, {}),
    ("lbsgd", {"learning_rate": 0.1, "batch_scale": 1, "warmup_epochs": 1, "updates_per_epoch": 4,
               "warmup_strategy": "power2", "wd": 0.01, "rescale_grad": 0.5, "clip_gradient": 0.9}, {}),
    ("lbsgd", {"learning_rate": 0.1, "momentum": 0.5, "batch_scale": 3, "warmup_epochs": 1,
               "updates_per_epoch": 2, "warmup_strategy": "sqrt", "begin_epoch": 1}, {}),
    ("lbsgd", {"learning_rate": 0.1, "momentum": 0.9, "batch_scale": 2, "warmup_strategy": "lars",
               "wd": 0.01}, {}),
    # NAG (issue 44): MXNet's momentum holds the rate; wd's term reads the updated weight
    ("nag", {"learning_rate": 0.1, "momentum": 0.9}, {}),
    ("nag", {"learning_rate": 0.05, "momentum": 0.8, "wd": 0.03, "rescale_grad": 0.5,
             "clip_gradient": 0.6}, {}),
    ("nag", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.01},
     {"scheduler": {"step": 2, "factor": 0.5, "base_lr": 0.1}}),
    ("nag", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.05, "multi_precision": True},
     {"dtype": "float16"}),
]

# (id, optimizer, params, scheduler {"name", "params"} or None, w0, grads, {step index: new rate})
# for the learning-rate rules of issue 44: each runs one weight through MXNet's optimizer,
# calling its set_learning_rate before the listed steps; MXNet's learning_rate is recorded
# before the first step and the rate of every step (_get_lr after its count) with the weights.
ONES = [[1.0]] * 6
BIG = [[2.0, -3.0], [0.5, 1.5], [-1.0, 4.0], [3.0, -0.5]]     # beyond 1: a clip at 1 would show
SCENARIOS: list[tuple[str, str, dict[str, Any], Any, list, list, dict[int, float]]] = [
    ("nag-factor-schedule", "nag", {"learning_rate": 0.1, "momentum": 0.9},
     {"name": "factor", "params": {"step": 2, "factor": 0.5}}, [1.0], ONES[:4], {}),
    ("nag-set-learning-rate", "nag", {"learning_rate": 0.1, "momentum": 0.9}, None, [1.0], ONES[:5],
     {2: 0.03}),
    ("lars-set-learning-rate", "lars", {"learning_rate": 0.1, "momentum": 0.9, "eta": 1.0}, None, [3.0, 4.0],
     [[1.0, 0.0]] * 4, {2: 0.03}),
    ("lars-set-learning-rate-twice", "lars", {"learning_rate": 0.1, "momentum": 0.9, "eta": 0.5, "wd": 0.01},
     None, [3.0, 4.0], [[1.0, 0.5]] * 5, {1: 0.2, 3: 0.05}),
    ("lars-set-learning-rate-uncorrected", "lars",
     {"learning_rate": 0.1, "momentum": 0.9, "eta": 1.0, "momentum_correction": False}, None, [3.0, 4.0],
     [[1.0, 0.0]] * 4, {2: 0.03}),
    ("sgd-rate-over-scheduler-base", "sgd", {"learning_rate": 0.3},
     {"name": "factor", "params": {"step": 1, "factor": 0.5, "base_lr": 1.0}}, [0.0], ONES[:4], {}),
    ("sgd-rate-none-takes-scheduler-base", "sgd", {"learning_rate": None},
     {"name": "factor", "params": {"step": 2, "factor": 0.5, "base_lr": 0.2}}, [0.0], ONES[:5], {}),
    ("sgd-rate-none-no-scheduler", "sgd", {"learning_rate": None}, None, [0.0], ONES[:2], {}),
    ("signum-default-rate-over-scheduler-base", "signum", {},
     {"name": "multifactor", "params": {"step": [2, 4], "factor": 0.5, "base_lr": 0.1}}, [0.5],
     [[1.0], [-2.0], [0.5], [1.5], [-1.0]], {}),
    # warm-up: MXNet's ends at the scheduler's own base_lr (0.01 when not given), whatever
    # the optimizer's learning_rate; cosine and poly decay from it too
    ("sgd-factor-linear-warmup", "sgd", {"learning_rate": 0.1},
     {"name": "factor", "params": {"step": 3, "factor": 0.5, "warmup_steps": 4, "warmup_begin_lr": 0.001}},
     [0.0], [[1.0]] * 9, {}),
    ("sgd-multifactor-constant-warmup", "sgd", {"learning_rate": 0.05, "momentum": 0.9},
     {"name": "multifactor", "params": {"step": [4, 6], "factor": 0.1, "base_lr": 0.05, "warmup_steps": 3,
                                        "warmup_begin_lr": 0.01, "warmup_mode": "constant"}},
     [0.0], [[1.0]] * 8, {}),
    ("sgd-cosine-warmup", "sgd", {"learning_rate": 0.1},
     {"name": "cosine", "params": {"max_update": 6, "base_lr": 0.5, "final_lr": 0.05, "warmup_steps": 2,
                                   "warmup_begin_lr": 0.1}}, [0.0], [[1.0]] * 8, {}),
    ("sgd-poly-constant-warmup", "sgd", {"learning_rate": 0.2},
     {"name": "poly", "params": {"max_update": 7, "base_lr": 0.2, "pwr": 2, "final_lr": 0.01,
                                 "warmup_steps": 2, "warmup_begin_lr": 0.05, "warmup_mode": "constant"}},
     [0.0], [[1.0]] * 9, {}),
    ("nag-cosine", "nag", {"learning_rate": 0.3, "momentum": 0.9},
     {"name": "cosine", "params": {"max_update": 5, "base_lr": 0.3, "final_lr": 0.01}}, [1.0, -2.0],
     [[1.0, 0.5], [0.5, -1.0], [-0.5, 2.0], [1.0, 1.0], [2.0, -0.5], [0.1, 0.1]], {}),
    # values MXNet accepts: momentum 1, a negative wd, clip_gradient <= 0 where its kernel
    # clips (no clipping), AdaGrad's eps
    ("sgd-momentum-one", "sgd", {"learning_rate": 0.1, "momentum": 1.0}, None, [1.0, -2.0], BIG, {}),
    ("nag-momentum-one", "nag", {"learning_rate": 0.1, "momentum": 1.0, "wd": 0.01}, None, [1.0, -2.0], BIG, {}),
    ("sgd-negative-wd", "sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": -0.05}, None, [1.0, -2.0], BIG, {}),
    ("nag-negative-wd", "nag", {"learning_rate": 0.1, "momentum": 0.9, "wd": -0.05}, None, [1.0, -2.0], BIG, {}),
    ("lars-negative-wd", "lars", {"learning_rate": 0.1, "momentum": 0.9, "eta": 0.5, "wd": -0.05}, None,
     [1.0, -2.0], BIG, {}),
    ("sgd-clip-zero-is-no-clipping", "sgd", {"learning_rate": 0.1, "momentum": 0.9, "clip_gradient": 0.0}, None,
     [1.0, -2.0], BIG, {}),
    ("nag-clip-negative-is-no-clipping", "nag", {"learning_rate": 0.1, "momentum": 0.9, "clip_gradient": -1.0},
     None, [1.0, -2.0], BIG, {}),
    ("ftml-clip-zero-is-no-clipping", "ftml", {"learning_rate": 0.05, "clip_gradient": 0.0}, None, [1.0, -2.0],
     BIG, {}),
    ("adagrad-eps", "adagrad", {"learning_rate": 0.1, "eps": 1e-3, "wd": 0.01}, None, [1.0, -2.0], BIG, {}),
]

# (name, params, steps): a fresh MXNet scheduler called with num_update = 1, 2, ..., steps
# (MXNet's own test_*_scheduler settings first)
SCHEDULES: list[tuple[str, dict[str, Any], int]] = [
    ("factor", {"step": 100, "factor": 0.1, "stop_factor_lr": 1e-4, "base_lr": 1, "warmup_steps": 20,
                "warmup_begin_lr": 0.1, "warmup_mode": "constant"}, 1000),
    ("multifactor", {"step": [15, 25], "factor": 0.1, "base_lr": 0.1, "warmup_steps": 10,
                     "warmup_begin_lr": 0.05, "warmup_mode": "linear"}, 100),
    ("poly", {"max_update": 1000, "base_lr": 3, "pwr": 2, "final_lr": 0, "warmup_steps": 100,
              "warmup_begin_lr": 0, "warmup_mode": "linear"}, 1100),
    ("cosine", {"max_update": 1000, "base_lr": 3, "final_lr": 0.1}, 1100),
    ("factor", {"step": 3, "factor": 0.7, "stop_factor_lr": 0.02, "base_lr": 0.3, "warmup_steps": 5,
                "warmup_begin_lr": 0.01}, 40),
    ("cosine", {"max_update": 30, "base_lr": 0.4, "final_lr": 0.01, "warmup_steps": 6,
                "warmup_begin_lr": 0.02, "warmup_mode": "constant"}, 40),
    ("poly", {"max_update": 25, "base_lr": 0.5, "pwr": 3, "final_lr": 0.05, "warmup_steps": 4,
              "warmup_begin_lr": 0.1}, 30),
    ("poly", {"max_update": 10}, 12),
]
SCHEDULER_CLASSES = {"factor": "FactorScheduler", "multifactor": "MultiFactorScheduler",
                     "cosine": "CosineScheduler", "poly": "PolyScheduler"}


def data(seed: int, dtype: str, steps: int = STEPS, n: int = N):
    rng = np.random.default_rng(seed)
    w0 = rng.standard_normal(n).astype(dtype)
    grads = (2.0 * rng.standard_normal((steps, n))).astype(dtype)   # clip values ~1 bite
    return w0, grads


def scheduler(spec):
    return None if spec is None else getattr(mx.lr_scheduler, SCHEDULER_CLASSES[spec["name"]])(**spec["params"])


def master_first(name: str, state):
    """MXNet's SGD, NAG and LARS keep (state, master copy); the fixture's order is the
    master copy first, as every other optimizer's (and kvstore's)."""
    if name in ("sgd", "nag", "lars") and isinstance(state, tuple):
        return (state[1], state[0])
    return state


def flat_state(state) -> list:
    if state is None:
        return []
    if isinstance(state, (tuple, list)):
        return [a for s in state for a in flat_state(s)]
    return [state.asnumpy().tolist()]


def run_dense(index: int, name: str, params: dict, extras: dict) -> dict:
    dtype = extras.get("dtype", "float32")
    w0, grads = data(index, dtype)
    kwargs = dict(params)
    if "scheduler" in extras:
        kwargs["lr_scheduler"] = mx.lr_scheduler.FactorScheduler(**extras["scheduler"])
    if "slot" in extras:         # the weight's name (LARS leaves gamma, beta and bias alone)
        kwargs["param_idx2name"] = {0: extras["slot"]}
    o = mx.optimizer.create(name, **kwargs)
    noise = []
    if name == "sgld":
        z = np.random.default_rng(1000 + index).standard_normal((STEPS, N))
        noise = z.tolist()
        step = iter(range(STEPS))
        mx_opt.normal = lambda loc, scale, shape, dtype, ctx: mx.nd.array(
            loc + scale * z[next(step)], dtype=dtype, ctx=ctx)
    w = mx.nd.array(w0, dtype=dtype)
    state = o.create_state_multi_precision(0, w)
    weights = []
    for g in grads:
        o.update_multi_precision(0, w, mx.nd.array(g, dtype=dtype), state)
        weights.append(w.asnumpy().tolist())
    return {"optimizer": name, "params": params, "scheduler": extras.get("scheduler"),
            "dtype": dtype, "w0": w0.tolist(), "grads": grads.tolist(), "rows": None,
            "weights": weights, "states": flat_state(master_first(name, state)), "noise": noise,
            "slot": extras.get("slot")}


def run_scenario(sid, name, params, sched, w0, grads, set_lr) -> dict:
    """One weight (float32) through MXNet's optimizer, set_learning_rate before the steps
    listed; the rates MXNet used (except LARS's, whose _get_lrs has side effects)."""
    o = mx.optimizer.create(name, lr_scheduler=scheduler(sched), **params)
    first_rate = o.learning_rate
    w = mx.nd.array(np.array(w0, "float32"))
    state = o.create_state_multi_precision(0, w)
    weights, rates = [], []
    for k, g in enumerate(grads):
        if k in set_lr:
            o.set_learning_rate(set_lr[k])
        o.update_multi_precision(0, w, mx.nd.array(np.array(g, "float32")), state)
        weights.append(w.asnumpy().tolist())
        rates.append(None if name == "lars" else o._get_lr(0))
    return {"id": sid, "optimizer": name, "params": params, "scheduler": sched, "w0": w0, "grads": grads,
            "set_lr": [[k, v] for k, v in sorted(set_lr.items())], "learning_rate": first_rate,
            "rates": rates, "weights": weights, "states": flat_state(state)}


def run_schedule(name: str, params: dict, steps: int) -> dict:
    s = scheduler({"name": name, "params": params})
    return {"name": name, "params": params, "rates": [s(t) for t in range(1, steps + 1)]}


def run_kvstore_row_sparse() -> list:
    """MXNet's local KVStore with an optimizer and row-sparse gradients, some with no
    rows: every push is an update of the key (its count moves), rows or none."""
    shape, out = (5, 3), []
    for name, params in (("adam", {"learning_rate": 0.1}), ("sgd", {"learning_rate": 0.1, "momentum": 0.9})):
        pushes: list[tuple[list[int], list[list[float]]]] = [
            ([2], [[1.0, 1.0, 1.0]]), ([], []), ([1, 2], [[0.5, -1.0, 2.0], [1.0, 1.0, 1.0]]), ([], [])]
        kv = mx.kv.create("local")
        kv.init(0, mx.nd.zeros(shape))
        kv.set_optimizer(mx.optimizer.create(name, **params))
        for rows, data in pushes:
            kv.push(0, mx.nd.sparse.row_sparse_array(
                (np.array(data, "float32").reshape(len(rows), shape[1]), np.array(rows, "int64")), shape=shape))
        w = mx.nd.zeros(shape)
        kv.pull(0, out=w)
        out.append({"optimizer": name, "params": params, "shape": list(shape), "pushes": pushes,
                    "weight": w.asnumpy().tolist()})
    return out


def run_ftrl_row_sparse() -> dict:
    """MXNet's lazy ftrl_update: a row-sparse weight, state and gradients."""
    rows_per_step = [[1, 4], [0, 1, 5], [4], [2, 4, 5]]
    shape = (6, 3)
    rng = np.random.default_rng(77)
    w0 = rng.standard_normal(shape).astype("float32")
    params = {"learning_rate": 0.3, "lamda1": 0.05, "wd": 0.01}
    o = mx.optimizer.create("ftrl", **params)
    w = mx.nd.array(w0).tostype("row_sparse")
    state = o.create_state_multi_precision(0, w)
    grads, weights = [], []
    for rows in rows_per_step:
        g = (2.0 * rng.standard_normal((len(rows), shape[1]))).astype("float32")
        grads.append(g.tolist())
        o.update_multi_precision(0, w, mx.nd.sparse.row_sparse_array(
            (g, np.array(rows, dtype="int64")), shape=shape), state)
        weights.append(w.tostype("default").asnumpy().tolist())
    return {"optimizer": "ftrl", "params": params, "scheduler": None, "dtype": "float32",
            "w0": w0.tolist(), "grads": grads, "rows": rows_per_step, "weights": weights,
            "states": [s.tostype("default").asnumpy().tolist() for s in state], "noise": [], "slot": None}


# Row-sparse pushes on a dense key (issue 44 item 2): MXNet's local KVStore, each step a list of
# two row-sparse values (summed: their rows' union, as two dist_sync workers' pushes), some
# naming no rows; (optimizer, params). lazy_update: MXNet's default True moves only the rows
# pushed (weights, wd, state); False every row. NAG has no lazy update (its kernel densifies).
LAZY_SHAPE = (6, 4)
LAZY_STEPS: list[list[list[int]]] = [[[1, 4], [4, 5]], [[0], []], [[], []], [[2, 3], [3]], [[1], [1, 5]]]
LAZY_CASES: list[tuple[str, dict[str, Any]]] = [
    ("sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.05}),
    ("sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.05, "lazy_update": False}),
    ("sgd", {"learning_rate": 0.1, "wd": 0.05, "rescale_grad": 0.5, "clip_gradient": 0.8}),
    ("sgd", {"learning_rate": 0.1, "wd": 0.05, "lazy_update": False}),
    ("adam", {"learning_rate": 0.05, "wd": 0.05}),
    ("adam", {"learning_rate": 0.05, "wd": 0.05, "lazy_update": False}),
    ("adam", {"learning_rate": 0.05, "wd": 0.05, "rescale_grad": 0.5, "clip_gradient": 0.6}),
    ("lars", {"learning_rate": 0.1, "momentum": 0.9, "eta": 0.5, "wd": 0.05}),
    ("lars", {"learning_rate": 0.1, "momentum": 0.9, "eta": 0.5, "wd": 0.05, "lazy_update": False}),
    ("nag", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.05}),
]


def _rsp(rows: list, rng, shape=LAZY_SHAPE):
    data = (2.0 * rng.standard_normal((len(rows), shape[1]))).astype("float32")
    return data, mx.nd.sparse.row_sparse_array((data, np.array(rows, "int64")), shape=shape)


def run_kvstore_lazy() -> dict:
    """MXNet's local KVStore with row-sparse pushes: on a dense key (every case), and on a
    row-sparse key (SGD and Adam, ``lazy_update`` True and False; a row-sparse key's
    weight holds every row, as MXNet's standard update needs)."""
    out: dict = {"shape": list(LAZY_SHAPE), "dense": [], "row_sparse": []}
    for index, (name, params) in enumerate(LAZY_CASES):
        rng = np.random.default_rng(500 + index)
        w0 = rng.standard_normal(LAZY_SHAPE).astype("float32")
        for stype in ("dense", "row_sparse"):
            if stype == "row_sparse" and name not in ("sgd", "adam"):
                continue
            kv = mx.kv.create("local")
            kv.init(0, mx.nd.array(w0) if stype == "dense" else mx.nd.array(w0).tostype("row_sparse"))
            kv.set_optimizer(mx.optimizer.create(name, **params))
            step_rng = np.random.default_rng(900 + index)
            pushes, weights = [], []
            for step in LAZY_STEPS:
                values = [_rsp(rows, step_rng) for rows in step]
                pushes.append([[rows, data.tolist()] for rows, (data, _) in zip(step, values)])
                kv.push(0, [v for _, v in values])
                w = mx.nd.zeros(LAZY_SHAPE) if stype == "dense" else mx.nd.sparse.zeros("row_sparse", LAZY_SHAPE)
                if stype == "dense":
                    kv.pull(0, out=w)
                else:
                    kv.row_sparse_pull(0, out=w, row_ids=mx.nd.arange(LAZY_SHAPE[0]))
                weights.append(w.asnumpy().tolist())
            out[stype].append({"optimizer": name, "params": params, "w0": w0.tolist(), "pushes": pushes,
                               "weights": weights})
    return out


# Per-parameter multipliers (issue 44 item 6): four parameters, MXNet's names; the optimizer
# made with param_idx2name (MXNet's wd_mult default: 0 unless the name ends in _weight or
# _gamma, LARS: _weight), then set_lr_mult / set_wd_mult by index and by name; begin_num_update
# moves every count (Adam's bias correction, the schedule); param_dict (gluon Parameters' lr_mult
# and wd_mult) comes first. Run through MXNet's local KVStore (int keys: the index) and its
# Updater, every key pushed every step.
MULT_NAMES = {0: "fc_weight", 1: "fc_bias", 2: "bn_gamma", 3: "bn_beta"}
MULT_CASES: list[tuple[str, str, dict[str, Any], dict, dict, dict]] = [
    # (id, optimizer, params, lr_mult, wd_mult, param_dict {index: (lr_mult, wd_mult)})
    ("sgd-names", "sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.1}, {}, {}, {}),
    ("sgd-set-mults", "sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.1, "begin_num_update": 3},
     {1: 2.0, "bn_beta": 0.5}, {"bn_gamma": 0.3, 1: 0.5}, {}),
    ("adam-begin-num-update", "adam", {"learning_rate": 0.05, "wd": 0.1, "begin_num_update": 5},
     {"fc_weight": 0.5}, {}, {}),
    ("lars-names", "lars", {"learning_rate": 0.1, "momentum": 0.9, "eta": 0.5, "wd": 0.1},
     {3: 3.0}, {}, {}),
    ("nag-param-dict", "nag", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.1},
     {0: 9.0}, {0: 9.0}, {0: (0.5, 2.0), 2: (0.0, 1.0)}),
    ("adagrad-scheduled", "adagrad", {"learning_rate": 0.1, "wd": 0.05, "begin_num_update": 2},
     {"fc_bias": 2.0}, {"fc_bias": 1.0}, {}),
]


def run_multipliers() -> list:
    out = []
    for index, (cid, name, params, lr_mult, wd_mult, pdict) in enumerate(MULT_CASES):
        rng = np.random.default_rng(700 + index)
        w0 = [rng.standard_normal(4).astype("float32") for _ in MULT_NAMES]
        grads = [[(2.0 * rng.standard_normal(4)).astype("float32") for _ in MULT_NAMES] for _ in range(4)]
        kwargs = dict(params, param_idx2name=dict(MULT_NAMES))
        if cid == "adagrad-scheduled":
            kwargs["lr_scheduler"] = mx.lr_scheduler.FactorScheduler(step=3, factor=0.5, base_lr=0.1)
        if pdict:
            kwargs["param_dict"] = {i: mx.gluon.Parameter(f"p{i}", shape=(4,), lr_mult=lr, wd_mult=wd)
                                    for i, (lr, wd) in pdict.items()}
        o = mx.optimizer.create(name, **kwargs)
        o.set_lr_mult(dict(lr_mult))
        o.set_wd_mult(dict(wd_mult))
        scales = [[o._get_lr(i) / (o.lr_scheduler(o.begin_num_update + 1) if o.lr_scheduler else o.lr),
                   o._get_wd(i) / params["wd"]] for i in MULT_NAMES]
        kv = mx.kv.create("local")
        kv.init(list(MULT_NAMES), [mx.nd.array(w) for w in w0])
        kv.set_optimizer(o)
        weights = []
        for step in grads:
            kv.push(list(MULT_NAMES), [mx.nd.array(g) for g in step])
            ws = [mx.nd.zeros(4) for _ in MULT_NAMES]
            kv.pull(list(MULT_NAMES), out=ws)
            weights.append([w.asnumpy().tolist() for w in ws])
        out.append({"id": cid, "optimizer": name, "params": params, "names": {str(k): v for k, v in MULT_NAMES.items()},
                    "lr_mult": [[k, v] for k, v in lr_mult.items()], "wd_mult": [[k, v] for k, v in wd_mult.items()],
                    "param_dict": [[k, lr, wd] for k, (lr, wd) in pdict.items()],
                    "scheduler": {"step": 3, "factor": 0.5, "base_lr": 0.1} if cid == "adagrad-scheduled" else None,
                    "scales": scales, "w0": [w.tolist() for w in w0], "grads": [[g.tolist() for g in s] for s in grads],
                    "weights": weights})
    return out


def main(path: str) -> None:
    cases = [run_dense(i, name, params, extras) for i, (name, params, extras) in enumerate(CASES)]
    cases.append(run_ftrl_row_sparse())
    out = {"generator": "benchmarks/harness/peers/mxnet_optimizer_fixture.py",
           "mxnet": mx.__version__, "numpy": np.__version__, "cases": cases,
           "scenarios": [run_scenario(*scenario) for scenario in SCENARIOS],
           "schedules": [run_schedule(*schedule) for schedule in SCHEDULES],
           "kvstore_row_sparse": run_kvstore_row_sparse(),
           "kvstore_lazy": run_kvstore_lazy(), "multipliers": run_multipliers()}
    with open(path, "w") as f:
        json.dump(out, f, indent=None, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {len(cases)} cases, {len(SCENARIOS)} scenarios, {len(SCHEDULES)} schedules and the "
          f"row-sparse KVStore runs to {path} (mxnet {mx.__version__})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/mxnet_optimizers.json")
