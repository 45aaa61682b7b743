"""Signum and signSGD: steps of a fixed size along the sign of the momentum, or of
the gradient (MXNet 1.x ``Signum``)."""

from __future__ import annotations

from ..errors import ConfigError
from ._util import dtype_scalar, real, momentum_factor
from . import fused
from .base import Optimizer, register

__all__ = ["Signum"]


# its fused GPU kernels (kvstore.optimizer.fused; the scalars: fused_plan)
# Signum's scalars are computed in the weight's dtype, as MXNet's kernels do.
# Signum rounds to the weight's dtype after every operation (KV_R; nothing for
# float32 and float64): its step is a sign, which turns a float16 rounding
# difference near 0 into a whole step.
fused.define('signsgd', ("decay",), (), """
        acc_t w = (acc_t)weight;
        acc_t s = KV_R(kv_sign((acc_t)grad) * lr);
        if (wd != 0) w = KV_R(w * decay);
        weight = (T)(w - s);""")
fused.define('signum', ("momentum", "mwd", "omm", "wd_lh", "decay_lh"), ("mom",), """
        acc_t w = (acc_t)weight;
        acc_t g = KV_R(kv_clip(KV_R((acc_t)grad * rescale), clip_g));
        acc_t m = KV_R((acc_t)mom * momentum);
        if (wd != 0) m = KV_R(m - KV_R(mwd * w));
        m = KV_R(m - KV_R(g * omm));
        mom = (T)m;
        acc_t s = KV_R(kv_sign(m) * lr);
        if (wd_lh != 0) w = KV_R(w * decay_lh);
        weight = (T)(w + s);""")


@register
class Signum(Optimizer):
    """Signum (Bernstein et al. 2018; MXNet 1.x ``Signum``).

    ``momentum > 0`` (MXNet ``signum_update``; state ``(mom,)``, the negated
    momentum as MXNet keeps it)::

        mom = momentum * mom - (1 - momentum) * wd * w - (1 - momentum) * clip(g, c)
        w = (1 - lr * wd_lh) * w + lr * sign(mom)

    ``momentum == 0`` (signSGD, MXNet ``signsgd_update``; stateless)::

        w = (1 - lr * wd) * w - lr * sign(grad)

    so without momentum ``wd`` is decoupled from the gradient (as ``wd_lh`` is with
    it), and rescaling and clipping change nothing (neither changes a sign).
    ``wd_lh`` is Loshchilov and Hutter's decoupled weight decay; MXNet's
    ``signsgd_update`` has no such argument and fails on it, so here ``wd_lh``
    with ``momentum == 0`` is a ConfigError. Raises ConfigError also unless
    ``0 <= momentum <= 1`` and ``wd_lh >= 0``. MXNet's defaults: ``learning_rate``
    0.01, ``momentum`` 0.9, ``wd_lh`` 0.

    Example: ``Signum(learning_rate=1e-3, momentum=0.9, wd_lh=1e-4)``
    """

    name = "signum"
    hyper_params = ("momentum", "wd_lh")

    def __init__(self, *, learning_rate: float | None = 0.01, momentum: float = 0.9, wd_lh: float = 0.0,
                 **common) -> None:
        super().__init__(learning_rate=learning_rate, **common)   # MXNet's default is 0.01, not None
        owner = type(self).__name__
        self.momentum = momentum_factor(owner, momentum)
        self.wd_lh = real(owner, "wd_lh", wd_lh, lo=0.0)
        if self.wd_lh and not self.momentum:
            raise ConfigError(f"{owner}: wd_lh needs momentum > 0 (MXNet's signsgd_update has no "
                              "wd_lh); without momentum, wd is the decoupled weight decay")

    @property
    def num_states(self) -> int:
        # As MXNet: no momentum buffer (and signsgd_update) when momentum is 0.
        return 1 if self.momentum > 0.0 else 0

    def fused_plan(self, state, t, lr, dtype) -> tuple[str, dict]:
        """This update's fused GPU kernel (kvstore.optimizer.fused): ``(kernel name,
        {scalar: value})``, the scalars computed as :meth:`_step` computes them."""
        f = dtype_scalar(dtype)
        one, lr_ = f(1), f(lr)
        if not state:
            return "signsgd", {"decay": float(one - lr_ * f(self.wd))}
        momentum = f(self.momentum)
        return "signum", {"momentum": float(momentum), "mwd": float((one - momentum) * f(self.wd)),
                          "omm": float(one - momentum), "wd_lh": self.wd_lh,
                          "decay_lh": float(one - lr_ * f(self.wd_lh))}

    def _step(self, weight, grad, state, t: int, lr: float, xp) -> None:
        # MXNet's kernels do their scalar math in the weight's dtype; so does this
        f = weight.dtype.type
        one, lr_ = f(1), f(lr)
        if not state:
            step = grad.astype(weight.dtype, copy=True)   # the caller's grad stays intact
            xp.sign(step, out=step)
            step *= lr_
            if self.wd:
                weight *= one - lr_ * f(self.wd)
            weight -= step
            return
        (mom,) = state
        g = self._rescaled_grad(weight, grad, xp, wd_before_clip=False)
        # MXNet's order: momentum * mom - ((1 - momentum) * wd) * w - (1 - momentum) * g
        momentum = f(self.momentum)
        mom *= momentum
        if self.wd:
            mom -= ((one - momentum) * f(self.wd)) * weight
        g *= one - momentum
        mom -= g
        xp.sign(mom, out=g)
        g *= lr_
        if self.wd_lh:
            weight *= one - lr_ * f(self.wd_lh)
        weight += g
