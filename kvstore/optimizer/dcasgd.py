"""DC-ASGD: asynchronous SGD with delay compensation (MXNet 1.x ``DCASGD``)."""

from __future__ import annotations

from ._util import _array_module, real, momentum_factor
from . import fused
from .base import Optimizer, register

__all__ = ["DCASGD"]


# its fused GPU kernels (kvstore.optimizer.fused; the scalars: fused_plan)
fused.define('dcasgd', ("lamda", "neg_lr"), ("prev",), fused.LOAD + fused.CLIP + """
        acc_t dc = g * lamda * g * (w - (acc_t)prev);
        """ + fused.WD + """
        g = (g + dc) * neg_lr;
        prev = (T)w;
        weight = (T)(w + g);""")
fused.define('dcasgd_mom', ("lamda", "neg_lr", "momentum"), ("mom", "prev"), fused.LOAD + fused.CLIP + """
        acc_t dc = g * lamda * g * (w - (acc_t)prev);
        """ + fused.WD + """
        g = (g + dc) * neg_lr;
        acc_t m = (acc_t)mom * momentum + g;
        mom = (T)m;
        prev = (T)w;
        weight = (T)(w + m);""")


@register
class DCASGD(Optimizer):
    """DC-ASGD (Zheng et al. 2017; MXNet 1.x ``DCASGD``). State ``(prev,)``, or
    ``(mom, prev)`` with momentum; ``prev`` is the weight before the weight's last
    update, and starts as a copy of the weight (MXNet's ``weight.copy()``)::

        g = clip(g, c)
        step = -lr * (g + wd * w + lamda * g * g * (w - prev))
        mom = momentum * mom + step        (momentum > 0; else mom = step)
        prev = w
        w += mom

    The ``lamda * g * g * (w - prev)`` term compensates a gradient computed on a
    weight that has moved since (``w - prev`` is the last update's step). With
    ``momentum > 0`` MXNet 1.9's code cannot run (it tests an array's truth value:
    ValueError, or an AssertionError for a one-element weight); this is the update
    that code spells out. (MXNet 2 runs it, and also moves ``wd * w`` into ``g``.)
    Raises ConfigError unless ``0 <= momentum <= 1`` and ``lamda >= 0``. MXNet's
    defaults: ``learning_rate`` 0.01, ``momentum`` 0, ``lamda`` 0.04.

    Example: ``DCASGD(learning_rate=0.1, lamda=0.04)``
    """

    name = "dcasgd"
    kernel_clip = False      # MXNet clips in Python: clip_gradient must be None or > 0
    hyper_params = ("momentum", "lamda")

    def __init__(self, *, momentum: float = 0.0, lamda: float = 0.04, **common) -> None:
        super().__init__(**common)
        owner = type(self).__name__
        self.momentum = momentum_factor(owner, momentum)
        self.lamda = real(owner, "lamda", lamda, lo=0.0)

    @property
    def num_states(self) -> int:
        return 2 if self.momentum > 0.0 else 1

    def create_state(self, weight):
        """As :meth:`Optimizer.create_state`, but the last array, the previous weight,
        is a copy of ``weight`` (of its float32 master copy's values with one)."""
        state = super().create_state(weight)
        _array_module(weight).copyto(state[-1], weight)
        return state

    def fused_plan(self, state, t, lr, dtype) -> tuple[str, dict]:
        """This update's fused GPU kernel (kvstore.optimizer.fused): ``(kernel name,
        {scalar: value})``, the scalars computed as :meth:`_step` computes them."""
        common = {"lamda": self.lamda, "neg_lr": -lr}
        if self.momentum > 0.0:
            return "dcasgd_mom", dict(common, momentum=self.momentum)
        return "dcasgd", common

    def _step(self, weight, grad, state, t: int, lr: float, xp) -> None:
        g = self._rescaled_grad(weight, grad, xp, wd_before_clip=False)
        prev = state[-1]
        # MXNet's order: (g + wd * w) + ((lamda * g) * g) * (w - prev)
        dc = g * self.lamda
        dc *= g
        xp.subtract(weight, prev, out=prev)   # prev is rewritten below anyway
        dc *= prev
        if self.wd:
            g += self.wd * weight
        g += dc
        g *= -lr
        if self.momentum > 0.0:
            mom = state[0]
            mom *= self.momentum
            mom += g
            g = mom
        xp.copyto(prev, weight)
        weight += g
