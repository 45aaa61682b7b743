"""Nadam, Adam with Nesterov momentum (MXNet 1.x ``Nadam``)."""

from __future__ import annotations

from ._util import real, unit
from . import fused
from .base import Optimizer, register

__all__ = ["Nadam"]

# Below this, 1 - m_schedule is 1.0 in float64 (half an ulp of 1 is 2**-54), so the
# product no longer changes an update: it is not computed further.
_NEGLIGIBLE = 2.0 ** -60


# its fused GPU kernel (kvstore.optimizer.fused; the scalars: fused_plan)
fused.define('nadam', ("beta1", "omb1", "beta2", "omb2", "c_ms", "c_mu", "c_bar", "mu_next", "c_v", "eps"), ("m", "v"), fused.LOAD + fused.WD + fused.CLIP + """
        acc_t mm = (acc_t)m * beta1 + omb1 * g;
        acc_t vv = (acc_t)v * beta2 + (omb2 * g) * g;
        m = (T)mm;
        v = (T)vv;
        acc_t bar = mm / c_bar * mu_next + g / c_ms * c_mu;
        weight = (T)(w - bar * lr / (sqrt(vv / c_v) + eps));""")


@register
class Nadam(Optimizer):
    """Nadam (Dozat 2016; MXNet 1.x ``Nadam``; state ``(m, v)``)::

        g = clip(g + wd * w, c)
        mu_t = beta1 * (1 - 0.5 * 0.96**(t * schedule_decay))      (and mu_{t+1})
        m_schedule_t = mu_1 * mu_2 * ... * mu_t
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g**2
        m_bar = (1 - mu_t) * g / (1 - m_schedule_t)
                + mu_{t+1} * m / (1 - m_schedule_t * mu_{t+1})
        w -= lr * m_bar / (sqrt(v / (1 - beta2**t)) + epsilon)

    ``m_schedule`` is a function of the weight's update count ``t``, so it needs no
    state and survives restarts. MXNet 1.9 keeps one ``m_schedule`` per optimizer
    and advances it at every parameter's update, so there a parameter's update
    depends on how many others there are and in which order they are updated (with
    one parameter the two agree, which the tests check against MXNet's numbers);
    per weight, as here, is the paper's schedule. Raises ConfigError unless
    ``0 <= beta1, beta2 < 1``, ``epsilon >= 0`` and ``schedule_decay >= 0``.
    MXNet's defaults: ``learning_rate`` 0.001, ``beta1`` 0.9, ``beta2`` 0.999,
    ``epsilon`` 1e-8, ``schedule_decay`` 0.004.

    Example: ``Nadam(learning_rate=1e-3, schedule_decay=0.004)``
    """

    name = "nadam"
    kernel_clip = False      # MXNet clips in Python: clip_gradient must be None or > 0
    hyper_params = ("beta1", "beta2", "epsilon", "schedule_decay")
    num_states = 2

    def __init__(self, *, learning_rate: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8, schedule_decay: float = 0.004, **common) -> None:
        super().__init__(learning_rate=learning_rate, **common)
        owner = type(self).__name__
        self.beta1 = unit(owner, "beta1", beta1)
        self.beta2 = unit(owner, "beta2", beta2)
        self.epsilon = real(owner, "epsilon", epsilon, lo=0.0)
        self.schedule_decay = real(owner, "schedule_decay", schedule_decay, lo=0.0)
        # _products[t] = m_schedule_t, grown on demand; replaced whole (never appended
        # to in place) so that concurrent updates of two weights only ever read a
        # complete tuple.
        self._products: tuple[float, ...] = (1.0,)

    def _mu(self, t: int) -> float:
        """The momentum of update ``t``, as MXNet computes it."""
        return self.beta1 * (1. - 0.5 * (pow(0.96, t * self.schedule_decay)))

    def _m_schedule(self, t: int) -> float:
        """``mu_1 * ... * mu_t``, multiplied in MXNet's order (0.0 once negligible)."""
        products = self._products
        if t >= len(products) and products[-1] >= _NEGLIGIBLE:
            grown = list(products)
            goal = max(t + 1, 2 * len(grown))    # doubling: amortised O(1) per update
            while len(grown) < goal and grown[-1] >= _NEGLIGIBLE:
                grown.append(grown[-1] * self._mu(len(grown)))
            self._products = products = tuple(grown)
        return products[t] if t < len(products) else 0.0

    def fused_plan(self, state, t, lr, dtype) -> tuple[str, dict]:
        """This update's fused GPU kernel (kvstore.optimizer.fused): ``(kernel name,
        {scalar: value})``, the scalars computed as :meth:`_step` computes them."""
        mu_t, mu_next, m_schedule = self._mu(t), self._mu(t + 1), self._m_schedule(t)
        return "nadam", {"beta1": self.beta1, "omb1": 1.0 - self.beta1, "beta2": self.beta2,
                         "omb2": 1.0 - self.beta2, "c_ms": 1.0 - m_schedule, "c_mu": 1.0 - mu_t,
                         "c_bar": 1.0 - m_schedule * mu_next, "mu_next": mu_next,
                         "c_v": 1.0 - self.beta2 ** t, "eps": self.epsilon}

    def _step(self, weight, grad, state, t: int, lr: float, xp) -> None:
        g = self._rescaled_grad(weight, grad, xp, wd_before_clip=True)
        mu_t, mu_next = self._mu(t), self._mu(t + 1)
        m_schedule = self._m_schedule(t)
        m, v = state
        m *= self.beta1
        m += (1.0 - self.beta1) * g
        v *= self.beta2
        v += ((1.0 - self.beta2) * g) * g
        # m_bar = (1 - mu_t) * (g / (1 - m_schedule)) + mu_next * (m / (1 - m_schedule * mu_next))
        g /= 1.0 - m_schedule
        g *= 1.0 - mu_t
        m_bar = m / (1.0 - m_schedule * mu_next)
        m_bar *= mu_next
        m_bar += g
        denom = v / (1.0 - self.beta2 ** t)
        xp.sqrt(denom, out=denom)
        denom += self.epsilon
        m_bar *= lr
        m_bar /= denom
        weight -= m_bar
