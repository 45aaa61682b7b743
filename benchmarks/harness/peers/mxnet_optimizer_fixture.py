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
master copy first). tests/optimizer/test_optimizer_mxnet.py replays the cases through
``kvstore.optimizer``. SGLD's noise is replaced by recorded standard normals
(``normal`` in MXNet's optimizer module returns ``loc + scale * z``), so the
fixture checks the deterministic part and the noise's scale; the test feeds our
SGLD the same ``z``. The ``ftrl`` row-sparse case updates a row-sparse weight
with row-sparse gradients: MXNet's lazy ``ftrl_update``.
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
]


def data(seed: int, dtype: str, steps: int = STEPS, n: int = N):
    rng = np.random.default_rng(seed)
    w0 = rng.standard_normal(n).astype(dtype)
    grads = (2.0 * rng.standard_normal((steps, n))).astype(dtype)   # clip values ~1 bite
    return w0, grads


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
            "weights": weights, "states": flat_state(state), "noise": noise, "slot": extras.get("slot")}


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
           "mxnet": mx.__version__, "numpy": np.__version__, "cases": cases}
    with open(path, "w") as f:
        json.dump(out, f, indent=None, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {len(cases)} cases to {path} (mxnet {mx.__version__})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/mxnet_optimizers.json")
