"""FTRL-Proximal (MXNet 1.x ``Ftrl``, ``ftrl_update``): per-coordinate rates with L1
and L2 regularisation, the optimizer of sparse linear models."""

from __future__ import annotations

from ._util import nonzero_lr, real
from . import fused
from .base import Optimizer, register

__all__ = ["Ftrl"]


# its fused GPU kernel (kvstore.optimizer.fused; the scalars: fused_plan)
fused.define('ftrl', ("lamda1", "beta"), ("z", "n"), fused.LOAD + fused.CLIP + """
        acc_t g2 = g * g;
        acc_t nn = (acc_t)n;
        acc_t sigma = (sqrt(nn + g2) - sqrt(nn)) * w / lr;
        acc_t zz = (acc_t)z + (g - sigma);
        nn = nn + g2;
        z = (T)zz;
        n = (T)nn;
        acc_t live = kv_abs(zz) > lamda1 ? (acc_t)1 : (acc_t)0;
        acc_t denom = (sqrt(nn) + beta) / lr + wd + ((acc_t)1 - live);
        weight = (T)((kv_sign(zz) * lamda1 - zz) / denom * live);""")


@register
class Ftrl(Optimizer):
    """FTRL-Proximal (McMahan et al. 2013; MXNet ``ftrl_update``; state ``(z, n)``)::

        g = clip(g, c)
        z += g - (sqrt(n + g**2) - sqrt(n)) * w / lr
        n += g**2
        w = (sign(z) * lamda1 - z) / ((beta + sqrt(n)) / lr + wd) * (abs(z) > lamda1)

    ``wd`` is the L2 term (in the denominator only), ``lamda1`` the L1 term: a
    coordinate with ``abs(z) <= lamda1`` is exactly 0. A row-sparse update is
    lazy, as MXNet's (only the pushed rows, their ``z`` and ``n`` change). Where
    MXNet computes 0 / 0 (``beta == wd == 0`` and a coordinate whose gradients
    are all 0), the weight is 0 here, as the last factor says, not NaN. The lr
    divides: a scheduled learning rate of 0 raises ValueError from
    :meth:`update`, changing nothing. Raises ConfigError unless ``lamda1 >= 0``,
    ``beta >= 0`` and ``learning_rate > 0``. MXNet's defaults: ``learning_rate``
    0.1, ``lamda1`` 0.01, ``beta`` 1.

    Example: ``Ftrl(learning_rate=0.1, lamda1=0.01, beta=1.0, wd=1e-4)``
    """

    name = "ftrl"
    hyper_params = ("lamda1", "beta")
    num_states = 2

    def __init__(self, *, learning_rate: float = 0.1, lamda1: float = 0.01, beta: float = 1.0,
                 **common) -> None:
        super().__init__(learning_rate=learning_rate, **common)
        owner = type(self).__name__
        # a learning rate of 0 is accepted, as MXNet does; an update at 0 is refused (nonzero_lr)
        self.lamda1 = real(owner, "lamda1", lamda1, lo=0.0)
        self.beta = real(owner, "beta", beta, lo=0.0)

    def fused_plan(self, state, t, lr, dtype) -> tuple[str, dict]:
        """This update's fused GPU kernel (kvstore.optimizer.fused): ``(kernel name,
        {scalar: value})``, the scalars computed as :meth:`_step` computes them."""
        nonzero_lr(type(self).__name__, lr, t)
        return "ftrl", {"lamda1": self.lamda1, "beta": self.beta}

    def _step(self, weight, grad, state, t: int, lr: float, xp) -> None:
        nonzero_lr(type(self).__name__, lr, t)
        g = self._rescaled_grad(weight, grad, xp, wd_before_clip=False)
        z, n = state
        g2 = g * g
        # z += g - ((sqrt(n + g**2) - sqrt(n)) * w) / lr, in the kernel's order
        sigma = n + g2
        xp.sqrt(sigma, out=sigma)
        sigma -= xp.sqrt(n)
        sigma *= weight
        sigma /= lr
        g -= sigma
        z += g
        n += g2
        denom = xp.sqrt(n)
        denom += self.beta
        denom /= lr
        denom += self.wd
        live = xp.abs(z) > self.lamda1
        denom += ~live                 # masked out below: only keeps 0 / 0 from happening
        xp.sign(z, out=weight)
        weight *= self.lamda1
        weight -= z
        weight /= denom
        weight *= live
