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
some of no rows.
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


def main(path: str) -> None:
    cases = [run_dense(i, name, params, extras) for i, (name, params, extras) in enumerate(CASES)]
    cases.append(run_ftrl_row_sparse())
    out = {"generator": "benchmarks/harness/peers/mxnet_optimizer_fixture.py",
           "mxnet": mx.__version__, "numpy": np.__version__, "cases": cases,
           "scenarios": [run_scenario(*scenario) for scenario in SCENARIOS],
           "schedules": [run_schedule(*schedule) for schedule in SCHEDULES],
           "kvstore_row_sparse": run_kvstore_row_sparse()}
    with open(path, "w") as f:
        json.dump(out, f, indent=None, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {len(cases)} cases, {len(SCENARIOS)} scenarios, {len(SCHEDULES)} schedules and the "
          f"row-sparse KVStore runs to {path} (mxnet {mx.__version__})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/mxnet_optimizers.json")
