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

This module imports no optimizer and names none: each optimizer with a kernel
declares it in its own module (:func:`define`: its scalars, state arrays and loop
body, written with :data:`LOAD`, :data:`CLIP` and :data:`WD`) and computes its
scalars itself (``fused_plan``); LARS and LAMB (``fused_norms``) run their two
phases themselves (``fused_norm_terms``, ``fused_apply_norms``) with the kernel
builder this module hands them. A new optimizer with a kernel is its own file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["CLIP", "ENABLED", "LOAD", "WD", "Kernel", "define", "fused_step"]

ENABLED = True
"""When False, :func:`fused_step` always declines and ``_step`` does the work."""

# The loop bodies' common steps. Reading/writing the outputs in place is how
# ElementwiseKernel does in-place updates (out params are references).
LOAD = "acc_t w = (acc_t)weight;\nacc_t g = (acc_t)grad * rescale;\n"
"""A body's first step: the weight ``w`` and the rescaled gradient ``g`` in acc_t."""
# NumPy skips `g += wd * w` when wd == 0; a branch (uniform across threads) keeps
# -0.0 and non-finite weights bit-identical to that.
WD = "if (wd != 0) g = g + wd * w;\n"
"""Weight decay into ``g`` (skipped where wd is 0, as NumPy's path skips it)."""
CLIP = "g = kv_clip(g, clip_g);\n"
"""``g`` clipped to ``[-clip_g, clip_g]`` (NaN passes, as in numpy.clip)."""


@dataclass(frozen=True)
class Kernel:
    """One fused kernel: its name, the scalars after the common ``(rescale, clip_g,
    wd, lr)``, the state arrays after the weight, and the CUDA loop body (element
    types ``T``, the weight's, and ``acc_t``, float or double)."""
    name: str
    scalars: tuple[str, ...]
    states: tuple[str, ...]
    body: str


def define(name: str, scalars: tuple[str, ...], states: tuple[str, ...], body: str) -> Kernel:
    """Declare kernel ``name`` (an optimizer's module does, at import). Raises
    ValueError if another kernel of that name was declared."""
    kernel = Kernel(name, tuple(scalars), tuple(states), body)
    if _SPECS.setdefault(name, kernel) != kernel:
        raise ValueError(f"fused kernel {name!r} is declared twice, differently")
    return kernel


_SPECS: dict[str, Kernel] = {}     # name -> kernel, filled by define()

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

        spec = _SPECS[name]
        scalars, states, body = spec.scalars, spec.states, spec.body
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


def common(o, lr) -> list:
    """The scalars every kernel takes first: ``[rescale, clip_g, wd, lr]``."""
    clip_g = math.inf if o.clip_bound is None else o.clip_bound
    return [o.rescale_grad, clip_g, o.wd, lr]


def norm_terms(o, weight, grad, state, t, lr, index, xp, launch=None):
    """Phase 1 of a layer-wise (``fused_norms``: LARS, LAMB) update on the device:
    ``(terms, carry)`` as the optimizer's ``chunk_terms`` give them, computed by its
    ``fused_norm_terms`` with ``launch(name, dtype)``, the kernel builder (the CUDA
    one; CI passes the host build)."""
    if grad.dtype != weight.dtype:
        grad = grad.astype(weight.dtype)
    return o.fused_norm_terms(weight, grad, state, t, lr, index, xp, launch or _kernel)


def apply_norms(o, weight, grad, state, t, lr, sums, carry, launch=None) -> None:
    """Phase 2 of a layer-wise update on the device (the optimizer's
    ``fused_apply_norms``), with the key's ``sums`` of the terms and phase 1's
    ``carry``."""
    if grad.dtype != weight.dtype:
        grad = grad.astype(weight.dtype)
    o.fused_apply_norms(weight, grad, state, t, lr, list(sums), carry, launch or _kernel)


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
    return name, common(optimizer, lr) + [scalars[s] for s in _SPECS[name].scalars]


def kernel_source(name) -> tuple[tuple, tuple, str, str]:
    """``(scalar names, state names, loop body, preamble with acc_t left open)`` of
    kernel ``name``: what :func:`_kernel` compiles (and CI compiles for the host)."""
    spec = _SPECS[name]
    return ("rescale", "clip_g", "wd", "lr") + spec.scalars, spec.states, spec.body, _PREAMBLE
