"""LARS: SGD whose step is scaled per layer by the ratio of the weight's norm to the
gradient's (You et al. 2017; MXNet 1.x ``LARS``)."""

from __future__ import annotations

from ._util import boolean, real, momentum_factor
from . import fused
from .base import Optimizer, register
from .layerwise import EXCLUDED_SUFFIXES, root, sum_sq
from .layerwise_optimizer import LayerwiseOptimizer
from .optimizers import SGD_MOMENTUM, SGD_PLAIN

__all__ = ["LARS"]


@register
class LARS(LayerwiseOptimizer):
    """Layer-wise adaptive rate scaling (MXNet 1.x ``LARS``; state ``(mom,)`` with
    momentum, none without)::

        lr_key = lr * eta * |w| / (rescale_grad * |grad| + wd * |w| + eps)
                 (lr where |w| or |grad| is 0, and for keys named ...gamma, ...beta, ...bias)
        momentum_t = momentum * lr_t / lr_{t-1}     (momentum_correction, with a scheduler)
        mom = momentum_t * mom - lr_key * (clip(g, c) + wd * w);  w += mom

    (``w -= lr_key * (clip(g, c) + wd * w)`` without momentum.) The norms are over
    the whole key: a key reaches the optimizer whole, or (dist_sync) in chunks whose
    sums of squares the servers add up first (kvstore.optimizer.layerwise). A key's
    name is its ``param_idx2name`` entry, else ``str(key)``; with ``param_idx2name``,
    names not ending in ``_weight`` get ``wd_mult`` 0 unless given (MXNet's LARS rule).
    ``lazy_update`` (MXNet's, default True): a row-sparse gradient pushed to a dense
    key moves only its rows and their momentum (the norms stay the whole key's);
    False updates every row. Raises ConfigError unless ``0 <= momentum <= 1``,
    ``eta > 0`` and ``eps >= 0``. MXNet's defaults: ``momentum`` 0, ``eta`` 0.001,
    ``eps`` 0, ``momentum_correction`` True.

    Example: ``LARS(learning_rate=3.2, momentum=0.9, eta=0.001, wd=5e-4)``
    """

    name = "lars"
    hyper_params = ("momentum", "eta", "eps", "momentum_correction", "lazy_update")
    wd_kept = ("_weight",)           # MXNet's LARS.set_wd_mult

    def __init__(self, *, momentum: float = 0.0, eta: float = 0.001, eps: float = 0.0,
                 momentum_correction: bool = True, lazy_update: bool = True, **common) -> None:
        super().__init__(**common)
        owner = type(self).__name__
        self.momentum = momentum_factor(owner, momentum)
        self.eta = real(owner, "eta", eta, lo=0.0, lo_open=True)
        self.eps = real(owner, "eps", eps, lo=0.0)
        self.momentum_correction = boolean(owner, "momentum_correction", momentum_correction)
        self.lazy_update = boolean(owner, "lazy_update", lazy_update)

    @property
    def num_states(self):
        return 1 if self.momentum > 0.0 else 0

    def lazy_for(self, row_sparse_key: bool) -> bool:
        return self.lazy_update

    fused_norms = True

    def chunk_terms(self, weight, grad, state, t, lr, xp, index):
        """|w|^2 and |grad|^2 of these values (none for a key named ...gamma/beta/bias)."""
        if self.param_name(index).endswith(EXCLUDED_SUFFIXES):
            return [], None
        return [sum_sq(weight, xp), sum_sq(grad, xp)], None

    def key_rates(self, sums: list, t: int, lr: float) -> tuple[float, float]:
        """``(lr_key, momentum_t)`` of update ``t`` of a key with the sums of squares
        ``sums`` (of its weight and gradient; [] for an excluded key)."""
        lr_key = lr
        if sums:
            w_norm, g_norm = root(sums[0]), root(sums[1])
            if w_norm > 0.0 and g_norm > 0.0:
                denom = g_norm * self.rescale_grad + self.wd * w_norm + self.eps
                if denom == 0.0:        # a negative wd can cancel the rest (MXNet's rate is then inf)
                    raise ValueError(f"LARS: the layer's rate divides by |g| * rescale_grad + wd * |w| + eps, "
                                     f"which is 0 (wd {self.wd}, |w| {w_norm}, |g| {g_norm})")
                lr_key = lr * self.eta * w_norm / denom
        # the global rates (lr_mult cancels) of this update and of the previous one; after
        # kv.set_learning_rate, its state was rescaled by state_scale_from so that this is
        # as if that rate were used
        first = t <= self.begin_num_update + 1
        return lr_key, (self.momentum if first else self._momentum(self.learning_rate_at(t), self.learning_rate_at(t - 1)))

    def _momentum(self, lr: float, last: float) -> float:
        """MXNet's corrected momentum of an update at rate ``lr`` after one at ``last``."""
        if self.momentum_correction and last != 0:
            return self.momentum * (lr / last)
        return self.momentum

    def state_scale_from(self, previous: Optimizer, t: int) -> float:
        """MXNet corrects the momentum of the first update after a change of rate by
        new / previous rate, kv.set_learning_rate's changes included. ``key_rates``
        takes the previous rate from the schedule of this optimizer, so the momentum
        of a weight ``previous`` updated ``t`` times is multiplied by what that misses."""
        if not self.num_states or t < 1:
            return 1.0
        lr = self.learning_rate_at(t + 1)
        ours = self._momentum(lr, self.learning_rate_at(t))
        return self._momentum(lr, previous.learning_rate_at(t)) / ours if ours else 1.0

    def _apply(self, weight, grad, state, t, lr, xp, index, sums, carry) -> None:
        lr_key, momentum = self.key_rates(sums, t, lr)
        g = self._rescaled_grad(weight, grad, xp, wd_before_clip=False)
        if self.wd:
            g += self.wd * weight
        g *= lr_key
        if not state:
            weight -= g
            return
        (mom,) = state
        mom *= momentum
        mom -= g
        weight += mom

    def fused_norm_terms(self, weight, grad, state, t, lr, index, xp, launch):
        """:meth:`chunk_terms` on the device: two reductions, no kernel of its own."""
        return self.chunk_terms(weight, grad, state, t, lr, xp, index)

    def fused_apply_norms(self, weight, grad, state, t, lr, sums, carry, launch) -> None:
        """``_apply`` on the device: SGD's kernel at the key's rate and momentum."""
        lr_key, momentum = self.key_rates(sums, t, lr)
        if state:
            launch(SGD_MOMENTUM.name, weight.dtype)(grad, *fused.common(self, lr_key), momentum, weight, *state)
        else:
            launch(SGD_PLAIN.name, weight.dtype)(grad, *fused.common(self, lr_key), weight)
