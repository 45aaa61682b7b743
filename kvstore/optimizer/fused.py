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

This module imports no optimizer: each one with a kernel names it and computes its
scalars itself (``fused_plan``; LARS and LAMB: ``fused_norms``, see
:func:`has_kernel`), so a new optimizer with a kernel adds its body to ``_SPECS``
and its plan to its own class.
"""

from __future__ import annotations

import math

from ._util import dtype_scalar

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
    # torch's Nesterov (SGD(nesterov=True)): the momentum excludes the rate
    "sgd_nesterov": (("momentum",), ("mom",), _LOAD + _CLIP + _WD + """
        acc_t m = (acc_t)mom * momentum + g;
        mom = (T)m;
        g = g + momentum * m;
        weight = (T)(w - g * lr);"""),
    # MXNet's NAGMomKernel (NAG): its momentum holds the rate; in place, the momentum's
    # wd term reads the new weight (SGD._nesterov). mp1 = momentum + 1 in T.
    "nag_mom": (("momentum", "mp1"), ("mom",), _LOAD + _CLIP + """
        acc_t m = (acc_t)mom * momentum;
        acc_t d = g;
        if (wd != 0) d = d + wd * w;
        acc_t wn = (w - m) + (m - d * lr) * mp1;
        weight = (T)wn;
        wn = (acc_t)weight;
        if (wd != 0) g = g + wd * wn;
        mom = (T)(m - g * lr);"""),
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
    # -- MXNet's other elementwise optimizers (kvstore/optimizer/<name>.py) --------------
    # Signum's and FTML's scalars are computed in the weight's dtype, as MXNet's kernels do.
    # Signum rounds to the weight's dtype after every operation (KV_R; nothing for
    # float32 and float64): its step is a sign, which turns a float16 rounding
    # difference near 0 into a whole step.
    "signsgd": (("decay",), (), """
        acc_t w = (acc_t)weight;
        acc_t s = KV_R(kv_sign((acc_t)grad) * lr);
        if (wd != 0) w = KV_R(w * decay);
        weight = (T)(w - s);"""),
    "signum": (("momentum", "mwd", "omm", "wd_lh", "decay_lh"), ("mom",), """
        acc_t w = (acc_t)weight;
        acc_t g = KV_R(kv_clip(KV_R((acc_t)grad * rescale), clip_g));
        acc_t m = KV_R((acc_t)mom * momentum);
        if (wd != 0) m = KV_R(m - KV_R(mwd * w));
        m = KV_R(m - KV_R(g * omm));
        mom = (T)m;
        acc_t s = KV_R(kv_sign(m) * lr);
        if (wd_lh != 0) w = KV_R(w * decay_lh);
        weight = (T)(w + s);"""),
    "ftml": (("beta1", "omb1", "beta2", "omb2", "cv", "eps", "cd"), ("d", "v", "z"),
             _LOAD + _WD + _CLIP + """
        acc_t vv = (acc_t)v * beta2 + omb2 * (g * g);
        v = (T)vv;
        acc_t dt = (sqrt(vv / cv) + eps) * cd;
        acc_t zz = (acc_t)z * beta1 + g * omb1;
        acc_t dd = (dt - (acc_t)d * beta1) * w;
        zz = zz - dd;
        z = (T)zz;
        d = (T)dt;
        weight = (T)(-(zz / dt));"""),
    "dcasgd": (("lamda", "neg_lr"), ("prev",), _LOAD + _CLIP + """
        acc_t dc = g * lamda * g * (w - (acc_t)prev);
        """ + _WD + """
        g = (g + dc) * neg_lr;
        prev = (T)w;
        weight = (T)(w + g);"""),
    "dcasgd_mom": (("lamda", "neg_lr", "momentum"), ("mom", "prev"), _LOAD + _CLIP + """
        acc_t dc = g * lamda * g * (w - (acc_t)prev);
        """ + _WD + """
        g = (g + dc) * neg_lr;
        acc_t m = (acc_t)mom * momentum + g;
        mom = (T)m;
        prev = (T)w;
        weight = (T)(w + m);"""),
    "adadelta": (("rho", "omr", "eps"), ("acc_g", "acc_delta"), _LOAD + _CLIP + """
        acc_t ag = (acc_t)acc_g * rho + (omr * g) * g;
        acc_g = (T)ag;
        acc_t d = sqrt((acc_t)acc_delta + eps) / sqrt(ag + eps) * g;
        acc_delta = (T)((acc_t)acc_delta * rho + (omr * d) * d);
        if (wd != 0) d = d + wd * w;
        weight = (T)(w - d);"""),
    "ftrl": (("lamda1", "beta"), ("z", "n"), _LOAD + _CLIP + """
        acc_t g2 = g * g;
        acc_t nn = (acc_t)n;
        acc_t sigma = (sqrt(nn + g2) - sqrt(nn)) * w / lr;
        acc_t zz = (acc_t)z + (g - sigma);
        nn = nn + g2;
        z = (T)zz;
        n = (T)nn;
        acc_t live = kv_abs(zz) > lamda1 ? (acc_t)1 : (acc_t)0;
        acc_t denom = (sqrt(nn) + beta) / lr + wd + ((acc_t)1 - live);
        weight = (T)((kv_sign(zz) * lamda1 - zz) / denom * live);"""),
    "adamax": (("beta1", "omb1", "beta2", "lr_t"), ("m", "u"), _LOAD + _WD + _CLIP + """
        acc_t mm = (acc_t)m * beta1 + omb1 * g;
        acc_t uu = kv_max((acc_t)u * beta2, kv_abs(g));
        m = (T)mm;
        u = (T)uu;
        acc_t idle = uu == 0 ? (acc_t)1 : (acc_t)0;
        weight = (T)(w - mm * lr_t / (uu + idle) * ((acc_t)1 - idle));"""),
    "nadam": (("beta1", "omb1", "beta2", "omb2", "c_ms", "c_mu", "c_bar", "mu_next", "c_v", "eps"),
              ("m", "v"), _LOAD + _WD + _CLIP + """
        acc_t mm = (acc_t)m * beta1 + omb1 * g;
        acc_t vv = (acc_t)v * beta2 + (omb2 * g) * g;
        m = (T)mm;
        v = (T)vv;
        acc_t bar = mm / c_bar * mu_next + g / c_ms * c_mu;
        weight = (T)(w - bar * lr / (sqrt(vv / c_v) + eps));"""),
    # -- the layer-wise optimizers' elementwise phases (LARS's apply is "sgd"/"sgd_mom"
    # at the key's rate). LAMB's phase 1 writes the new moments and the direction d
    # beside the state (the state keeps the old moments until phase 2).
    "lamb_terms": (("beta1", "omb1", "beta2", "omb2", "c1", "c2", "eps"),
                   ("mean", "var", "m_new", "v_new", "d"), _LOAD + _CLIP + """
        acc_t m = (acc_t)mean * beta1 + omb1 * g;
        acc_t v = (acc_t)var * beta2 + (omb2 * g) * g;
        m_new = (T)m;
        v_new = (T)v;
        acc_t dd = m / c1 / (sqrt(v / c2) + eps);
        if (wd != 0) dd = dd + wd * w;
        d = (T)dd;"""),
    "lamb_apply": (("scale",), ("mean", "var", "m_new", "v_new", "d"), """
        mean = m_new;
        var = v_new;
        weight = (T)((acc_t)weight - KV_R((acc_t)d * scale));"""),
}

# acc_t is float for float16/float32 weights and double for float64 ones.
_PREAMBLE = """
typedef %s acc_t;
// A ternary, not fminf/fmaxf: NaN must pass through, as it does in numpy.clip.
// clip = +inf (clipping off) leaves every value, infinities included, unchanged.
// x rounded to the weight's dtype T (typedef'd in the kernel: expanded where used)
#define KV_R(x) ((acc_t)(T)(x))
__device__ __forceinline__ acc_t kv_clip(acc_t x, acc_t c) {
    return x < -c ? -c : (x > c ? c : x);
}
// numpy's sign (0 for both zeros, NaN stays), abs (+0 for -0) and maximum (NaN wins;
// of two equal zeros, the first)
__device__ __forceinline__ acc_t kv_sign(acc_t x) {
    return x > 0 ? (acc_t)1 : (x < 0 ? (acc_t)-1 : (x == 0 ? (acc_t)0 : x));
}
__device__ __forceinline__ acc_t kv_abs(acc_t x) {
    return x < 0 ? -x : (x == 0 ? (acc_t)0 : x);
}
__device__ __forceinline__ acc_t kv_max(acc_t a, acc_t b) {
    return (a >= b || a != a) ? a : b;
}
"""

_kernels: dict = {}   # (kernel name, dtype char) -> cupy.ElementwiseKernel


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


def _is_cupy(a):
    return type(a).__module__.split(".")[0] == "cupy"


def usable(optimizer, weight, grad, state) -> bool:
    """Whether :func:`fused_step` (and the layer-wise phases) take this update: on,
    a built-in optimizer exactly (a subclass keeps its own math), CuPy float arrays."""
    if not ENABLED or not has_kernel(type(optimizer)):
        return False
    if not _is_cupy(weight) or weight.dtype.char not in "efd":
        return False
    return all(_is_cupy(a) for a in (grad, *state))


def has_kernel(cls) -> bool:
    """Whether optimizer class ``cls`` itself (not a base it inherits from) declares a
    fused kernel: an elementwise ``fused_plan`` or layer-wise ``fused_norms``."""
    own = vars(cls)
    return "fused_plan" in own or bool(own.get("fused_norms"))


def _common(o, lr) -> list:
    clip_g = math.inf if o.clip_bound is None else o.clip_bound
    return [o.rescale_grad, clip_g, o.wd, lr]


def norm_terms(o, weight, grad, state, t, lr, index, xp, launch=None):
    """Phase 1 of a LARS or LAMB update on the device: ``(terms, carry)`` as their
    ``chunk_terms`` give them. LARS's are two reductions; LAMB's new moments and
    direction come from one kernel (into fresh arrays: the state keeps the old
    moments until phase 2), then two reductions. ``launch(name, dtype)``: the
    kernel builder (the CUDA one; CI passes the host build)."""
    from .layerwise import sum_sq   # noqa: PLC0415
    if o.fused_norms != "lamb":
        return o.chunk_terms(weight, grad, state, t, lr, xp, index)
    if grad.dtype != weight.dtype:
        grad = grad.astype(weight.dtype)
    f = dtype_scalar(weight.dtype)
    one, beta1, beta2 = f(1), f(o.beta1), f(o.beta2)
    c1, c2 = (one - beta1 ** f(t), one - beta2 ** f(t)) if o.bias_correction else (one, one)
    carry = tuple(xp.empty_like(weight) for _ in range(3))
    args = _common(o, lr) + [float(x) for x in (beta1, one - beta1, beta2, one - beta2, c1, c2)] + [o.epsilon]
    (launch or _kernel)("lamb_terms", weight.dtype)(grad, *args, weight, *state, *carry)
    return [sum_sq(weight, xp), sum_sq(carry[2], xp)], carry


def apply_norms(o, weight, grad, state, t, lr, sums, carry, launch=None) -> None:
    """Phase 2 of a LARS or LAMB update on the device, in one kernel, with the key's
    ``sums`` of the terms and phase 1's ``carry``."""
    kernel = launch or _kernel
    if grad.dtype != weight.dtype:
        grad = grad.astype(weight.dtype)
    if o.fused_norms == "lamb":
        args = _common(o, lr) + [o.step_scale(list(sums), lr)]
        kernel("lamb_apply", weight.dtype)(grad, *args, weight, *state, *carry)
        return
    lr_key, momentum = o.key_rates(list(sums), t, lr)
    if state:
        kernel("sgd_mom", weight.dtype)(grad, *_common(o, lr_key), momentum, weight, *state)
    else:
        kernel("sgd", weight.dtype)(grad, *_common(o, lr_key), weight)


def fused_step(optimizer, weight, grad, state, t, lr, index=None, rows=None):
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
    if not usable(optimizer, weight, grad, state):
        return False
    if grad.dtype != weight.dtype:
        grad = grad.astype(weight.dtype)
    if optimizer.fused_norms:          # both phases here: the key is whole
        optimizer.check_whole(index, rows)
        terms, carry = norm_terms(optimizer, weight, grad, state, t, lr, index, _cupy())
        apply_norms(optimizer, weight, grad, state, t, lr, terms, carry)
        return True
    name, args = plan_call(optimizer, weight.dtype, state, t, lr)
    _kernel(name, weight.dtype)(grad, *args, weight, *state)
    return True


def _cupy():
    import cupy  # noqa: PLC0415 - lazy: importing kvstore must not import cupy
    return cupy


def plan_call(optimizer, dtype, state, t, lr) -> tuple[str, list]:
    """``(kernel name, scalar arguments)`` of ``optimizer``'s update ``t`` of a weight
    of ``dtype`` (a built-in optimizer of :func:`fused_step`'s). Raises what the
    generic path raises before anything changes (e.g. a zero learning rate where
    the update divides by it)."""
    name, scalars = optimizer.fused_plan(state, t, lr, dtype)
    return name, _common(optimizer, lr) + [scalars[s] for s in _SPECS[name][0]]


def kernel_source(name) -> tuple[tuple, tuple, str, str]:
    """``(scalar names, state names, loop body, preamble with acc_t left open)`` of
    kernel ``name``: what :func:`_kernel` compiles (and CI compiles for the host)."""
    scalars, states, body = _SPECS[name]
    return ("rescale", "clip_g", "wd", "lr") + scalars, states, body, _PREAMBLE
