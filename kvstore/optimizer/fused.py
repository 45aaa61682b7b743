"""One fused CuPy kernel per optimizer update, for GPU-resident weights.

The generic ``_step`` code is written once for NumPy and CuPy, so on a GPU each
in-place operation is its own kernel: Adam launches about 12 and streams the
weight, the gradient and both moments through memory several times. An update
is memory bound, so :func:`fused_step` does it in one ``cupy.ElementwiseKernel``
that reads the gradient once and writes the weight and each state array once.

The math is that of :mod:`.optimizers` (MXNet 1.x), with the operations in the
same order. For float32 and float64 every intermediate is rounded to the
weight's dtype exactly where NumPy rounds it (the kernels are compiled with
``--fmad=false`` so that ``a * b + c`` is not contracted into one FMA), so the
fused and the generic paths agree to the last bit or so. float16 weights are
computed in float32 and rounded once per stored value, which is more accurate
than the generic path (it rounds after every operation) but not identical.

CuPy is imported on first use only; importing this module needs no GPU.
Set ``fused.ENABLED = False`` to send every update through ``_step`` (to
compare the two paths, or to rule the kernels out when chasing a bug).
"""

from __future__ import annotations

import math

__all__ = ["ENABLED", "fused_step"]

ENABLED = True
"""When False, :func:`fused_step` always declines and ``_step`` does the work."""

# Per kernel: the scalars after the common (rescale, clip_g, wd, lr), the state
# arrays after the weight, and the loop body. Reading/writing the outputs in
# place is how ElementwiseKernel does in-place updates (out params are references).
_LOAD = "acc_t w = (acc_t)weight;\nacc_t g = (acc_t)grad * rescale;\n"
# NumPy skips `g += wd * w` when wd == 0; a branch (uniform across threads) keeps
# -0.0 and non-finite weights bit-identical to that.
_WD = "if (wd != 0) g = g + wd * w;\n"
_CLIP = "g = kv_clip(g, clip_g);\n"

_SPECS = {
    # sgd/nag/adagrad add wd after clipping, adam/rmsprop before (MXNet 1.x).
    "sgd": ((), (), _LOAD + _CLIP + _WD + "weight = (T)(w - g * lr);"),
    "sgd_mom": (("momentum",), ("mom",), _LOAD + _CLIP + _WD + """
        acc_t m = (acc_t)mom * momentum - g * lr;
        mom = (T)m;
        weight = (T)(w + m);"""),
    "nag_mom": (("momentum",), ("mom",), _LOAD + _CLIP + _WD + """
        acc_t m = (acc_t)mom * momentum + g;
        mom = (T)m;
        g = g + momentum * m;
        weight = (T)(w - g * lr);"""),
    "adam": (("beta1", "omb1", "beta2", "omb2", "eps", "lr_t"), ("mean", "var"),
             _LOAD + _WD + _CLIP + """
        acc_t m = (acc_t)mean * beta1 + omb1 * g;
        acc_t v = (acc_t)var * beta2 + (g * g) * omb2;
        mean = (T)m;
        var = (T)v;
        weight = (T)(w - m / (sqrt(v) + eps) * lr_t);"""),
    "adagrad": (("eps",), ("hist",), _LOAD + _CLIP + """
        acc_t h = (acc_t)hist + g * g;
        hist = (T)h;
        g = g / sqrt(h + eps);
        """ + _WD + "weight = (T)(w - g * lr);"),
    "rmsprop": (("gm1", "omg1", "eps", "clip_w"), ("msq",), _LOAD + _WD + _CLIP + """
        acc_t s = (acc_t)msq * gm1 + omg1 * (g * g);
        msq = (T)s;
        g = g / sqrt(s + eps);
        weight = (T)kv_clip(w - g * lr, clip_w);"""),
    "rmspropalex": (("gm1", "omg1", "gm2", "eps", "clip_w"), ("msq", "gbar", "delta"),
                    _LOAD + _WD + _CLIP + """
        acc_t s = (acc_t)msq * gm1 + omg1 * (g * g);
        acc_t gb = (acc_t)gbar * gm1 + omg1 * g;
        msq = (T)s;
        gbar = (T)gb;
        g = g / sqrt((s - gb * gb) + eps);
        acc_t d = (acc_t)delta * gm2 - g * lr;
        delta = (T)d;
        weight = (T)kv_clip(w + d, clip_w);"""),
}

# acc_t is float for float16/float32 weights and double for float64 ones.
_PREAMBLE = """
typedef %s acc_t;
// A ternary, not fminf/fmaxf: NaN must pass through, as it does in numpy.clip.
// clip = +inf (clipping off) leaves every value, infinities included, unchanged.
__device__ __forceinline__ acc_t kv_clip(acc_t x, acc_t c) {
    return x < -c ? -c : (x > c ? c : x);
}
"""

_kernels: dict = {}   # (kernel name, dtype char) -> cupy.ElementwiseKernel
_plans = None         # optimizer class -> planner; built on first use (import cycle)


def _kernel(name, dtype):
    key = (name, dtype.char)
    kern = _kernels.get(key)
    if kern is None:
        import cupy  # noqa: PLC0415 - lazy: importing kvstore must not import cupy

        scalars, states, body = _SPECS[name]
        ctype, stype = ("double", "float64") if dtype.char == "d" else ("float", "float32")
        in_params = ", ".join(["T grad"] + [f"{stype} {s}" for s in
                                            ("rescale", "clip_g", "wd", "lr") + scalars])
        out_params = ", ".join(f"T {o}" for o in ("weight",) + states)
        kern = cupy.ElementwiseKernel(
            in_params, out_params, body, name=f"kvstore_{name}_{dtype.name}",
            preamble=_PREAMBLE % ctype, options=("--fmad=false",), no_return=True)
        # A race here only builds the same kernel twice; the last one wins.
        _kernels[key] = kern
    return kern


# Planners: (optimizer, state, t, lr) -> (kernel name, {scalar: value}). Scalars are
# Python floats computed like the generic path computes them (e.g. 1 - beta1 in
# float64), then rounded to the kernel's scalar type as NumPy rounds them.

def _plan_sgd(o, state, t, lr):
    if not state:
        return "sgd", {}
    return ("nag_mom" if o.nesterov else "sgd_mom"), {"momentum": o.momentum}


def _plan_adam(o, state, t, lr):
    # Bias corrections folded into the lr in float64 on the host, in Adam._step's
    # operation order, so that lr_t rounds to the same float32.
    lr_t = lr * math.sqrt(1.0 - o.beta2 ** t) / (1.0 - o.beta1 ** t)
    return "adam", {"beta1": o.beta1, "omb1": 1.0 - o.beta1, "beta2": o.beta2,
                    "omb2": 1.0 - o.beta2, "eps": o.epsilon, "lr_t": lr_t}


def _plan_adagrad(o, state, t, lr):
    return "adagrad", {"eps": o.epsilon}


def _plan_rmsprop(o, state, t, lr):
    clip_w = math.inf if o.clip_weights is None else o.clip_weights
    common = {"gm1": o.gamma1, "omg1": 1.0 - o.gamma1, "eps": o.epsilon, "clip_w": clip_w}
    if o.centered:
        return "rmspropalex", dict(common, gm2=o.gamma2)
    return "rmsprop", common


def _planners():
    global _plans
    if _plans is None:
        from .optimizers import NAG, SGD, AdaGrad, Adam, RMSProp  # noqa: PLC0415 - cycle

        _plans = {SGD: _plan_sgd, NAG: _plan_sgd, Adam: _plan_adam,
                  AdaGrad: _plan_adagrad, RMSProp: _plan_rmsprop}
    return _plans


def _is_cupy(a):
    return type(a).__module__.split(".")[0] == "cupy"


def fused_step(optimizer, weight, grad, state, t, lr):
    """Do ``optimizer``'s update ``t`` in one CuPy kernel; return whether it did.

    Returns False, touching nothing, when :data:`ENABLED` is off, when
    ``type(optimizer)`` is not exactly one of the built-in optimizers (a
    subclass may override ``_step``, so it keeps its own math), or when
    ``weight``, ``grad`` or a state array is not a CuPy float array. Otherwise
    updates ``weight`` and ``state`` in place with the formulas of
    :mod:`.optimizers` and returns True.

    Arguments are those :meth:`Optimizer.update` has validated: ``grad`` has the
    weight's shape and is already a CuPy array (a different float dtype is
    converted here); ``lr`` is ``learning_rate_at(t)``. ``grad`` is only read,
    and must not overlap ``weight`` or the state (NumPy's path copies it first).
    """
    if not ENABLED:
        return False
    plan = _planners().get(type(optimizer))
    if plan is None or not _is_cupy(weight) or weight.dtype.char not in "efd":
        return False
    if not all(_is_cupy(a) for a in (grad, *state)):
        return False
    if grad.dtype != weight.dtype:
        grad = grad.astype(weight.dtype)
    name, scalars = plan(optimizer, state, t, lr)
    o = optimizer
    clip_g = math.inf if o.clip_gradient is None else o.clip_gradient
    args = [o.rescale_grad, clip_g, o.wd, lr] + [scalars[s] for s in _SPECS[name][0]]
    _kernel(name, weight.dtype)(grad, *args, weight, *state)
    return True
