"""FTML, Follow the Moving Leader (MXNet 1.x ``FTML``, ``ftml_update``)."""

from __future__ import annotations

from ._util import dtype_scalar, nonzero_lr, real, unit
from . import fused
from .base import Optimizer, register

__all__ = ["FTML"]


# its fused GPU kernel (kvstore.optimizer.fused; the scalars, in the weight's dtype as MXNet's kernels: fused_plan)
fused.define('ftml', ("beta1", "omb1", "beta2", "omb2", "cv", "eps", "cd"), ("d", "v", "z"), fused.LOAD + fused.WD + fused.CLIP + """
        acc_t vv = (acc_t)v * beta2 + omb2 * (g * g);
        v = (T)vv;
        acc_t dt = (sqrt(vv / cv) + eps) * cd;
        acc_t zz = (acc_t)z * beta1 + g * omb1;
        acc_t dd = (dt - (acc_t)d * beta1) * w;
        zz = zz - dd;
        z = (T)zz;
        d = (T)dt;
        weight = (T)(-(zz / dt));""")


@register
class FTML(Optimizer):
    """FTML (Zheng & Kwok 2017; MXNet ``ftml_update``; state ``(d, v, z)``)::

        g = clip(g + wd * w, c)
        v = beta2 * v + (1 - beta2) * g**2
        d_t = (1 - beta1**t) / lr * (sqrt(v / (1 - beta2**t)) + epsilon)
        z = beta1 * z + (1 - beta1) * g - (d_t - beta1 * d) * w
        d = d_t
        w = -z / d_t

    (The kernel's math; the parentheses in MXNet's docstring are misplaced.) The
    weight is recomputed from ``z`` rather than stepped, so the lr divides: a
    scheduled learning rate of 0 raises ValueError from :meth:`update`, changing
    nothing. Raises ConfigError unless ``0 <= beta1, beta2 < 1``, ``epsilon > 0``
    (with 0, a coordinate whose gradients are all 0 gets 0 / 0) and
    ``learning_rate > 0``. MXNet's defaults: ``learning_rate`` 0.01, ``beta1``
    0.6, ``beta2`` 0.999, ``epsilon`` 1e-8.

    Example: ``FTML(learning_rate=2e-3, beta1=0.6, beta2=0.999)``
    """

    name = "ftml"
    hyper_params = ("beta1", "beta2", "epsilon")
    num_states = 3

    def __init__(self, *, beta1: float = 0.6, beta2: float = 0.999, epsilon: float = 1e-8,
                 **common) -> None:
        super().__init__(**common)
        owner = type(self).__name__
        # a learning rate of 0 is accepted, as MXNet does; an update at 0 is refused (nonzero_lr)
        self.beta1 = unit(owner, "beta1", beta1)
        self.beta2 = unit(owner, "beta2", beta2)
        self.epsilon = real(owner, "epsilon", epsilon, lo=0.0, lo_open=True)

    def fused_plan(self, state, t, lr, dtype) -> tuple[str, dict]:
        """This update's fused GPU kernel (kvstore.optimizer.fused): ``(kernel name,
        {scalar: value})``, the scalars computed as :meth:`_step` computes them."""
        nonzero_lr(type(self).__name__, lr, t)        # raised before anything changes, as _step
        f = dtype_scalar(dtype)
        one, beta1, beta2 = f(1), f(self.beta1), f(self.beta2)
        return "ftml", {"beta1": float(beta1), "omb1": float(one - beta1), "beta2": float(beta2),
                        "omb2": float(one - beta2), "cv": float(one - beta2 ** f(t)),
                        "eps": float(f(self.epsilon)), "cd": float((one - beta1 ** f(t)) / f(lr))}

    def _step(self, weight, grad, state, t: int, lr: float, xp) -> None:
        nonzero_lr(type(self).__name__, lr, t)
        # MXNet's kernel does its scalar math in the weight's dtype too: 1 - beta2 and
        # 1 - beta2**t from a float32 beta2 differ from float64's by ~1e-5 relative
        f = weight.dtype.type
        one, beta1, beta2 = f(1), f(self.beta1), f(self.beta2)
        g = self._rescaled_grad(weight, grad, xp, wd_before_clip=True)
        d, v, z = state
        v *= beta2
        v += (one - beta2) * (g * g)
        d_t = v / (one - beta2 ** f(t))
        xp.sqrt(d_t, out=d_t)
        d_t += f(self.epsilon)
        d_t *= (one - beta1 ** f(t)) / f(lr)
        z *= beta1
        g *= one - beta1
        z += g
        d *= beta1               # d becomes (d_t - beta1 * d) * w, then d_t
        xp.subtract(d_t, d, out=d)
        d *= weight
        z -= d
        xp.copyto(d, d_t)
        xp.divide(z, d_t, out=weight)
        xp.negative(weight, out=weight)
