"""The built-in optimizers, with MXNet 1.x update math.

In every formula ``g`` starts as ``rescale_grad * grad``, ``clip(g, c)`` means
clipping to ``[-clip_gradient, clip_gradient]`` when ``clip_gradient`` is set,
``lr`` is ``learning_rate_at(t)``, and all arithmetic happens in place in the
weight's dtype. Default learning rates follow MXNet (0.01, but 0.001 for Adam
and RMSProp). Each constructor takes its own hyper-parameters and, as keywords,
those every :class:`~kvstore.optimizer.Optimizer` has (``learning_rate``, ``wd``,
``rescale_grad``, ``clip_gradient``, ``lr_scheduler``, ``multi_precision``).
"""

from __future__ import annotations

import math
from typing import ClassVar

from ..errors import ConfigError
from ._util import boolean, dtype_scalar, momentum_factor, real, unit
from . import fused
from .base import Optimizer, register

__all__ = ["SGD", "NAG", "Adam", "AdaGrad", "RMSProp", "Test"]


# its fused GPU kernels (kvstore.optimizer.fused; the scalars: fused_plan)
# sgd/nag/adagrad add wd after clipping, adam/rmsprop before (MXNet 1.x).
SGD_PLAIN = fused.define('sgd', (), (), fused.LOAD + fused.CLIP + fused.WD + "weight = (T)(w - g * lr);")
SGD_MOMENTUM = fused.define('sgd_mom', ("momentum",), ("mom",), fused.LOAD + fused.CLIP + fused.WD + """
        acc_t m = (acc_t)mom * momentum - g * lr;
        mom = (T)m;
        weight = (T)(w + m);""")
# torch's Nesterov (SGD(nesterov=True)): the momentum excludes the rate
fused.define('sgd_nesterov', ("momentum",), ("mom",), fused.LOAD + fused.CLIP + fused.WD + """
        acc_t m = (acc_t)mom * momentum + g;
        mom = (T)m;
        g = g + momentum * m;
        weight = (T)(w - g * lr);""")


@register
class SGD(Optimizer):
    """Stochastic gradient descent with optional (Nesterov) momentum.

    ``momentum == 0`` (stateless, MXNet ``sgd_update``)::

        w -= lr * (clip(g, c) + wd * w)

    ``momentum > 0`` (MXNet ``sgd_mom_update``; state ``(mom,)``)::

        mom = momentum * mom - lr * (clip(g, c) + wd * w);  w += mom

    ``nesterov=True`` (this project's option, for mirroring torch's
    ``SGD(nesterov=True)``; MXNet's SGD has none), torch's Nesterov update, whose
    momentum buffer excludes the learning rate::

        g = clip(g, c) + wd * w;  mom = momentum * mom + g;  w -= lr * (g + momentum * mom)

    MXNet's Nesterov optimizer is :class:`NAG` (its momentum includes the rate: the
    two agree while the rate is constant and ``wd`` is 0).

    ``lazy_update`` (MXNet's, default True): a row-sparse gradient, pushed to a dense
    or a row-sparse key, updates only its rows: their weights, weight decay and
    momentum (MXNet's ``lazy_update``); every other row is left as it is. False: every
    row, the gradient counting as zero outside its rows (MXNet's standard update).
    Raises ConfigError unless ``0 <= momentum <= 1``.

    Example: ``SGD(learning_rate=0.1, momentum=0.9, wd=1e-4)``
    """

    name = "sgd"
    hyper_params: ClassVar[tuple[str, ...]] = ("momentum", "nesterov", "lazy_update")

    def __init__(self, *, momentum=0.0, nesterov=False, lazy_update=True, **common):
        super().__init__(**common)
        owner = type(self).__name__
        self.momentum = momentum_factor(owner, momentum)
        self.nesterov = boolean(owner, "nesterov", nesterov)
        self.lazy_update = boolean(owner, "lazy_update", lazy_update)

    def lazy_for(self, row_sparse_key: bool) -> bool:
        return self.lazy_update

    @property
    def num_states(self):
        # Like MXNet, no momentum buffer is kept (or updated) when momentum is 0.
        return 1 if self.momentum > 0.0 else 0

    def fused_plan(self, state, t, lr, dtype) -> tuple[str, dict]:
        """This update's fused GPU kernel (kvstore.optimizer.fused): ``(kernel name,
        {scalar: value})``, the scalars computed as :meth:`_step` computes them."""
        if not state:
            return "sgd", {}
        return ("sgd_nesterov" if self.nesterov else "sgd_mom"), {"momentum": self.momentum}

    def _step(self, weight, grad, state, t, lr, xp):
        g = self._rescaled_grad(weight, grad, xp, wd_before_clip=False)
        if self.wd:
            g += self.wd * weight
        if not state:
            g *= lr
            weight -= g
            return
        (mom,) = state
        mom *= self.momentum
        if self.nesterov:
            # torch's SGD(nesterov=True): mom = momentum*mom + g;  w -= lr*(g + momentum*mom)
            mom += g
            g += self.momentum * mom
            g *= lr
            weight -= g
        else:
            g *= lr
            mom -= g
            weight += mom


# its fused GPU kernel (kvstore.optimizer.fused; the scalars: fused_plan)
# MXNet's NAGMomKernel (NAG): its momentum holds the rate; in place, the momentum's
# wd term reads the new weight (SGD._nesterov). mp1 = momentum + 1 in T.
fused.define('nag_mom', ("momentum", "mp1"), ("mom",), fused.LOAD + fused.CLIP + """
        acc_t m = (acc_t)mom * momentum;
        acc_t d = g;
        if (wd != 0) d = d + wd * w;
        acc_t wn = (w - m) + (m - d * lr) * mp1;
        weight = (T)wn;
        wn = (acc_t)weight;
        if (wd != 0) g = g + wd * wn;
        mom = (T)(m - g * lr);""")


@register
class NAG(SGD):
    """Nesterov accelerated gradient, MXNet 1.9's ``NAG``.

    State ``(mom,)`` when ``momentum > 0``: MXNet's ``nag_mom_update``, whose
    momentum includes the learning rate (``mom = momentum * mom - lr * g``)::

        g = clip(g, c)
        m = momentum * mom
        w = w - m + (momentum + 1) * (m - lr * (g + wd * w))
        mom = m - lr * (g + wd * w)           # w: the weight just updated, as in MXNet

    So a changed learning rate (a schedule, ``kv.set_learning_rate``) applies to new
    gradients only, as in MXNet. With ``momentum == 0`` it is plain SGD. Its config
    has no ``nesterov`` entry (:class:`SGD`'s ``nesterov=True`` is torch's update),
    nor ``lazy_update`` (MXNet's NAG has none: a row-sparse gradient on a dense key
    updates every row, as its dense kernel does; on a row-sparse key only its rows).
    Raises ConfigError unless ``0 <= momentum <= 1``.

    Example: ``NAG(learning_rate=0.1, momentum=0.9)``
    """

    name = "nag"
    hyper_params = ("momentum",)

    def __init__(self, *, momentum=0.0, **common):
        if "lazy_update" in common:
            raise ConfigError("NAG: it has no lazy_update (nor has MXNet's NAG); use SGD for a lazy update")
        super().__init__(momentum=momentum, nesterov=True, **common)

    def lazy_for(self, row_sparse_key: bool) -> bool:
        return Optimizer.lazy_for(self, row_sparse_key)

    def fused_plan(self, state, t, lr, dtype) -> tuple[str, dict]:
        """This update's fused GPU kernel (kvstore.optimizer.fused): ``(kernel name,
        {scalar: value})``, the scalars computed as :meth:`_step` computes them."""
        if not state:
            return "sgd", {}
        return "nag_mom", {"momentum": self.momentum, "mp1": float(dtype_scalar(dtype)(self.momentum) + 1)}

    def _step(self, weight, grad, state, t, lr, xp):
        if not state:
            super()._step(weight, grad, state, t, lr, xp)
            return
        # MXNet's NAGMomKernel in its operation order. MXNet updates the weight in
        # place, so the momentum's wd term reads the *new* weight.
        (mom,) = state
        g = self._rescaled_grad(weight, grad, xp, wd_before_clip=False)
        mom *= self.momentum                                   # m = momentum * mom
        d = g + self.wd * weight if self.wd else g.copy()
        d *= lr                                                # lr * (g + wd * w)
        xp.subtract(mom, d, out=d)
        d *= weight.dtype.type(self.momentum) + 1              # (momentum + 1) in the weight's dtype
        weight -= mom
        weight += d                                            # w - m + (momentum + 1) * (m - lr * (g + wd * w))
        if self.wd:
            g += self.wd * weight
        g *= lr
        mom -= g                                               # mom = m - lr * (g + wd * w_new)

    def state_from(self, version: int, t: int, arrays: list) -> list:
        """State version 1 kept NAG's momentum without the rate (``momentum * mom +
        g``, torch's): it becomes MXNet's by ``-lr * mom``, with ``lr`` the rate of
        update ``t``, which is exact when the rate was constant and ``wd`` 0."""
        arrays = super().state_from(version, t, arrays)
        if version > 1 or not self.num_states or not arrays:
            return arrays
        *master, mom = arrays          # multi_precision: the float32 master copy first
        lr = self.learning_rate_at(t) if t >= 1 else 0.0
        return [*master, (mom * -lr).astype(mom.dtype)]


# its fused GPU kernel (kvstore.optimizer.fused; the scalars: fused_plan)
fused.define('adam', ("beta1", "omb1", "beta2", "omb2", "eps", "lr_t"), ("mean", "var"), fused.LOAD + fused.WD + fused.CLIP + """
        acc_t m = (acc_t)mean * beta1 + omb1 * g;
        acc_t v = (acc_t)var * beta2 + (g * g) * omb2;
        mean = (T)m;
        var = (T)v;
        weight = (T)(w - m / (sqrt(v) + eps) * lr_t);""")


@register
class Adam(Optimizer):
    """Adam (MXNet ``adam_update``; state ``(mean, var)``)::

        g = clip(g + wd * w, c)
        mean = beta1 * mean + (1 - beta1) * g
        var = beta2 * var + (1 - beta2) * g**2
        lr_t = lr * sqrt(1 - beta2**t) / (1 - beta1**t)
        w -= lr_t * mean / (sqrt(var) + epsilon)

    ``lazy_update`` (MXNet's, default True): a row-sparse gradient updates only its
    rows and their ``mean`` and ``var``, with ``t`` the key's update count (MXNet's lazy
    Adam); False updates every row. Raises ConfigError unless ``0 <= beta1, beta2 <
    1`` and ``epsilon >= 0``.

    Example: ``Adam(learning_rate=1e-3, beta1=0.9, beta2=0.999)``
    """

    name = "adam"
    hyper_params = ("beta1", "beta2", "epsilon", "lazy_update")
    num_states = 2

    def __init__(self, *, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8, lazy_update=True,
                 **common):
        super().__init__(learning_rate=learning_rate, **common)
        owner = type(self).__name__
        self.beta1 = unit(owner, "beta1", beta1)
        self.beta2 = unit(owner, "beta2", beta2)
        self.epsilon = real(owner, "epsilon", epsilon, lo=0.0)
        self.lazy_update = boolean(owner, "lazy_update", lazy_update)

    def lazy_for(self, row_sparse_key: bool) -> bool:
        return self.lazy_update

    def fused_plan(self, state, t, lr, dtype) -> tuple[str, dict]:
        """This update's fused GPU kernel (kvstore.optimizer.fused): ``(kernel name,
        {scalar: value})``, the scalars computed as :meth:`_step` computes them."""
        # Bias corrections folded into the lr in float64 on the host, in Adam._step's
        # operation order, so that lr_t rounds to the same float32.
        lr_t = lr * math.sqrt(1.0 - self.beta2 ** t) / (1.0 - self.beta1 ** t)
        return "adam", {"beta1": self.beta1, "omb1": 1.0 - self.beta1, "beta2": self.beta2,
                        "omb2": 1.0 - self.beta2, "eps": self.epsilon, "lr_t": lr_t}

    def _step(self, weight, grad, state, t, lr, xp):
        g = self._rescaled_grad(weight, grad, xp, wd_before_clip=True)
        mean, var = state
        mean *= self.beta1
        mean += (1.0 - self.beta1) * g
        g *= g  # g is a private copy, so it can hold g**2 from here on
        g *= 1.0 - self.beta2
        var *= self.beta2
        var += g
        # MXNet folds the bias corrections into the lr (in float64 on the host).
        lr_t = lr * math.sqrt(1.0 - self.beta2 ** t) / (1.0 - self.beta1 ** t)
        denom = xp.sqrt(var)
        denom += self.epsilon
        xp.divide(mean, denom, out=denom)
        denom *= lr_t
        weight -= denom


# its fused GPU kernel (kvstore.optimizer.fused; the scalars: fused_plan)
fused.define('adagrad', ("eps",), ("hist",), fused.LOAD + fused.CLIP + """
        acc_t h = (acc_t)hist + g * g;
        hist = (T)h;
        g = g / sqrt(h + eps);
        """ + fused.WD + "weight = (T)(w - g * lr);")


@register
class AdaGrad(Optimizer):
    """AdaGrad (MXNet 1.x ``AdaGrad.update``, dense path; state ``(history,)``)::

        g = clip(g, c)
        history += g**2
        w -= lr * (g / sqrt(history + epsilon) + wd * w)

    Note ``epsilon`` sits *inside* the square root, as in MXNet 1.x, whose parameter
    is called ``eps``: accepted as an alias (the config says ``epsilon``). Raises
    ConfigError unless ``epsilon >= 0``, and when both names are given; MXNet clips in
    Python here, so ``clip_gradient`` must be None or > 0.

    Example: ``AdaGrad(learning_rate=0.1, eps=1e-7)``
    """

    name = "adagrad"
    hyper_params = ("epsilon",)
    aliases = {"eps": "epsilon"}
    kernel_clip = False
    num_states = 1

    def __init__(self, *, epsilon=None, eps=None, **common):
        super().__init__(**common)
        owner = type(self).__name__
        if epsilon is not None and eps is not None:
            raise ConfigError(f"{owner}: give epsilon or its MXNet name eps, not both")
        value = eps if eps is not None else epsilon
        self.epsilon = real(owner, "epsilon", 1e-7 if value is None else value, lo=0.0)

    def fused_plan(self, state, t, lr, dtype) -> tuple[str, dict]:
        """This update's fused GPU kernel (kvstore.optimizer.fused): ``(kernel name,
        {scalar: value})``, the scalars computed as :meth:`_step` computes them."""
        return "adagrad", {"eps": self.epsilon}

    def _step(self, weight, grad, state, t, lr, xp):
        g = self._rescaled_grad(weight, grad, xp, wd_before_clip=False)
        (history,) = state
        history += g * g
        denom = history + self.epsilon
        xp.sqrt(denom, out=denom)
        g /= denom
        if self.wd:
            g += self.wd * weight
        g *= lr
        weight -= g


# its fused GPU kernels (kvstore.optimizer.fused; the scalars: fused_plan)
fused.define('rmsprop', ("gm1", "omg1", "eps", "clip_w"), ("msq",), fused.LOAD + fused.WD + fused.CLIP + """
        acc_t s = (acc_t)msq * gm1 + omg1 * (g * g);
        msq = (T)s;
        g = g / sqrt(s + eps);
        weight = (T)kv_clip(w - g * lr, clip_w);""")
fused.define('rmspropalex', ("gm1", "omg1", "gm2", "eps", "clip_w"), ("msq", "gbar", "delta"), fused.LOAD + fused.WD + fused.CLIP + """
        acc_t s = (acc_t)msq * gm1 + omg1 * (g * g);
        acc_t gb = (acc_t)gbar * gm1 + omg1 * g;
        msq = (T)s;
        gbar = (T)gb;
        g = g / sqrt((s - gb * gb) + eps);
        acc_t d = (acc_t)delta * gm2 - g * lr;
        delta = (T)d;
        weight = (T)kv_clip(w + d, clip_w);""")


@register
class RMSProp(Optimizer):
    """RMSProp, both MXNet 1.x variants.

    ``centered=False`` (Tieleman & Hinton; MXNet ``rmsprop_update``; state ``(n,)``)::

        g = clip(g + wd * w, c)
        n = (1 - gamma1) * g**2 + gamma1 * n
        w = w - lr * g / sqrt(n + epsilon)

    ``centered=True`` (Graves 2013; MXNet ``rmspropalex_update``; state
    ``(n, gbar, delta)``)::

        g = clip(g + wd * w, c)
        n = (1 - gamma1) * g**2 + gamma1 * n
        gbar = (1 - gamma1) * g + gamma1 * gbar
        delta = gamma2 * delta - lr * g / sqrt(n - gbar**2 + epsilon)
        w = w + delta

    Then, if ``clip_weights`` is set, ``w = clip(w, clip_weights)``. ``gamma2`` is
    only used when centered. Raises ConfigError unless ``0 <= gamma1, gamma2 < 1``,
    ``epsilon >= 0`` and ``clip_weights`` is None or > 0.

    Example: ``RMSProp(learning_rate=1e-3, gamma1=0.9, centered=True)``
    """

    name = "rmsprop"
    hyper_params = ("gamma1", "gamma2", "epsilon", "centered", "clip_weights")

    def __init__(self, *, learning_rate=0.001, gamma1=0.9, gamma2=0.9, epsilon=1e-8,
                 centered=False, clip_weights=None, **common):
        super().__init__(learning_rate=learning_rate, **common)
        owner = type(self).__name__
        self.gamma1 = unit(owner, "gamma1", gamma1)
        self.gamma2 = unit(owner, "gamma2", gamma2)
        self.epsilon = real(owner, "epsilon", epsilon, lo=0.0)
        self.centered = boolean(owner, "centered", centered)
        self.clip_weights = real(owner, "clip_weights", clip_weights, lo=0.0, lo_open=True,
                                 allow_none=True)

    @property
    def num_states(self):
        return 3 if self.centered else 1

    def fused_plan(self, state, t, lr, dtype) -> tuple[str, dict]:
        """This update's fused GPU kernel (kvstore.optimizer.fused): ``(kernel name,
        {scalar: value})``, the scalars computed as :meth:`_step` computes them."""
        clip_w = math.inf if self.clip_weights is None else self.clip_weights
        common = {"gm1": self.gamma1, "omg1": 1.0 - self.gamma1, "eps": self.epsilon, "clip_w": clip_w}
        if self.centered:
            return "rmspropalex", dict(common, gm2=self.gamma2)
        return "rmsprop", common

    def _step(self, weight, grad, state, t, lr, xp):
        g = self._rescaled_grad(weight, grad, xp, wd_before_clip=True)
        n = state[0]
        n *= self.gamma1
        n += (1.0 - self.gamma1) * (g * g)
        if not self.centered:
            denom = n + self.epsilon
            xp.sqrt(denom, out=denom)
            g /= denom
            g *= lr
            weight -= g
        else:
            _, gbar, delta = state
            gbar *= self.gamma1
            gbar += (1.0 - self.gamma1) * g
            denom = gbar * gbar
            xp.subtract(n, denom, out=denom)
            denom += self.epsilon
            xp.sqrt(denom, out=denom)
            g /= denom
            g *= lr
            delta *= self.gamma2
            delta -= g
            weight += delta
        if self.clip_weights is not None:
            xp.clip(weight, -self.clip_weights, self.clip_weights, out=weight)


@register
class Test(Optimizer):
    """MXNet's ``Test`` optimizer (``'test'``), which MXNet's own KVStore tests use;
    state ``(copy,)``::

        w += rescale_grad * grad;  copy = w

    No learning rate, weight decay or clipping: an update adds the rescaled
    gradient, so a test can predict the stored value from the pushes alone.

    Example: ``kv.set_optimizer(kvstore.optimizer.create("test", rescale_grad=2.0))``
    """

    name = "test"
    num_states = 1
    __test__ = False   # a class named Test that pytest must not collect where it is imported

    def _step(self, weight, grad, state, t, lr, xp):
        g = grad.astype(weight.dtype, copy=True)   # the caller's grad stays intact
        g *= self.rescale_grad
        weight += g
        xp.copyto(state[0], weight)
