"""Private helpers shared by the optimizer package: array-module dispatch and
argument validation that raises :class:`~kvstore.errors.ConfigError`."""

from __future__ import annotations

import math
import numbers

import numpy

from ..errors import ConfigError


def _array_module(a):
    """Return the array module (``numpy`` or ``cupy``) that owns array ``a``.

    CuPy is imported only here, and only when ``a`` already is a CuPy array, so
    that importing this package never needs (or initialises) a GPU.
    """
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy  # noqa: PLC0415 - deliberately lazy, see docstring

        return cupy
    return numpy


def dtype_scalar(weight_dtype):
    """The scalar type of ``weight_dtype``: scalars computed in the weight's dtype (as
    Signum's and FTML's _step do, and their fused kernels' plans)."""
    return numpy.dtype(weight_dtype).type


def _to_module(a, xp):
    """Return ``a`` as an array of module ``xp`` (no copy when it already is one)."""
    if _array_module(a) is xp:
        return a
    if xp is numpy:
        # CuPy refuses implicit device-to-host conversion; ``get`` is the explicit way.
        return a.get()
    return xp.asarray(a)


def real(owner, name, value, *, lo=None, lo_open=False, hi=None, hi_open=False,
         allow_none=False):
    """Validate a real hyper-parameter and return it as a Python ``float``.

    ``lo``/``hi`` are bounds, inclusive unless ``lo_open``/``hi_open``. Booleans,
    strings, NaN and infinities are rejected.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        kind = "a number or None" if allow_none else "a number"
        raise ConfigError(f"{owner}: {name} must be {kind}, got {type(value).__name__} "
                          f"{value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ConfigError(f"{owner}: {name} must be finite, got {value!r}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        op = ">" if lo_open else ">="
        raise ConfigError(f"{owner}: {name} must be {op} {lo}, got {value!r}")
    if hi is not None and (value >= hi if hi_open else value > hi):
        op = "<" if hi_open else "<="
        raise ConfigError(f"{owner}: {name} must be {op} {hi}, got {value!r}")
    return value


def unit(owner: str, name: str, value) -> float:
    """Validate a decay factor: a real in ``[0, 1)`` (1 would never forget, and where
    an update divides by ``1 - factor ** t``, MXNet's divides by zero)."""
    return real(owner, name, value, lo=0.0, hi=1.0, hi_open=True)


def momentum_factor(owner: str, value, name: str = "momentum") -> float:
    """Validate a momentum: a real in ``[0, 1]`` (MXNet accepts 1: nothing is forgotten)."""
    return real(owner, name, value, lo=0.0, hi=1.0)


def nonzero_lr(owner: str, lr: float, t: int) -> None:
    """Raise ValueError, before anything changes, when update ``t``'s learning rate
    ``lr`` is 0 in an optimizer that divides by it (a schedule may reach 0)."""
    if lr <= 0.0:
        raise ValueError(f"{owner} divides by the learning rate, which is {lr!r} at update {t} "
                         "(check the lr_scheduler's final value)")


def integer(owner, name, value, *, lo=None):
    """Validate an integer hyper-parameter (``>= lo``) and return it as ``int``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{owner}: {name} must be an integer, got {type(value).__name__} "
                          f"{value!r}")
    value = int(value)
    if lo is not None and value < lo:
        raise ConfigError(f"{owner}: {name} must be >= {lo}, got {value!r}")
    return value


def boolean(owner, name, value):
    """Validate a boolean hyper-parameter (``numpy.bool_`` accepted)."""
    if not isinstance(value, (bool, numpy.bool_)):
        raise ConfigError(f"{owner}: {name} must be True or False, got "
                          f"{type(value).__name__} {value!r}")
    return bool(value)


def check_params(owner, given, allowed):
    """Raise ConfigError if mapping ``given`` has a key not in ``allowed``."""
    unknown = sorted(str(k) for k in given if k not in allowed)
    if unknown:
        raise ConfigError(f"{owner}: unknown parameter(s) {', '.join(map(repr, unknown))}; "
                          f"valid parameters are {', '.join(allowed)}")


def check_config_shape(what, cfg, required, optional=()):
    """Check that ``cfg`` is a dict with string ``name`` and no unexpected keys."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{what} config must be a dict, got {type(cfg).__name__}")
    allowed = tuple(required) + tuple(optional)
    extra = sorted(str(k) for k in cfg if k not in allowed)
    if extra:
        raise ConfigError(f"{what} config has unknown key(s) {', '.join(map(repr, extra))}; "
                          f"allowed keys are {', '.join(allowed)}")
    missing = [k for k in required if k not in cfg]
    if missing:
        raise ConfigError(f"{what} config lacks key(s) {', '.join(map(repr, missing))}")
    if not isinstance(cfg["name"], str):
        raise ConfigError(f"{what} config 'name' must be a str, got {type(cfg['name']).__name__}")
    params = cfg.get("params", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ConfigError(f"{what} config 'params' must be a dict, got {type(params).__name__}")
    bad_keys = [k for k in params if not isinstance(k, str)]
    if bad_keys:
        raise ConfigError(f"{what} config 'params' keys must be str, got {bad_keys[0]!r}")
    return params


def update_count(owner, t):
    """Validate a 1-based update count ``t`` and return it as ``int``.

    Raises TypeError for a non-integer and ValueError for ``t < 1``: these are
    call-time argument errors, not configuration errors.
    """
    if isinstance(t, bool) or not isinstance(t, numbers.Integral):
        raise TypeError(f"{owner}: the update count t must be an int, got {type(t).__name__}")
    if t < 1:
        raise ValueError(f"{owner}: the update count t is 1-based, got {t}")
    return int(t)
