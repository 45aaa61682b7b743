"""AdaDelta (MXNet 1.x ``AdaDelta``): per-coordinate steps from running averages of
squared gradients and squared steps, with no learning rate."""

from __future__ import annotations

from ._util import real, unit
from . import fused
from .base import Optimizer, register

__all__ = ["AdaDelta"]


# its fused GPU kernel (kvstore.optimizer.fused; the scalars: fused_plan)
fused.define('adadelta', ("rho", "omr", "eps"), ("acc_g", "acc_delta"), fused.LOAD + fused.CLIP + """
        acc_t ag = (acc_t)acc_g * rho + (omr * g) * g;
        acc_g = (T)ag;
        acc_t d = sqrt((acc_t)acc_delta + eps) / sqrt(ag + eps) * g;
        acc_delta = (T)((acc_t)acc_delta * rho + (omr * d) * d);
        if (wd != 0) d = d + wd * w;
        weight = (T)(w - d);""")


@register
class AdaDelta(Optimizer):
    """AdaDelta (Zeiler 2012; MXNet 1.x ``AdaDelta``; state ``(acc_g, acc_delta)``)::

        g = clip(g, c)
        acc_g = rho * acc_g + (1 - rho) * g**2
        delta = sqrt(acc_delta + epsilon) / sqrt(acc_g + epsilon) * g
        acc_delta = rho * acc_delta + (1 - rho) * delta**2
        w -= delta + wd * w

    As in MXNet 1.x, the step has no learning rate: ``learning_rate`` and
    ``lr_scheduler`` are accepted and have no effect, and ``wd`` stays out of the
    averages. MXNet 1.9 also multiplies the caller's gradient by ``rescale_grad``
    in place (here it is left alone) and keeps float32 states whatever the
    weight's dtype (so a float16 or float64 weight fails there; here the states
    take the weight's dtype). Raises ConfigError unless ``0 <= rho < 1`` and
    ``epsilon > 0`` (with 0 no coordinate ever moves). MXNet's defaults: ``rho``
    0.9, ``epsilon`` 1e-5.

    Example: ``AdaDelta(rho=0.95, epsilon=1e-6)``
    """

    name = "adadelta"
    kernel_clip = False      # MXNet clips in Python: clip_gradient must be None or > 0
    hyper_params = ("rho", "epsilon")
    num_states = 2

    def __init__(self, *, rho: float = 0.9, epsilon: float = 1e-5, **common) -> None:
        super().__init__(**common)
        owner = type(self).__name__
        self.rho = unit(owner, "rho", rho)
        self.epsilon = real(owner, "epsilon", epsilon, lo=0.0, lo_open=True)

    def fused_plan(self, state, t, lr, dtype) -> tuple[str, dict]:
        """This update's fused GPU kernel (kvstore.optimizer.fused): ``(kernel name,
        {scalar: value})``, the scalars computed as :meth:`_step` computes them."""
        return "adadelta", {"rho": self.rho, "omr": 1.0 - self.rho, "eps": self.epsilon}

    def _step(self, weight, grad, state, t: int, lr: float, xp) -> None:
        g = self._rescaled_grad(weight, grad, xp, wd_before_clip=False)
        acc_g, acc_delta = state
        acc_g *= self.rho
        acc_g += ((1.0 - self.rho) * g) * g
        delta = acc_delta + self.epsilon
        xp.sqrt(delta, out=delta)
        denom = acc_g + self.epsilon
        xp.sqrt(denom, out=denom)
        delta /= denom
        delta *= g
        acc_delta *= self.rho
        acc_delta += ((1.0 - self.rho) * delta) * delta
        if self.wd:
            delta += self.wd * weight
        weight -= delta
