"""The base of the servers' twins of ``torch.optim`` optimizers: torch's math, run
by torch on the servers' chunks.

A twin (``torch_sgd``, ``torch_adam``, ``torch_adamw``, ``torch_rmsprop``,
``torch_adagrad``, ``torch_adadelta``: one module each) updates a chunk by calling
torch's own single-tensor functional step (``torch.optim.sgd.sgd(...,
foreach=False)`` and its siblings, what ``torch.optim.SGD.step`` runs on CPU
tensors) on torch views of the chunk's arrays (``torch.from_numpy``, no copy), so
a server computes what a single-process ``torch.optim`` step computes, bit for
bit. Every twin's update is elementwise (the same formula for every element, with
scalars that depend on the step count and the hyper-parameters only), so a key cut
into chunks over several servers is updated exactly as the whole tensor; an
optimizer that is not elementwise (LBFGS, SparseAdam's lazy rows, ...) has no twin.

Hyper-parameters carry torch's names and defaults, per param group: ``groups`` is
a list of dicts (torch's ``param_groups`` without ``params``: every hyper-parameter
of the twin, the top-level values filling in missing ones) and ``key_groups`` maps
a store key to its group's index (keys not named: group 0). One group is the
top-level values::

    create("torch_adamw", lr=1e-3, weight_decay=0.01)
    create("torch_adamw", lr=1e-3, groups=[{"weight_decay": 0.01}, {"weight_decay": 0.0}],
           key_groups={"fc.bias": 1})

``bfloat16_keys``: the keys of bfloat16 parameters, which the stores keep in
float32: their step runs in bfloat16, as torch's. ``rescale_grad`` multiplies the
gradient first; ``1 / n`` for an integer ``n`` (the Trainer's average over n
workers) divides it by ``n`` with torch's ``div``, as the workers' average does.
MXNet's other options (``learning_rate``, ``wd``,
``clip_gradient``, ``lr_scheduler``, multipliers, ...) do not apply: torch's
schedulers change the groups, which :meth:`TorchTwin.with_groups` sends again
(``kv.set_optimizer(..., keep_state=True)``).

**Whole-model steps** (``clip_grad_norm``, ``grad_scale``; what a worker's
``torch.amp.GradScaler`` and ``torch.nn.utils.clip_grad_norm_`` do between
backward and step, done on the servers): the twin then runs in two phases over the
whole model (:attr:`~kvstore.optimizer.Optimizer.whole_model`; the servers' phases
of LARS and LAMB, docs/architecture.md §9). Phase 1, per chunk: the averaged
gradient unscaled by ``grad_scale`` (as ``GradScaler.unscale_``: times the float32
reciprocal the scaler uses), whether it held an inf or nan, and its 2-norm
(``torch.linalg.vector_norm``, what ``clip_grad_norm_`` computes per tensor). The leading worker's :meth:`TorchTwin.model_sums`: the
norm of the keys' norms (in the call's key order, as ``clip_grad_norm_`` stacks
them), ``clip_coef = max_norm / (total + 1e-6)`` clamped to 1, with torch's ops;
phase 2 multiplies the gradient by it and steps, or (an inf or nan anywhere in the
model, with ``grad_scale``) leaves every key as it is, its step count too, as
``scaler.step`` skips ``optimizer.step()``. A key cut into chunks over several
servers gets its norm from its chunks' norms (the square root of the sum of their
squares, in float64), which is not torch's reduction: exact only for keys held whole.

The state of a weight is the twin's arrays (:attr:`TorchTwin.state_names`, in that
order, each like the weight) and the update count ``t``, torch's ``step``. torch
is imported at the first update, not with this module.
"""

from __future__ import annotations

import numbers
from typing import Any, ClassVar

import numpy

from ..errors import ConfigError
from ._util import _array_module, boolean, real
from .base import Optimizer
from .multipliers import index_key

__all__ = ["TorchTwin"]

#: How a hyper-parameter is checked (as torch's constructors check it).
NONNEG, UNIT, CLOSED_UNIT, BETAS, BOOL = "nonneg", "unit", "closed_unit", "betas", "bool"

#: The twins' own parameters after torch's hyper-parameters (``hyper_params`` ends with them).
TWIN_PARAMS = ("groups", "key_groups", "bfloat16_keys", "clip_grad_norm", "grad_scale")


def _checked(owner: str, name: str, kind: str, value) -> Any:
    """``value`` of hyper-parameter ``name`` in its canonical form (float, bool, or a
    list of two floats for betas); ConfigError for a value torch's constructor refuses."""
    if kind == BOOL:
        return boolean(owner, name, value)
    if kind == BETAS:
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise ConfigError(f"{owner}: {name} must be a pair of reals in [0, 1), got {value!r}")
        return [real(owner, f"{name}[{i}]", b, lo=0.0, hi=1.0, hi_open=True) for i, b in enumerate(value)]
    if kind == UNIT:
        return real(owner, name, value, lo=0.0, hi=1.0, hi_open=True)
    if kind == CLOSED_UNIT:
        return real(owner, name, value, lo=0.0, hi=1.0)
    return real(owner, name, value, lo=0.0)


class TorchTwin(Optimizer):
    """A ``torch.optim`` optimizer's math on the servers (see the module's docstring).

    Subclasses set ``name``, ``torch_name`` (the class in ``torch.optim``), ``fields``
    (each hyper-parameter's torch default and kind, in torch's order),
    ``hyper_params`` (``tuple(fields) + TWIN_PARAMS``), ``state_names``
    and implement :meth:`torch_step`. Raises ConfigError for a bad hyper-parameter,
    group or key, and for MXNet's options other than ``rescale_grad``.
    """

    torch_name: ClassVar[str] = ""
    fields: ClassVar[dict[str, tuple[Any, str]]] = {}
    #: torch's names of the state arrays, in the order the twin keeps them (a weight
    #: keeps those some group needs: :meth:`state_layout`).
    state_names: ClassVar[tuple[str, ...]] = ()
    #: torch keeps ``state["step"]`` (all but SGD, whose count only tells a first step).
    keeps_step: ClassVar[bool] = True

    @classmethod
    def param_names(cls):
        """``rescale_grad``, torch's hyper-parameters, ``groups``, ``key_groups`` and
        ``bfloat16_keys``."""
        return ("rescale_grad",) + cls.hyper_params

    def __init__(self, *, rescale_grad=1.0, groups=None, key_groups=None, bfloat16_keys=None, lr_scheduler=None,
                 clip_grad_norm=None, grad_scale=None, **hyper):
        owner = type(self).__name__
        if lr_scheduler is not None:
            raise ConfigError(f"{owner}: torch's schedulers run on the workers (kvstore.torch.Trainer sends the "
                              "groups they change); an lr_scheduler is MXNet's, for MXNet's optimizers")
        unknown = sorted(set(hyper) - set(self.fields))
        if unknown:
            raise ConfigError(f"{owner}: unknown parameter(s) {', '.join(map(repr, unknown))}; valid parameters "
                              f"are {', '.join(self.param_names())}")
        super().__init__(rescale_grad=rescale_grad)
        top = {n: _checked(owner, n, kind, hyper.get(n, default)) for n, (default, kind) in self.fields.items()}
        for n, v in top.items():
            setattr(self, n, v)
        if groups is None:
            groups = [{}]
        if not isinstance(groups, (list, tuple)) or not groups:
            raise ConfigError(f"{owner}: groups must be a non-empty list of dicts, got {groups!r}")
        self.groups: list[dict] = []
        for i, g in enumerate(groups):
            if not isinstance(g, dict):
                raise ConfigError(f"{owner}: groups[{i}] must be a dict, got {type(g).__name__}")
            extra = sorted(str(k) for k in g if k not in self.fields)
            if extra:
                raise ConfigError(f"{owner}: groups[{i}] has unknown hyper-parameter(s) {', '.join(extra)}; "
                                  f"{self.torch_name}'s are {', '.join(self.fields)}")
            group = {n: _checked(f"{owner} groups[{i}]", n, kind, g.get(n, top[n]))
                     for n, (_, kind) in self.fields.items()}
            self.check_group(f"{owner} groups[{i}]", group)
            self.groups.append(group)
        key_groups = {} if key_groups is None else key_groups
        if not isinstance(key_groups, dict):
            raise ConfigError(f"{owner}: key_groups must be a dict of store key to group index, got "
                              f"{type(key_groups).__name__}")
        self.key_groups: dict = {}
        for k, gi in key_groups.items():
            if isinstance(k, bool) or not isinstance(k, (numbers.Integral, str)):
                raise ConfigError(f"{owner}: key_groups' keys must be store keys (int or str), got {k!r}")
            if isinstance(gi, bool) or not isinstance(gi, numbers.Integral) or not 0 <= gi < len(self.groups):
                raise ConfigError(f"{owner}: key_groups[{k!r}] must be a group index in 0..{len(self.groups) - 1}, "
                                  f"got {gi!r}")
            if gi:      # group 0 is the default: not written
                self.key_groups[int(k) if isinstance(k, numbers.Integral) else k] = int(gi)
        bfloat16_keys = [] if bfloat16_keys is None else bfloat16_keys
        if not isinstance(bfloat16_keys, (list, tuple)) or any(
                isinstance(k, bool) or not isinstance(k, (numbers.Integral, str)) for k in bfloat16_keys):
            raise ConfigError(f"{owner}: bfloat16_keys must be a list of store keys (int or str), got "
                              f"{bfloat16_keys!r}")
        self.bfloat16_keys = sorted({int(k) if isinstance(k, numbers.Integral) else k for k in bfloat16_keys},
                                    key=repr)
        self._bf16 = set(self.bfloat16_keys)
        self._bits = self._rescale_bits(self.rescale_grad)
        self.clip_grad_norm = None if clip_grad_norm is None else real(owner, "clip_grad_norm", clip_grad_norm,
                                                                        lo=0.0)
        self.grad_scale = None if grad_scale is None else real(owner, "grad_scale", grad_scale, lo=0.0,
                                                                lo_open=True)
        self.whole_model = self.splits_norms = clip_grad_norm is not None or grad_scale is not None

    @staticmethod
    def _rescale_bits(rescale: float) -> tuple[str, float | int]:
        """How the gradient is rescaled: ("div", n) for 1/n (torch's div, as the workers
        average), ("mul", r) otherwise, ("none", 1) for 1."""
        if rescale == 1.0:
            return "none", 1
        n = round(1.0 / rescale)
        if n >= 2 and 1.0 / n == rescale:
            return "div", int(n)
        return "mul", rescale

    def check_group(self, owner: str, group: dict) -> None:
        """Raise ConfigError for a combination torch's constructor refuses (checked
        values; override to add checks)."""

    def to_config(self):
        params = {"rescale_grad": self.rescale_grad}
        params.update({n: getattr(self, n) for n in self.fields})
        params["groups"] = [dict(g) for g in self.groups]
        params["key_groups"] = dict(self.key_groups)
        params["bfloat16_keys"] = list(self.bfloat16_keys)
        params["clip_grad_norm"] = self.clip_grad_norm
        params["grad_scale"] = self.grad_scale
        return {"name": self.name, "params": params, "lr_scheduler": None}

    def group_of(self, key) -> int:
        """The index of the group of store key ``key``."""
        return self.key_groups.get(key, 0)

    def with_groups(self, groups: list[dict], key_groups: dict | None = None,
                    bfloat16_keys: list | None = None) -> TorchTwin:
        """This twin with other groups (a scheduler changed them) and, if given, other
        ``key_groups`` and ``bfloat16_keys``; ``rescale_grad`` kept. Raises ConfigError
        for a bad group."""
        config = self.to_config()
        params = {**config["params"], "groups": groups}
        if key_groups is not None:
            params["key_groups"] = key_groups
        if bfloat16_keys is not None:
            params["bfloat16_keys"] = bfloat16_keys
        out = type(self)(**params)
        return out

    @property
    def learning_rate(self) -> float:
        """Group 0's ``lr``."""
        return self.groups[0]["lr"]

    def with_learning_rate(self, learning_rate) -> Optimizer:
        """Every group's ``lr`` set to ``learning_rate`` (``kv.set_learning_rate``)."""
        lr = real(type(self).__name__, "learning_rate", learning_rate, lo=0.0)
        return self.with_groups([{**g, "lr": lr} for g in self.groups])

    def lazy_for(self, row_sparse_key: bool) -> bool:
        """Never lazy: torch's step moves every element of a parameter."""
        return False

    def keeps_master(self, dtype) -> bool:
        return False

    def state_layout(self) -> tuple[str, ...]:
        """The torch names of the state arrays every weight keeps, in order (those some
        group needs)."""
        return self.state_names[:self.num_states]

    def used_states(self, group: dict) -> tuple[str, ...]:
        """The torch state names a parameter of ``group`` has (a subset of
        :meth:`state_layout`; torch makes only those)."""
        return self.state_layout()

    def _step_at(self, weight, grad, state, t, lr, xp, index, rows):
        if self.whole_model:
            raise ConfigError(f"{type(self).__name__}: clip_grad_norm and grad_scale need the whole model's "
                              "gradient, which only dist_sync's two phases give (norms across servers); this "
                              "store updates key by key")
        import torch
        self._torch_update(torch, weight, self._gradient(torch, weight, grad, index), state, t, index)

    def _gradient(self, torch, weight, grad, index):
        """The gradient as torch's step takes it: in the parameter's dtype, averaged
        (``rescale_grad``)."""
        key = index_key(index) if index is not None else None
        g = _view(torch, grad, readonly_ok=True)
        # a bfloat16 parameter (the stores keep it in float32): torch steps it in
        # bfloat16, its state too, so the step runs on bfloat16 copies, written back
        # exactly (float32 holds every bfloat16); its summed gradient rounded to
        # bfloat16 first, as the workers' .grad receives it
        dtype = torch.bfloat16 if key in self._bf16 else _view(torch, weight).dtype
        if g.dtype != dtype:
            g = g.to(dtype)
        how, by = self._bits
        if how == "div":
            g = g.div(by)
        elif how == "mul":
            g = g.mul(by)
        return g

    def chunk_terms(self, weight, grad, state, t, lr, xp, index):
        """Phase 1 of a whole-model step: ``([norm, overflowed], gradient)``, the norm
        of this chunk's averaged gradient unscaled by ``grad_scale``, whether it held an inf or nan (1.0 or 0.0; 0.0 without
        ``grad_scale``), and that gradient, for phase 2."""
        import torch
        g = self._gradient(torch, weight, grad, index)
        if g.data_ptr() == _view(torch, grad, readonly_ok=True).data_ptr():
            g = g.clone()       # unscaled in place below: not the round's sum
        found = False
        if self.grad_scale is not None:
            # what GradScaler.unscale_ runs (_amp_foreach_non_finite_check_and_unscale_):
            # inf/nan noted, every element times inv_scale, the scale's reciprocal in
            # float64 as float32 (the same bits: tests/optimizer/test_torch_twin_whole_model.py)
            inv = torch.tensor(self.grad_scale, dtype=torch.float64, device=g.device).reciprocal().float()
            found = not bool(torch.isfinite(g).all())
            g.mul_(inv)
        # clip_grad_norm_'s per-tensor norm (its foreach path's _foreach_norm gives the same bits on CPU),
        # taken with or without clip_grad_norm: a loop may clip between backward and step
        # (kvstore.torch.Trainer.clip_grad_norm_, the round held open: KVStore.pushpull_open)
        norm = float(torch.linalg.vector_norm(g, 2.0))
        return [norm, 1.0 if found else 0.0], g

    def model_sums(self, terms: list) -> list:
        """``[clip_coef, overflowed]`` for every chunk from every key's chunks' terms
        (:meth:`chunk_terms`): the coefficient as ``clip_grad_norm_`` computes it (the
        norm of the keys' norms, in key order, in float32; ``max_norm / (total +
        1e-6)`` clamped to 1; 1.0 without ``clip_grad_norm`` or when the step is
        skipped), and 1.0 if any chunk held an inf or nan (``grad_scale``: the step
        is skipped everywhere). Raises ValueError for a non-finite norm without
        ``grad_scale`` (an inf or nan gradient that nothing skips)."""
        if self.overflowed(terms):
            return [1.0, 1.0]
        if self.clip_grad_norm is None:
            return [1.0, 0.0]
        total = self.total_norm(terms)
        if not bool(total.isfinite()):
            raise ValueError(f"{type(self).__name__}: the gradient norm is not finite (an inf or nan gradient) and "
                             "no GradScaler skips the step: clip_grad_norm cannot clip it")
        return [self.clip_coef(total, self.clip_grad_norm), 0.0]

    @staticmethod
    def overflowed(terms: list) -> bool:
        """Whether any chunk of ``terms`` (as :meth:`model_sums` takes them) held an inf or nan."""
        return any(chunk[1] for key in terms for chunk in key)

    @staticmethod
    def total_norm(terms: list):
        """The whole model's gradient 2-norm from ``terms`` (as :meth:`model_sums`
        takes them), as ``torch.nn.utils.clip_grad_norm_`` computes and returns it: a
        float32 tensor, the norm of the keys' norms in key order (a key cut into
        chunks: the root of its chunks' squared norms, in float64); 0 for no keys;
        inf or nan where a gradient was."""
        import torch
        norms = [key[0][0] if len(key) == 1 else float(numpy.sqrt(sum(c[0] * c[0] for c in key)))
                 for key in terms]
        if not norms:
            return torch.tensor(0.0)
        return torch.linalg.vector_norm(torch.stack([torch.tensor(n, dtype=torch.float32) for n in norms]), 2.0)

    @staticmethod
    def clip_coef(total, max_norm: float) -> float:
        """What ``clip_grad_norm_`` multiplies every gradient by for ``total`` (a float32
        tensor, :meth:`total_norm`) and ``max_norm``: ``max_norm / (total + 1e-6)``
        clamped to 1, with torch's ops."""
        import torch
        return float(torch.clamp(max_norm / (total + 1e-6), max=1.0))

    def skips(self, sums) -> bool:
        """A whole-model step whose gradients overflowed (``sums[1]``) is skipped."""
        return self.whole_model and bool(sums[1])

    def _apply(self, weight, grad, state, t, lr, xp, index, sums, carry):
        """Phase 2 of a whole-model step: the phase-1 gradient times ``sums[0]`` (the
        clip coefficient, as ``clip_grad_norm_`` multiplies), then torch's step."""
        import torch
        g = carry
        if sums[0] != 1.0:      # clipped (by clip_grad_norm, or a loop's clip_grad_norm_: any coefficient)
            g.mul_(torch.tensor(sums[0], dtype=torch.float32, device=g.device))
        self._torch_update(torch, weight, g, state, t, index)

    def _torch_update(self, torch, weight, g, state, t, index) -> None:
        key = index_key(index) if index is not None else None
        group = self.groups[self.group_of(key) if key is not None else 0]
        w = _view(torch, weight)
        states = [_view(torch, s) for s in state]
        dtype = g.dtype
        if dtype == w.dtype:
            self.torch_step(torch, w, g, states, t, group)
            return
        low = [s.to(dtype) for s in states]
        param = w.to(dtype)
        self.torch_step(torch, param, g, low, t, group)
        w.copy_(param)
        for s, b in zip(states, low):
            s.copy_(b)

    def torch_step(self, torch, param, grad, states: list, t: int, group: dict) -> None:
        """One step of torch's single-tensor functional update of ``param`` (a torch
        view of the chunk) by ``grad``, with ``states`` (views of the weight's arrays),
        this being the weight's update ``t`` (1-based), ``group``'s hyper-parameters."""
        raise NotImplementedError


def step_tensor(torch, t: int):
    """torch's ``state["step"]`` before update ``t`` (a float32 scalar that the
    functional step increments to ``t``)."""
    return torch.tensor(float(t - 1), dtype=torch.float32)


def _view(torch, a, readonly_ok: bool = False):
    """A torch tensor over the memory of array ``a`` (numpy: ``from_numpy``; CuPy:
    DLPack). A read-only numpy array (a received gradient) is copied first."""
    if _array_module(a) is numpy:
        if not a.flags.writeable:
            if not readonly_ok:
                raise ValueError("a twin's weight and state must be writeable arrays")
            a = a.copy()
        return torch.from_numpy(a)
    return torch.from_dlpack(a)

