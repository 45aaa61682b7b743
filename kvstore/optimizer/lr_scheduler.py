"""Learning-rate schedulers: pure functions of the update count.

MXNet's schedulers keep mutable counters and return the lr for a *sequence* of
calls. Here every scheduler is a pure function of ``t`` (the 1-based number of
updates a slot has received), so a server restarted from a checkpoint computes
the same learning rate as one that never stopped. For ``t = 1, 2, 3, ...`` the
values equal those of MXNet 1.x's stateful schedulers.

A scheduler travels over the wire as ``{"name": ..., "params": {...}}`` (see
:meth:`LRScheduler.to_config` and :func:`scheduler_from_config`).

Example::

    >>> s = FactorScheduler(step=2, factor=0.5, base_lr=1.0)
    >>> [s(t) for t in range(1, 6)]
    [1.0, 1.0, 0.5, 0.5, 0.25]
"""

from __future__ import annotations

import bisect
import math
from typing import ClassVar

from ..errors import ConfigError
from ..registry import Registry, own_name
from ._util import check_config_shape, check_params, integer, real, update_count

__all__ = ["LRScheduler", "FactorScheduler", "MultiFactorScheduler", "CosineScheduler",
           "register_scheduler", "scheduler_from_config", "registered_schedulers"]

def register_scheduler(cls):
    """Class decorator: register an :class:`LRScheduler` subclass under ``cls.name``.

    Raises ConfigError if ``cls`` is not an LRScheduler subclass, has no ``name``
    of its own, or the name is taken by a different class.
    """
    return _SCHEDULERS.add(cls)


def registered_schedulers():
    """Return the sorted list of registered scheduler names."""
    return _SCHEDULERS.names()


def scheduler_from_config(cfg):
    """Rebuild a scheduler from ``{"name": str, "params": dict}``.

    Raises ConfigError for a malformed config, an unknown name (the message lists
    the valid names), unknown parameters or invalid values.
    """
    params = check_config_shape("lr_scheduler", cfg, ("name",), ("params",))
    cls = _SCHEDULERS.lookup(cfg["name"])
    check_params(f"lr scheduler {cls.name!r}", params, cls.param_names())
    return cls(**params)


class LRScheduler:
    """Base class: ``scheduler(t, base_lr=None)`` returns the lr for update ``t``.

    ``base_lr`` given to the constructor wins; otherwise the ``base_lr`` argument of
    the call is used (an optimizer passes its ``learning_rate``, as MXNet does).
    Subclasses set ``name``, ``_params`` (constructor argument names, in config
    order, stored as attributes of the same name) and implement ``_lr``.
    """

    name: ClassVar[str] = ""
    _params: ClassVar[tuple[str, ...]] = ()

    base_lr: float | None = None

    @classmethod
    def param_names(cls):
        """Names of the constructor parameters that :meth:`to_config` records."""
        return cls._params

    def __call__(self, t, base_lr=None):
        """Return the learning rate for the ``t``-th update (``t >= 1``).

        Raises ConfigError if neither the scheduler nor the call provides a base lr.
        """
        t = update_count(type(self).__name__, t)
        base = self.base_lr if self.base_lr is not None else base_lr
        if base is None:
            raise ConfigError(f"{type(self).__name__} has no base_lr: give it one or attach "
                              "it to an optimizer, whose learning_rate is then used")
        return float(self._lr(t, float(base)))

    def _lr(self, t, base):
        raise NotImplementedError

    def check_base_lr(self, base_lr):
        """Raise ConfigError if this scheduler cannot run from ``base_lr``."""
        real(type(self).__name__, "base_lr", base_lr, lo=0.0)

    def to_config(self):
        """Return ``{"name": ..., "params": {...}}`` made of plain, msgpack-able values."""
        params = {}
        for p in self._params:
            value = getattr(self, p)
            params[p] = list(value) if isinstance(value, (list, tuple)) else value
        return {"name": self.name, "params": params}

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.to_config()["params"].items())
        return f"{type(self).__name__}({args})"


def _factor(owner, value):
    # factor > 1 would grow the lr; MXNet rejects it too. 0 would zero it forever.
    return real(owner, "factor", value, lo=0.0, lo_open=True, hi=1.0)


_SCHEDULERS = Registry("lr scheduler", LRScheduler, "register_scheduler", own_name)


@register_scheduler
class FactorScheduler(LRScheduler):
    """Multiply the lr by ``factor`` every ``step`` updates, floored at ``stop_factor_lr``.

    ``lr(t) = base_lr`` for ``t <= step``, then
    ``max(base_lr * factor ** ((t - 1) // step), stop_factor_lr)``: exactly what
    MXNet's stateful FactorScheduler returns for ``t = 1, 2, 3, ...``.

    Raises ConfigError unless ``step >= 1``, ``0 < factor <= 1``,
    ``stop_factor_lr >= 0`` and ``base_lr`` is None or ``>= 0``.
    """

    name = "factor"
    _params = ("step", "factor", "stop_factor_lr", "base_lr")

    def __init__(self, step, factor=1.0, stop_factor_lr=1e-8, base_lr=None):
        owner = type(self).__name__
        self.step = integer(owner, "step", step, lo=1)
        self.factor = _factor(owner, factor)
        self.stop_factor_lr = real(owner, "stop_factor_lr", stop_factor_lr, lo=0.0)
        self.base_lr = real(owner, "base_lr", base_lr, lo=0.0, allow_none=True)

    def _lr(self, t, base):
        k = (t - 1) // self.step
        if k == 0:
            # MXNet only applies the floor when it multiplies, so an initial lr below
            # stop_factor_lr is returned unchanged until the first reduction.
            return base
        return max(base * self.factor ** k, self.stop_factor_lr)


@register_scheduler
class MultiFactorScheduler(LRScheduler):
    """Multiply the lr by ``factor`` once for every ``s`` in ``step`` with ``t > s``.

    Raises ConfigError unless ``step`` is a non-empty, strictly increasing list of
    integers ``>= 1`` and ``0 < factor <= 1``.
    """

    name = "multifactor"
    _params = ("step", "factor", "base_lr")

    def __init__(self, step, factor=1.0, base_lr=None):
        owner = type(self).__name__
        if not isinstance(step, (list, tuple)) or not step:
            raise ConfigError(f"{owner}: step must be a non-empty list of increasing ints, "
                              f"got {step!r}")
        steps = [integer(owner, "step[]", s, lo=1) for s in step]
        if any(b <= a for a, b in zip(steps, steps[1:])):
            raise ConfigError(f"{owner}: step must be strictly increasing, got {steps}")
        self.step = steps
        self.factor = _factor(owner, factor)
        self.base_lr = real(owner, "base_lr", base_lr, lo=0.0, allow_none=True)

    def _lr(self, t, base):
        # bisect_left counts the steps s < t, i.e. the reductions already applied.
        return base * self.factor ** bisect.bisect_left(self.step, t)


@register_scheduler
class CosineScheduler(LRScheduler):
    """Cosine decay from ``base_lr`` to ``final_lr`` over ``max_update`` updates,
    after an optional linear warmup from ``warmup_begin_lr`` (MXNet's formula)::

        t <  warmup_steps: warmup_begin_lr + (base_lr - warmup_begin_lr) * t / warmup_steps
        t <= max_update:   final_lr + (base_lr - final_lr)
                           * (1 + cos(pi * (t - warmup_steps) / (max_update - warmup_steps))) / 2
        t >  max_update:   final_lr

    Raises ConfigError unless ``max_update >= 1``, ``0 <= warmup_steps < max_update``,
    the lrs are ``>= 0`` and ``warmup_begin_lr <= base_lr``.
    """

    name = "cosine"
    _params = ("max_update", "base_lr", "final_lr", "warmup_steps", "warmup_begin_lr")

    def __init__(self, max_update, base_lr=None, final_lr=0.0, warmup_steps=0,
                 warmup_begin_lr=0.0):
        owner = type(self).__name__
        self.max_update = integer(owner, "max_update", max_update, lo=1)
        self.base_lr = real(owner, "base_lr", base_lr, lo=0.0, allow_none=True)
        self.final_lr = real(owner, "final_lr", final_lr, lo=0.0)
        self.warmup_steps = integer(owner, "warmup_steps", warmup_steps, lo=0)
        if self.warmup_steps >= self.max_update:
            # MXNet divides by max_update - warmup_steps; equal values would divide by 0.
            raise ConfigError(f"{owner}: warmup_steps ({self.warmup_steps}) must be less "
                              f"than max_update ({self.max_update})")
        self.warmup_begin_lr = real(owner, "warmup_begin_lr", warmup_begin_lr, lo=0.0)
        if self.base_lr is not None:
            self.check_base_lr(self.base_lr)

    def check_base_lr(self, base_lr):
        super().check_base_lr(base_lr)
        if self.warmup_begin_lr > base_lr:
            raise ConfigError(f"{type(self).__name__}: warmup_begin_lr "
                              f"({self.warmup_begin_lr}) must not exceed base_lr ({base_lr})")

    def _lr(self, t, base):
        if t < self.warmup_steps:
            return (self.warmup_begin_lr
                    + (base - self.warmup_begin_lr) * float(t) / float(self.warmup_steps))
        if t <= self.max_update:
            span = self.max_update - self.warmup_steps
            return (self.final_lr + (base - self.final_lr)
                    * (1.0 + math.cos(math.pi * (t - self.warmup_steps) / span)) / 2.0)
        return self.final_lr
