"""LBSGD: large-batch SGD that sums ``batch_scale`` pushes before each step and warms
its learning rate up (MXNet 1.x ``LBSGD``)."""

from __future__ import annotations

import math

from ..errors import ConfigError
from ._util import integer, momentum_factor
from .base import Optimizer, register
from .layerwise import check_whole, sum_sq

__all__ = ["LBSGD"]

STRATEGIES = ("linear", "power2", "sqrt", "lars")


@register
class LBSGD(Optimizer):
    """Large-batch SGD (MXNet 1.x ``LBSGD``; state ``(cum_grad,)``, then ``(mom,)`` with
    momentum). Update ``n = begin_epoch * updates_per_epoch + t`` adds the gradient
    to ``cum_grad``; every ``batch_scale``-th one steps on their mean::

        g = cum_grad / batch_scale;  cum_grad = 0
        lr_n = lr * mult;  mom = momentum * mom - lr_n * (clip(rescale_grad * g, c) + wd * w);  w += mom

    (``w -= lr_n * (...)`` without momentum), where ``mult`` warms up over
    ``warmup_epochs * updates_per_epoch`` updates from 1 to ``batch_scale``:
    ``linear`` ``1 + (s - 1) n / N``, ``power2`` ``1 + (s - 1) (n / N)**2``, ``sqrt``
    ``1 + (s - 1) sqrt(n / N)``; or, with ``lars``, is the layer's
    ``sqrt(|w|^2 / (|g|^2 + wd |w|^2 + 1e-18))`` clipped to [0.01, 100], over the
    whole key (kvstore.optimizer.layerwise). The other updates leave the weight alone.
    As in MXNet, a learning-rate scheduler is read at the update count before this
    one. ``num_epochs`` is kept for MXNet's signature and not used (nor is it there).
    Raises ConfigError for an unknown ``warmup_strategy``, ``batch_scale``,
    ``updates_per_epoch`` < 1, or negative epochs. MXNet's defaults: ``momentum``
    0, ``warmup_strategy`` "linear", ``warmup_epochs`` 5, ``batch_scale`` 1,
    ``updates_per_epoch`` 32, ``begin_epoch`` 0, ``num_epochs`` 60.

    Example: ``LBSGD(learning_rate=0.1, momentum=0.9, batch_scale=8, warmup_epochs=5,
    updates_per_epoch=469)``
    """

    name = "lbsgd"
    hyper_params = ("momentum", "warmup_strategy", "warmup_epochs", "batch_scale", "updates_per_epoch",
                    "begin_epoch", "num_epochs")

    def __init__(self, *, momentum: float = 0.0, warmup_strategy: str = "linear", warmup_epochs: int = 5,
                 batch_scale: int = 1, updates_per_epoch: int = 32, begin_epoch: int = 0, num_epochs: int = 60,
                 **common) -> None:
        super().__init__(**common)
        owner = type(self).__name__
        self.momentum = momentum_factor(owner, momentum)
        if warmup_strategy not in STRATEGIES:
            raise ConfigError(f"{owner}: warmup_strategy must be one of {', '.join(STRATEGIES)}, "
                              f"got {warmup_strategy!r}")
        self.warmup_strategy = warmup_strategy
        self.warmup_epochs = integer(owner, "warmup_epochs", warmup_epochs, lo=0)
        self.batch_scale = integer(owner, "batch_scale", batch_scale, lo=1)
        self.updates_per_epoch = integer(owner, "updates_per_epoch", updates_per_epoch, lo=1)
        self.begin_epoch = integer(owner, "begin_epoch", begin_epoch, lo=0)
        self.num_epochs = integer(owner, "num_epochs", num_epochs, lo=0)

    @property
    def num_states(self):
        return 2 if self.momentum > 0.0 else 1

    def needs_whole_keys(self) -> bool:
        return self.warmup_strategy == "lars"

    def _mult(self, n: int) -> float:
        """MXNet's ``_get_lbmult``: the warm-up multiplier of update ``n``."""
        warmup, top = self.warmup_epochs * self.updates_per_epoch, float(self.batch_scale)
        if n >= warmup:
            return top
        if warmup <= 1:
            return 1.0
        if self.warmup_strategy == "linear":
            return 1.0 + (top - 1) * n / warmup
        if self.warmup_strategy == "power2":
            return 1.0 + (top - 1) * (n * n) / (warmup * warmup)
        return 1.0 + (top - 1) * math.sqrt(float(n) / warmup)

    def _step_at(self, weight, grad, state, t, lr, xp, index, rows) -> None:
        if self.needs_whole_keys():
            check_whole("LBSGD", index, rows)
        cum = state[0]
        cum += grad.astype(weight.dtype, copy=False)
        n = self.begin_epoch * self.updates_per_epoch + t - self.begin_num_update   # MXNet's num_cums
        if n % self.batch_scale:
            return
        lr = (self.learning_rate_at(t - 1) if t > 1 else self.learning_rate_at(1)) * self.lr_scale
        g = cum / self.batch_scale
        cum[...] = 0
        if self.warmup_strategy == "lars":
            w2, g2 = sum_sq(weight, xp), sum_sq(g, xp)
            mult = min(max(math.sqrt(w2 / (g2 + self.wd * w2 + 1e-18)), 0.01), 100.0)
        else:
            mult = self._mult(n)
        g = self._rescaled_grad(weight, g, xp, wd_before_clip=False)
        if self.wd:
            g += self.wd * weight
        g *= lr * mult
        if len(state) == 1:
            weight -= g
            return
        mom = state[1]
        mom *= self.momentum
        mom -= g
        weight += mom
