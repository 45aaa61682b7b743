"""Learning-rate schedulers: pure functions of the update count.

MXNet's schedulers keep mutable counters and return the lr for a *sequence* of
calls. Here every scheduler is a pure function of ``t`` (the 1-based number of
updates a weight has received; 0 before the first), so a server restarted from a
checkpoint computes the same learning rate as one that never stopped. For ``t = 0,
1, 2, ...`` the values equal those of MXNet 1.9's stateful schedulers at that
``num_update``, warm-up included.

MXNet's rules for the base rate are kept. ``base_lr`` (default 0.01 when not
given) is what the scheduler's warm-up ends at, and what CosineScheduler and
PolyScheduler decay from. An optimizer with a ``learning_rate`` writes it into
``base_lr`` of its own copy of the scheduler (see ``Optimizer``), as MXNet's
``Optimizer`` does: FactorScheduler and MultiFactorScheduler then decay from the
optimizer's rate, while the warm-up still ends at the scheduler's own (MXNet's
``warmup_final_lr``) and CosineScheduler and PolyScheduler still decay from it
(MXNet's ``base_lr_orig``).

A scheduler travels over the wire as ``{"name": ..., "params": {...}}`` (see
:meth:`LRScheduler.to_config` and :func:`scheduler_from_config`); ``base_lr`` there
is the constructor's.

Example::

    >>> s = FactorScheduler(step=2, factor=0.5, base_lr=1.0)
    >>> [s(t) for t in range(1, 6)]
    [1.0, 1.0, 0.5, 0.5, 0.25]
"""

from __future__ import annotations

import bisect
import math
import numbers
from typing import Any, ClassVar

from ..errors import ConfigError
from ..registry import Registry, own_name
from ._util import check_config_shape, check_params, integer, real

__all__ = ["LRScheduler", "FactorScheduler", "MultiFactorScheduler", "CosineScheduler", "PolyScheduler",
           "register_scheduler", "scheduler_from_config", "registered_schedulers", "DEFAULT_BASE_LR"]

DEFAULT_BASE_LR = 0.01
"""MXNet's base rate when neither a scheduler nor an optimizer gives one."""

WARMUP_MODES = ("linear", "constant")
_UNSET: Any = object()

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

    ``base_lr`` (attribute) is MXNet's mutable base rate: the constructor's, which an
    optimizer overwrites with its ``learning_rate`` (on its own copy); the call's
    ``base_lr`` argument, when given, is used instead. :attr:`warmup_final_lr` stays
    the constructor's. Subclasses set ``name``, ``_params`` (constructor argument
    names, in config order, stored as attributes of the same name, ``base_lr`` as
    given), call :meth:`_init_base` and implement ``_lr(t, base)``, which is called
    after the warm-up only.
    """

    name: ClassVar[str] = ""
    _params: ClassVar[tuple[str, ...]] = ()

    base_lr: float | None = None
    # the constructor's base_lr (None: not given); _UNSET in a scheduler of your own that
    # sets base_lr itself instead of calling _init_base: then base_lr is the constructor's
    _given_base_lr: Any = _UNSET
    warmup_steps: int = 0
    warmup_begin_lr: float = 0.0
    warmup_mode: str = "linear"

    def _init_base(self, base_lr, warmup_steps=0, warmup_begin_lr=0.0, warmup_mode="linear") -> None:
        """MXNet's ``LRScheduler.__init__``: the base rate and the warm-up, validated
        (ConfigError unless ``base_lr`` is None or >= 0, ``warmup_steps`` an int >= 0,
        ``0 <= warmup_begin_lr <= base_lr`` and ``warmup_mode`` 'linear' or 'constant')."""
        owner = type(self).__name__
        self._given_base_lr = real(owner, "base_lr", base_lr, lo=0.0, allow_none=True)
        self.base_lr = self._given_base_lr
        self.warmup_steps = integer(owner, "warmup_steps", warmup_steps, lo=0)
        self.warmup_begin_lr = real(owner, "warmup_begin_lr", warmup_begin_lr, lo=0.0)
        if self.warmup_begin_lr > self.warmup_final_lr:
            raise ConfigError(f"{owner}: warmup_begin_lr ({self.warmup_begin_lr}) must not exceed base_lr "
                              f"({self.warmup_final_lr}), where the warm-up ends")
        if warmup_mode not in WARMUP_MODES:
            raise ConfigError(f"{owner}: warmup_mode must be one of {', '.join(map(repr, WARMUP_MODES))}, "
                              f"got {warmup_mode!r}")
        self.warmup_mode = warmup_mode

    @property
    def warmup_final_lr(self) -> float:
        """Where the warm-up ends: the constructor's ``base_lr`` (MXNet's default 0.01
        when None), whatever an optimizer writes into :attr:`base_lr` later."""
        given = self._constructor_base_lr()
        return DEFAULT_BASE_LR if given is None else given

    def _constructor_base_lr(self) -> float | None:
        return self.base_lr if self._given_base_lr is _UNSET else self._given_base_lr

    @classmethod
    def param_names(cls):
        """Names of the constructor parameters that :meth:`to_config` records."""
        return cls._params

    def __call__(self, t, base_lr=None):
        """Return the learning rate for the ``t``-th update (``t >= 1``): the warm-up's
        while ``t < warmup_steps``, then the schedule's from ``base_lr`` (the argument,
        else the attribute, else 0.01). ``t = 0``, before the first update, gives what
        MXNet's schedulers give at ``num_update`` 0 (the warm-up's first rate, else the
        base). Raises TypeError for a non-int ``t`` and ValueError for a negative one."""
        owner = type(self).__name__
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"{owner}: the update count t must be an int, got {type(t).__name__}")
        if t < 0:
            raise ValueError(f"{owner}: the update count t must be >= 0 (0: before the first update), got {t}")
        t = int(t)
        if t < self.warmup_steps:
            return float(self._warmup(t))
        if base_lr is None:
            base_lr = self.base_lr if self.base_lr is not None else DEFAULT_BASE_LR
        return float(self._lr(t, float(base_lr)))

    def _warmup(self, t: int) -> float:
        """MXNet's ``get_warmup_lr(t)``, in its operation order."""
        if self.warmup_mode == "constant":
            return self.warmup_begin_lr
        increase = (self.warmup_final_lr - self.warmup_begin_lr) * float(t) / float(self.warmup_steps)
        return self.warmup_begin_lr + increase

    def _lr(self, t, base):
        raise NotImplementedError

    def check_base_lr(self, base_lr):
        """Raise ConfigError if this scheduler cannot run from ``base_lr``."""
        real(type(self).__name__, "base_lr", base_lr, lo=0.0)

    def to_config(self):
        """Return ``{"name": ..., "params": {...}}`` made of plain, msgpack-able values
        (``base_lr``: the constructor's, not one an optimizer wrote)."""
        params = {}
        for p in self._params:
            value = self._constructor_base_lr() if p == "base_lr" else getattr(self, p)
            params[p] = list(value) if isinstance(value, (list, tuple)) else value
        return {"name": self.name, "params": params}

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.to_config()["params"].items())
        return f"{type(self).__name__}({args})"


def _factor(owner, value):
    # factor > 1 would grow the lr; MXNet rejects it too. 0 would zero it forever.
    return real(owner, "factor", value, lo=0.0, lo_open=True, hi=1.0)


_SCHEDULERS = Registry("lr scheduler", LRScheduler, "register_scheduler", own_name)


_WARMUP_PARAMS = ("warmup_steps", "warmup_begin_lr", "warmup_mode")
_WARMUP_DOC = """``warmup_steps``, ``warmup_begin_lr``, ``warmup_mode`` (MXNet's): while ``t <
    warmup_steps`` the rate is ``warmup_begin_lr + (base_lr - warmup_begin_lr) * t /
    warmup_steps`` ('linear') or ``warmup_begin_lr`` ('constant'), ``base_lr`` being the
    constructor's (:attr:`LRScheduler.warmup_final_lr`)."""


@register_scheduler
class FactorScheduler(LRScheduler):
    """Multiply the lr by ``factor`` every ``step`` updates, floored at ``stop_factor_lr``.

    After the warm-up, ``lr(t) = base_lr`` for ``0 <= t <= step``, then ``base_lr``
    multiplied by ``factor`` ``(t - 1) // step`` times, floored at ``stop_factor_lr``
    after each: what MXNet's stateful FactorScheduler returns for ``t = 1, 2, 3, ...``,
    to the last bit (its count of reductions starts at 0, not at the warm-up's end).
    Warm-up: %s

    Raises ConfigError unless ``step >= 1``, ``0 < factor <= 1``,
    ``stop_factor_lr >= 0`` and the base and warm-up are valid (see LRScheduler).
    """ % _WARMUP_DOC

    name = "factor"
    _params = ("step", "factor", "stop_factor_lr", "base_lr") + _WARMUP_PARAMS

    def __init__(self, step, factor=1.0, stop_factor_lr=1e-8, base_lr=None, warmup_steps=0,
                 warmup_begin_lr=0.0, warmup_mode="linear"):
        owner = type(self).__name__
        self.step = integer(owner, "step", step, lo=1)
        self.factor = _factor(owner, factor)
        self.stop_factor_lr = real(owner, "stop_factor_lr", stop_factor_lr, lo=0.0)
        self._init_base(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        self._reduced: dict[float, list[float]] = {}   # base -> its rate after 0, 1, 2, ... reductions

    def _lr(self, t, base):
        # MXNet only applies the floor when it multiplies, so an initial lr below
        # stop_factor_lr is returned unchanged until the first reduction.
        return _reductions(self._reduced, base, max(t - 1, 0) // self.step, self.factor, self.stop_factor_lr)


@register_scheduler
class MultiFactorScheduler(LRScheduler):
    """Multiply the lr by ``factor`` once for every ``s`` in ``step`` with ``t > s``.
    Warm-up: %s

    Raises ConfigError unless ``step`` is a non-empty, strictly increasing list of
    integers ``>= 1``, ``0 < factor <= 1`` and the base and warm-up are valid.
    """ % _WARMUP_DOC

    name = "multifactor"
    _params = ("step", "factor", "base_lr") + _WARMUP_PARAMS

    def __init__(self, step, factor=1.0, base_lr=None, warmup_steps=0, warmup_begin_lr=0.0,
                 warmup_mode="linear"):
        owner = type(self).__name__
        if not isinstance(step, (list, tuple)) or not step:
            raise ConfigError(f"{owner}: step must be a non-empty list of increasing ints, "
                              f"got {step!r}")
        steps = [integer(owner, "step[]", s, lo=1) for s in step]
        if any(b <= a for a, b in zip(steps, steps[1:])):
            raise ConfigError(f"{owner}: step must be strictly increasing, got {steps}")
        self.step = steps
        self.factor = _factor(owner, factor)
        self._init_base(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)

    def _lr(self, t, base):
        # bisect_left counts the steps s < t, i.e. the reductions already applied, which
        # MXNet applies one multiplication at a time
        for _ in range(bisect.bisect_left(self.step, t)):
            base *= self.factor
        return base


def _reductions(memo: dict, base: float, k: int, factor: float, floor: float) -> float:
    """``base`` after ``k`` of MXNet's reductions (``lr *= factor``, then ``lr = floor``
    if below it), one multiplication at a time as MXNet rounds them. ``memo[base]``
    keeps the rates computed so far; a rate that a reduction leaves unchanged stays."""
    rates = memo.get(base) or [base]
    if k < len(rates):
        return rates[k]
    if len(rates) > 1 and rates[-1] == rates[-2]:
        return rates[-1]
    grown = list(rates)         # a new list, then one store: another thread sees old or new
    while len(grown) <= max(k, 2 * len(rates)):
        lr = grown[-1] * factor
        grown.append(floor if lr < floor else lr)
        if grown[-1] == grown[-2]:
            break
    memo[base] = grown
    return grown[min(k, len(grown) - 1)]


def _decay_span(owner: str, max_update, warmup_steps: int) -> int:
    max_update = integer(owner, "max_update", max_update, lo=1)
    if warmup_steps >= max_update:
        # MXNet divides by max_update - warmup_steps; equal values would divide by 0.
        raise ConfigError(f"{owner}: warmup_steps ({warmup_steps}) must be less than max_update "
                          f"({max_update})")
    return max_update


@register_scheduler
class CosineScheduler(LRScheduler):
    """Cosine decay from ``base_lr`` to ``final_lr`` over ``max_update`` updates, after
    the warm-up (MXNet's formula)::

        t <= max_update:   final_lr + (base_lr - final_lr)
                           * (1 + cos(pi * (t - warmup_steps) / (max_update - warmup_steps))) / 2
        t >  max_update:   final_lr

    ``base_lr`` is the constructor's (MXNet's ``base_lr_orig``): an optimizer's
    ``learning_rate`` does not change the decay, as in MXNet. Warm-up: %s

    Raises ConfigError unless ``max_update >= 1``, ``0 <= warmup_steps < max_update``,
    ``final_lr >= 0`` and the base and warm-up are valid.
    """ % _WARMUP_DOC

    name = "cosine"
    _params = ("max_update", "base_lr", "final_lr") + _WARMUP_PARAMS

    def __init__(self, max_update, base_lr=None, final_lr=0.0, warmup_steps=0,
                 warmup_begin_lr=0.0, warmup_mode="linear"):
        owner = type(self).__name__
        self._init_base(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        self.max_update = _decay_span(owner, max_update, self.warmup_steps)
        self.final_lr = real(owner, "final_lr", final_lr, lo=0.0)

    def _lr(self, t, base):
        if t > self.max_update:
            return self.final_lr
        orig = self.warmup_final_lr
        span = self.max_update - self.warmup_steps
        return (self.final_lr + (orig - self.final_lr)
                * (1 + math.cos(math.pi * (t - self.warmup_steps) / span)) / 2)


@register_scheduler
class PolyScheduler(LRScheduler):
    """Polynomial decay from ``base_lr`` to ``final_lr`` over ``max_update`` updates,
    after the warm-up (MXNet's ``PolyScheduler``)::

        t <= max_update:   final_lr + (base_lr - final_lr)
                           * (1 - (t - warmup_steps) / (max_update - warmup_steps)) ** pwr
        t >  max_update:   final_lr

    ``base_lr`` is the constructor's (MXNet's ``base_lr_orig``), as in
    :class:`CosineScheduler`. Warm-up: %s

    Raises ConfigError unless ``max_update >= 1``, ``0 <= warmup_steps < max_update``,
    ``pwr`` is a finite number, ``final_lr >= 0`` and the base and warm-up are valid.
    """ % _WARMUP_DOC

    name = "poly"
    _params = ("max_update", "base_lr", "pwr", "final_lr") + _WARMUP_PARAMS

    def __init__(self, max_update, base_lr=None, pwr=2, final_lr=0.0, warmup_steps=0,
                 warmup_begin_lr=0.0, warmup_mode="linear"):
        owner = type(self).__name__
        self._init_base(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        self.max_update = _decay_span(owner, max_update, self.warmup_steps)
        real(owner, "pwr", pwr)
        self.pwr = int(pwr) if isinstance(pwr, numbers.Integral) else float(pwr)
        self.final_lr = real(owner, "final_lr", final_lr, lo=0.0)

    def _lr(self, t, base):
        if t > self.max_update:
            return self.final_lr
        orig = self.warmup_final_lr
        return self.final_lr + (orig - self.final_lr) * \
            pow(1 - float(t - self.warmup_steps) / float(self.max_update - self.warmup_steps), self.pwr)
