"""AdaMax, Adam with the infinity norm (MXNet 1.x ``Adamax``)."""

from __future__ import annotations

from ._util import unit
from . import fused
from .base import Optimizer, register

__all__ = ["Adamax"]


# its fused GPU kernel (kvstore.optimizer.fused; the scalars: fused_plan)
fused.define('adamax', ("beta1", "omb1", "beta2", "lr_t"), ("m", "u"), fused.LOAD + fused.WD + fused.CLIP + """
        acc_t mm = (acc_t)m * beta1 + omb1 * g;
        acc_t uu = kv_max((acc_t)u * beta2, kv_abs(g));
        m = (T)mm;
        u = (T)uu;
        acc_t idle = uu == 0 ? (acc_t)1 : (acc_t)0;
        weight = (T)(w - mm * lr_t / (uu + idle) * ((acc_t)1 - idle));""")


@register
class Adamax(Optimizer):
    """AdaMax (Kingma & Ba 2015, section 7; MXNet 1.x ``Adamax``; state ``(m, u)``)::

        g = clip(g + wd * w, c)
        m = beta1 * m + (1 - beta1) * g
        u = max(beta2 * u, abs(g))
        w -= lr / (1 - beta1**t) * m / u

    MXNet 1.9 has no epsilon: where ``u`` is 0 (a coordinate whose gradients have
    all been 0) it divides by 0 and the weight becomes NaN for good; here such a
    coordinate does not move. (MXNet 2 adds an epsilon to ``u`` instead.) Raises
    ConfigError unless ``0 <= beta1, beta2 < 1``. MXNet's defaults:
    ``learning_rate`` 0.002, ``beta1`` 0.9, ``beta2`` 0.999.

    Example: ``Adamax(learning_rate=2e-3, beta1=0.9, beta2=0.999)``
    """

    name = "adamax"
    kernel_clip = False      # MXNet clips in Python: clip_gradient must be None or > 0
    hyper_params = ("beta1", "beta2")
    num_states = 2

    def __init__(self, *, learning_rate: float = 0.002, beta1: float = 0.9, beta2: float = 0.999,
                 **common) -> None:
        super().__init__(learning_rate=learning_rate, **common)
        owner = type(self).__name__
        self.beta1 = unit(owner, "beta1", beta1)
        self.beta2 = unit(owner, "beta2", beta2)

    def fused_plan(self, state, t, lr, dtype) -> tuple[str, dict]:
        """This update's fused GPU kernel (kvstore.optimizer.fused): ``(kernel name,
        {scalar: value})``, the scalars computed as :meth:`_step` computes them."""
        return "adamax", {"beta1": self.beta1, "omb1": 1.0 - self.beta1, "beta2": self.beta2,
                          "lr_t": lr / (1.0 - self.beta1 ** t)}

    def _step(self, weight, grad, state, t: int, lr: float, xp) -> None:
        lr_t = lr / (1.0 - self.beta1 ** t)      # on the host in float64, as MXNet
        g = self._rescaled_grad(weight, grad, xp, wd_before_clip=True)
        m, u = state
        m *= self.beta1
        m += (1.0 - self.beta1) * g
        u *= self.beta2
        xp.abs(g, out=g)
        xp.maximum(u, g, out=u)
        step = m * lr_t                           # MXNet's order: (lr * m) / u
        idle = u == 0
        step /= u + idle                          # 1 where u is 0: no 0 / 0 ...
        step *= ~idle                             # ... and no step there
        weight -= step
