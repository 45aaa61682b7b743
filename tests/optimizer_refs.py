"""Shared helpers of the optimizer tests (test_optimizer*.py); not collected.

``_data`` makes the weights and gradients the tests feed to the optimizers; the
``ref_*`` functions are independent scalar references of the update rules, and
``run_reference`` runs one over a sequence of gradients.
"""

from __future__ import annotations

import math

import numpy as np


N = 24
STEPS = 6


def _data(seed=0, steps=STEPS, n=N):
    rng = np.random.default_rng(seed)
    w0 = rng.standard_normal(n).astype(np.float32)
    # Scale 2 so that clip_gradient values around 1 really clip many entries.
    grads = (2.0 * rng.standard_normal((steps, n))).astype(np.float32)
    return w0, grads


# One lively configuration (clipping, weight decay, states) of each optimizer that
# MXNet 1.9's own numbers check (test_optimizer_mxnet.py), for the tests of in-place
# semantics, dtypes, lazy rows and the stores.
LIVELY = {
    "signum": {"learning_rate": 0.01, "momentum": 0.9, "wd": 0.01, "wd_lh": 0.01,
               "clip_gradient": 1.0},
    "ftml": {"learning_rate": 0.01, "wd": 0.01, "clip_gradient": 1.0},
    "dcasgd": {"learning_rate": 0.05, "momentum": 0.9, "lamda": 0.1, "wd": 0.01},
    "sgld": {"learning_rate": 0.01, "wd": 0.01, "seed": 3},
    "adadelta": {"rho": 0.9, "wd": 0.01, "clip_gradient": 1.0},
    "ftrl": {"learning_rate": 0.1, "lamda1": 0.01, "wd": 0.01},
    "adamax": {"learning_rate": 0.01, "wd": 0.01, "clip_gradient": 1.0},
    "nadam": {"learning_rate": 0.01, "wd": 0.01, "clip_gradient": 1.0},
}


# --------------------------------------------------------------------------------------
# Independent references: one element at a time, Python floats (float64), written
# from the MXNet 1.x formulas. step(w, g, state, t, lr, hp) -> (w, state).
# --------------------------------------------------------------------------------------

def _clip(x, c):
    return x if c is None else min(max(x, -c), c)


def ref_sgd(w, g, s, t, lr, hp):
    g = _clip(g * hp.get("rescale_grad", 1.0), hp.get("clip_gradient")) + hp.get("wd", 0.0) * w
    m = hp.get("momentum", 0.0)
    if m == 0.0:
        return w - lr * g, s
    mom = s.get("mom", 0.0)
    if hp.get("nesterov"):      # torch's: the momentum excludes the rate
        mom = m * mom + g
        return w - lr * (g + m * mom), {"mom": mom}
    mom = m * mom - lr * g
    return w + mom, {"mom": mom}


def ref_nag(w, g, s, t, lr, hp):
    """MXNet's nag_mom_update: the momentum includes the rate; updated in place, so
    its wd term sees the new weight."""
    g = _clip(g * hp.get("rescale_grad", 1.0), hp.get("clip_gradient"))
    wd, m = hp.get("wd", 0.0), hp.get("momentum", 0.0)
    if m == 0.0:
        return w - lr * (g + wd * w), s
    mom = m * s.get("mom", 0.0)
    w = w - mom + (m + 1) * (mom - lr * (g + wd * w))
    return w, {"mom": mom - lr * (g + wd * w)}


def ref_adam(w, g, s, t, lr, hp):
    b1, b2, eps = hp.get("beta1", 0.9), hp.get("beta2", 0.999), hp.get("epsilon", 1e-8)
    g = _clip(g * hp.get("rescale_grad", 1.0) + hp.get("wd", 0.0) * w, hp.get("clip_gradient"))
    m = b1 * s.get("m", 0.0) + (1 - b1) * g
    v = b2 * s.get("v", 0.0) + (1 - b2) * g * g
    lr_t = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    return w - lr_t * m / (math.sqrt(v) + eps), {"m": m, "v": v}


def ref_adagrad(w, g, s, t, lr, hp):
    eps = hp.get("epsilon", 1e-7)
    g = _clip(g * hp.get("rescale_grad", 1.0), hp.get("clip_gradient"))
    h = s.get("h", 0.0) + g * g
    return w - lr * (g / math.sqrt(h + eps) + hp.get("wd", 0.0) * w), {"h": h}


def ref_rmsprop(w, g, s, t, lr, hp):
    g1, g2, eps = hp.get("gamma1", 0.9), hp.get("gamma2", 0.9), hp.get("epsilon", 1e-8)
    g = _clip(g * hp.get("rescale_grad", 1.0) + hp.get("wd", 0.0) * w, hp.get("clip_gradient"))
    n = (1 - g1) * g * g + g1 * s.get("n", 0.0)
    if hp.get("centered"):
        gb = (1 - g1) * g + g1 * s.get("gb", 0.0)
        d = g2 * s.get("d", 0.0) - lr * g / math.sqrt(n - gb * gb + eps)
        w, s = w + d, {"n": n, "gb": gb, "d": d}
    else:
        w, s = w - lr * g / math.sqrt(n + eps), {"n": n}
    return _clip(w, hp.get("clip_weights")), s


def run_reference(step, hp, w0, grads, lr_of_t):
    w = [float(x) for x in w0]
    states = [{} for _ in w]
    out = []
    for k, grad in enumerate(grads):
        t = k + 1
        for i in range(len(w)):
            w[i], states[i] = step(w[i], float(grad[i]), states[i], t, lr_of_t(t), hp)
        out.append(np.array(w))
    return out


def _halving(base):
    # Independent expression of FactorScheduler(step=2, factor=0.5).
    return lambda t: base * 0.5 ** ((t - 1) // 2)
