"""MXNet's per-parameter multipliers: ``lr_mult``, ``wd_mult``, ``param_idx2name`` and
``param_dict`` (MXNet 1.9.1's ``Optimizer._get_lrs`` / ``_get_wds``, ``set_lr_mult``,
``set_wd_mult``).

A parameter is a key of the store. An update of key ``k`` uses the rate
``lr * m_lr`` and the weight decay ``wd * m_wd``, each multiplier looked up in
MXNet's order: ``param_dict[k]`` (its ``lr_mult`` / ``wd_mult``), else the table's
entry for ``k``, else the table's entry for ``param_idx2name[k]``, else 1. With
``param_idx2name``, MXNet's default ``wd_mult`` is 0 for every name in it that does not
end in ``_weight`` or ``_gamma`` (LARS: ``_weight``): no weight decay on biases
and batch-norm betas of MXNet's symbol names.

The multipliers travel with the optimizer's config (the servers update with them),
so they are plain dicts keyed by the store's keys (int or str) or names.

Example::

    m = Multipliers("SGD", wd_mult={"fc.bias": 0.0}, param_idx2name={0: "fc_bias"})
    m.scales("fc.bias")      # (1.0, 0.0): no weight decay for key "fc.bias"
    m.scales(0)              # (1.0, 0.0): key 0 is named fc_bias, which MXNet's rule exempts
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping

from ..errors import ConfigError
from ._util import real

__all__ = ["Multipliers", "index_key"]

# what MXNet's set_wd_mult keeps weight decay for, when param_idx2name names parameters
WD_KEPT = ("_weight", "_gamma")


def index_key(index):
    """The store key of an updater weight: the weight itself (the local stores), or the
    key of a server's ``(key, chunk)`` index."""
    return index[0] if isinstance(index, tuple) else index


def _key(owner: str, what: str, key):
    if isinstance(key, bool) or not isinstance(key, (numbers.Integral, str)):
        raise ConfigError(f"{owner}: {what} keys must be the store's keys (int or str) or names, got "
                          f"{type(key).__name__} {key!r}")
    return int(key) if isinstance(key, numbers.Integral) else key


def _table(owner: str, what: str, table, lo: float | None = None) -> dict:
    """``{key: multiplier}`` checked: int or str keys, finite real values (``>= lo``)."""
    if table is None:
        return {}
    if not isinstance(table, Mapping):
        raise ConfigError(f"{owner}: {what} must be a dict of parameter (key, index or name) to "
                          f"multiplier, got {type(table).__name__}")
    return {_key(owner, what, k): real(owner, f"{what}[{k!r}]", v, lo=lo) for k, v in table.items()}


def _names(owner: str, names) -> dict:
    if names is None:
        return {}
    if not isinstance(names, Mapping):
        raise ConfigError(f"{owner}: param_idx2name must be a dict of index (the store's key) to "
                          f"name, got {type(names).__name__}")
    out = {}
    for k, v in names.items():
        if not isinstance(v, str):
            raise ConfigError(f"{owner}: param_idx2name[{k!r}] must be a name (str), got {type(v).__name__}")
        out[_key(owner, "param_idx2name", k)] = v
    return out


def _param_dict(owner: str, params) -> dict:
    """MXNet's ``param_dict`` (index -> gluon Parameter): each entry an object with
    ``lr_mult`` and ``wd_mult`` attributes, or a dict of them; read once, here."""
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"{owner}: param_dict must be a dict of index (the store's key) to a "
                          f"parameter with lr_mult and wd_mult, got {type(params).__name__}")
    out = {}
    for k, p in params.items():
        key = _key(owner, "param_dict", k)
        get = p.get if isinstance(p, Mapping) else (lambda name, p=p: getattr(p, name, None))
        lr, wd = get("lr_mult"), get("wd_mult")
        if lr is None or wd is None or (isinstance(p, Mapping) and set(p) != {"lr_mult", "wd_mult"}):
            raise ConfigError(f"{owner}: param_dict[{k!r}] must have lr_mult and wd_mult (a gluon "
                              f"Parameter, or a dict of just those two), got {p!r}")
        out[key] = {"lr_mult": real(owner, f"param_dict[{k!r}].lr_mult", lr, lo=0.0),
                    "wd_mult": real(owner, f"param_dict[{k!r}].wd_mult", wd)}
    return out


class Multipliers:
    """The per-parameter multipliers of one optimizer (``owner`` names it in errors):
    tables as MXNet's ``set_lr_mult`` / ``set_wd_mult`` leave them. ``wd_kept``: the
    name endings whose default ``wd_mult`` stays 1 when ``param_idx2name`` is given.
    Raises ConfigError for a malformed table or a negative ``lr_mult`` (a learning
    rate is never negative here)."""

    def __init__(self, owner: str, lr_mult=None, wd_mult=None, param_idx2name=None, param_dict=None,
                 wd_kept: tuple = WD_KEPT):
        self.owner = owner
        self.wd_kept = wd_kept
        self.idx2name = _names(owner, param_idx2name)
        self.param_dict = _param_dict(owner, param_dict)
        self.lr_mult = _table(owner, "lr_mult", lr_mult, lo=0.0)
        self.wd_mult = {**self._wd_defaults(), **_table(owner, "wd_mult", wd_mult)}

    def _wd_defaults(self) -> dict:
        """MXNet's set_wd_mult: 0 for each name of param_idx2name not ending as kept."""
        return {n: 0.0 for n in self.idx2name.values() if not n.endswith(self.wd_kept)}

    def with_lr_mult(self, table) -> "Multipliers":
        """MXNet's ``set_lr_mult(table)``: ``table`` replaces every lr multiplier."""
        return Multipliers(self.owner, table, self.wd_mult, self.idx2name, self.param_dict, self.wd_kept)

    def with_wd_mult(self, table) -> "Multipliers":
        """MXNet's ``set_wd_mult(table)``: the defaults of ``param_idx2name``, updated by ``table``."""
        m = Multipliers(self.owner, self.lr_mult, None, self.idx2name, self.param_dict, self.wd_kept)
        m.wd_mult.update(_table(self.owner, "wd_mult", table))
        return m

    def scales(self, key) -> tuple[float, float]:
        """``(lr multiplier, wd multiplier)`` of the parameter ``key``, in MXNet's order."""
        return self._scale("lr_mult", self.lr_mult, key), self._scale("wd_mult", self.wd_mult, key)

    def _scale(self, which: str, table: dict, key) -> float:
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            return 1.0                # no parameter (a bare update): no multiplier
        if key in self.param_dict:
            return self.param_dict[key][which]
        if key in table:
            return table[key]
        if key in self.idx2name:
            return table.get(self.idx2name[key], 1.0)
        return 1.0

    def name_of(self, key) -> str:
        """The parameter's name: ``param_idx2name``'s, else ``str(key)`` (as MXNet's LARS)."""
        return self.idx2name.get(key, str(key)) if not isinstance(key, bool) and isinstance(key, (int, str)) \
            else str(key)

    def config(self) -> dict:
        """The config entries (copies): ``lr_mult``, ``wd_mult``, ``param_idx2name``, ``param_dict``."""
        return {"lr_mult": dict(self.lr_mult), "wd_mult": dict(self.wd_mult),
                "param_idx2name": dict(self.idx2name),
                "param_dict": {k: dict(v) for k, v in self.param_dict.items()}}

    @property
    def any(self) -> bool:
        """Whether some parameter's multiplier may differ from 1."""
        return bool(self.lr_mult or self.wd_mult or self.param_dict)
