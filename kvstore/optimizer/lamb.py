"""LAMB: Adam whose step is scaled per layer by the ratio of the weight's norm to the
update's (You et al. 2019; MXNet 1.x ``LAMB``)."""

from __future__ import annotations

from ._util import boolean, dtype_scalar, real, unit
from . import fused
from .base import register
from .layerwise import root, sum_sq
from .layerwise_optimizer import LayerwiseOptimizer

__all__ = ["LAMB"]


# its fused GPU kernels (kvstore.optimizer.fused; run by fused_norm_terms and fused_apply_norms)
# LAMB's phase 1 writes the new moments and the direction d
# beside the state (the state keeps the old moments until phase 2).
LAMB_TERMS = fused.define('lamb_terms', ("beta1", "omb1", "beta2", "omb2", "c1", "c2", "eps"), ("mean", "var", "m_new", "v_new", "d"), fused.LOAD + fused.CLIP + """
        acc_t m = (acc_t)mean * beta1 + omb1 * g;
        acc_t v = (acc_t)var * beta2 + (omb2 * g) * g;
        m_new = (T)m;
        v_new = (T)v;
        acc_t dd = m / c1 / (sqrt(v / c2) + eps);
        if (wd != 0) dd = dd + wd * w;
        d = (T)dd;""")
LAMB_APPLY = fused.define('lamb_apply', ("scale",), ("mean", "var", "m_new", "v_new", "d"), """
        mean = m_new;
        var = v_new;
        weight = (T)((acc_t)weight - KV_R((acc_t)d * scale));""")


@register
class LAMB(LayerwiseOptimizer):
    """Layer-wise adaptive moments (MXNet 1.x ``LAMB``: ``lamb_update_phase1`` and
    ``phase2``; state ``(mean, var)``)::

        g = clip(g, c)
        mean = beta1 * mean + (1 - beta1) * g;  var = beta2 * var + (1 - beta2) * g**2
        d = mean_hat / (sqrt(var_hat) + epsilon) + wd * w
            (mean_hat = mean / (1 - beta1**t), var_hat = var / (1 - beta2**t); the
            moments themselves without bias_correction)
        r1 = min(max(|w|, lower_bound), upper_bound);  r2 = |d|
        w -= lr * (r1 / r2 if r1 and r2 else 1) * d

    The norms are over the whole key: a key reaches the optimizer whole, or
    (dist_sync) in chunks whose sums of squares the servers add up first
    (kvstore.optimizer.layerwise). A bound of None (or 0) is not applied, as in MXNet.
    Raises ConfigError unless ``0 <= beta1, beta2 < 1``, ``epsilon >= 0`` and the
    bounds are None or >= 0. MXNet's defaults: ``learning_rate`` 0.001, ``beta1``
    0.9, ``beta2`` 0.999, ``epsilon`` 1e-6, no bounds, ``bias_correction`` True.

    Example: ``LAMB(learning_rate=0.01, wd=0.01, upper_bound=10.0)``
    """

    name = "lamb"
    hyper_params = ("beta1", "beta2", "epsilon", "lower_bound", "upper_bound", "bias_correction")
    num_states = 2

    def __init__(self, *, learning_rate: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-6, lower_bound: float | None = None, upper_bound: float | None = None,
                 bias_correction: bool = True, **common) -> None:
        super().__init__(learning_rate=learning_rate, **common)
        owner = type(self).__name__
        self.beta1 = unit(owner, "beta1", beta1)
        self.beta2 = unit(owner, "beta2", beta2)
        self.epsilon = real(owner, "epsilon", epsilon, lo=0.0)
        self.lower_bound = None if lower_bound is None else real(owner, "lower_bound", lower_bound, lo=0.0)
        self.upper_bound = None if upper_bound is None else real(owner, "upper_bound", upper_bound, lo=0.0)
        self.bias_correction = boolean(owner, "bias_correction", bias_correction)

    fused_norms = True

    def chunk_terms(self, weight, grad, state, t, lr, xp, index):
        """|w|^2 and |d|^2 of these values; the new moments and ``d`` are carried to
        phase 2, the state keeps the old ones until then."""
        g = self._rescaled_grad(weight, grad, xp, wd_before_clip=False)
        # the constants in the weight's dtype, as MXNet's kernels compute them: in
        # float32, 1 - 0.999 is 1.3e-5 away from 0.001 (the moments show it)
        dt = weight.dtype.type
        beta1, beta2, one = dt(self.beta1), dt(self.beta2), dt(1)
        mean, var = state
        mean = mean * beta1
        mean += (one - beta1) * g
        var = var * beta2
        var += ((one - beta2) * g) * g
        if self.bias_correction:
            d = mean / (one - beta1 ** dt(t))
            denom = xp.sqrt(var / (one - beta2 ** dt(t)))
        else:
            d = mean.copy()
            denom = xp.sqrt(var)
        denom += self.epsilon
        d /= denom
        if self.wd:
            d += self.wd * weight
        return [sum_sq(weight, xp), sum_sq(d, xp)], (mean, var, d)

    def _apply(self, weight, grad, state, t, lr, xp, index, sums, carry) -> None:
        mean, var, d = carry
        xp.copyto(state[0], mean)
        xp.copyto(state[1], var)
        d *= self.step_scale(sums, lr)
        weight -= d

    def step_scale(self, sums: list, lr: float) -> float:
        """What ``d`` is multiplied by for a key with the sums of squares ``sums`` (of
        its weight and of ``d``): ``lr * r1 / r2`` (``lr`` where either norm is 0)."""
        r1 = root(sums[0])
        if self.lower_bound:
            r1 = max(r1, self.lower_bound)
        if self.upper_bound:
            r1 = min(r1, self.upper_bound)
        r2 = root(sums[1])
        return lr * (r1 / r2) if r1 != 0.0 and r2 != 0.0 else lr

    def fused_norm_terms(self, weight, grad, state, t, lr, index, xp, launch):
        """:meth:`chunk_terms` on the device: the new moments and ``d`` from one kernel
        (into fresh arrays: the state keeps the old moments until phase 2), then two
        reductions. ``launch(name, dtype)`` builds a kernel (kvstore.optimizer.fused)."""
        f = dtype_scalar(weight.dtype)
        one, beta1, beta2 = f(1), f(self.beta1), f(self.beta2)
        c1, c2 = (one - beta1 ** f(t), one - beta2 ** f(t)) if self.bias_correction else (one, one)
        carry = tuple(xp.empty_like(weight) for _ in range(3))
        args = fused.common(self, lr) + [float(x) for x in (beta1, one - beta1, beta2, one - beta2, c1, c2)] \
            + [self.epsilon]
        launch(LAMB_TERMS.name, weight.dtype)(grad, *args, weight, *state, *carry)
        return [sum_sq(weight, xp), sum_sq(carry[2], xp)], carry

    def fused_apply_norms(self, weight, grad, state, t, lr, sums, carry, launch) -> None:
        """``_apply`` on the device, in one kernel: the new moments into the state and
        the step ``d`` scaled by :meth:`step_scale`."""
        args = fused.common(self, lr) + [self.step_scale(sums, lr)]
        launch(LAMB_APPLY.name, weight.dtype)(grad, *args, weight, *state, *carry)
