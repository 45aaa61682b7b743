"""Optimizer base class, the name registry, and config (de)serialisation.

Optimizers cross the wire as a name plus hyper-parameters, never as pickles::

    >>> o = create("sgd", learning_rate=0.1, momentum=0.9)
    >>> cfg = o.to_config()          # plain dict, msgpack/json-able
    >>> from_config(cfg).to_config() == cfg
    True
"""

from __future__ import annotations

import copy
import os
import sys
import types
import warnings
from typing import ClassVar

import numpy

from ..errors import ConfigError
from ..registry import Registry, own_name
from . import fused, multi_tensor
from ._util import (_array_module, _to_module, boolean, check_config_shape, check_params, integer, real,
                    update_count)
from .lr_scheduler import DEFAULT_BASE_LR, LRScheduler, scheduler_from_config
from .multipliers import WD_KEPT, Multipliers, index_key

__all__ = ["Optimizer", "register", "registered", "create", "from_config", "STATE_VERSION"]

STATE_VERSION = 2
"""What optimizer state arrays mean, for files that keep them (optimizer-state files):
1 until NAG's momentum held the learning rate (MXNet's), 2 since. An optimizer
whose state meant something else in an older version converts it in
:meth:`Optimizer.state_from`."""

# Hyper-parameters every optimizer has, in config order: MXNet's Optimizer's (its
# per-parameter multipliers included: kvstore.optimizer.multipliers)
_BASE_PARAMS = ("learning_rate", "wd", "rescale_grad", "clip_gradient", "multi_precision",
                "lr_mult", "wd_mult", "param_idx2name", "param_dict", "begin_num_update")


def register(cls):
    """Class decorator: register an :class:`Optimizer` subclass under ``cls.name``.

    The name is matched case-insensitively by :func:`create` and :func:`from_config`.
    Raises ConfigError if ``cls`` is not an Optimizer subclass, has no ``name`` of
    its own, or the name is already taken by a different class.

    Example::

        @register
        class MySGD(Optimizer):
            name = "mysgd"
            def _step(self, weight, grad, state, t, lr, xp): ...
    """
    return _REGISTRY.add(cls)


def registered():
    """Return the sorted list of registered optimizer names."""
    return _REGISTRY.names()


def create(name, **kwargs):
    """Build a registered optimizer by (case-insensitive) name.

    ``kwargs`` are its hyper-parameters; ``lr_scheduler`` may be an
    :class:`~kvstore.optimizer.LRScheduler`, its config dict, or None.
    Raises ConfigError for an unknown name (listing the valid ones), an unknown
    parameter, or an invalid value.

    Example: ``create("Adam", learning_rate=1e-3, wd=1e-5)``
    """
    cls = _REGISTRY.lookup(name)
    check_params(f"optimizer {cls.name!r}", kwargs, cls.param_names() + tuple(cls.aliases) + ("lr_scheduler",))
    return cls(**kwargs)


def from_config(cfg):
    """Rebuild an optimizer from the dict made by :meth:`Optimizer.to_config`.

    ``cfg`` is ``{"name": str, "params": dict, "lr_scheduler": None | dict}``
    (``params`` and ``lr_scheduler`` may be omitted). Raises ConfigError for a
    malformed config, unknown optimizer/scheduler names (the message lists the valid
    ones), unknown parameters, wrong types or out-of-range values.
    """
    params = check_config_shape("optimizer", cfg, ("name",), ("params", "lr_scheduler"))
    cls = _REGISTRY.lookup(cfg["name"])
    # lr_scheduler is a separate, top-level entry, so it is not a valid key in params.
    check_params(f"optimizer {cls.name!r}", params, cls.param_names() + tuple(cls.aliases))
    sched = cfg.get("lr_scheduler")
    if sched is not None and not isinstance(sched, dict):
        raise ConfigError(f"optimizer config 'lr_scheduler' must be None or a dict, got "
                          f"{type(sched).__name__}")
    return cls(lr_scheduler=sched, **params)


def _callers_level() -> int:
    """The ``stacklevel`` for a warning from Optimizer.__init__ that names the first
    caller outside this package (subclass constructors, from_config, create)."""
    here, level = os.path.dirname(os.path.abspath(__file__)), 2
    frame: types.FrameType | None = sys._getframe(2)      # the caller of Optimizer.__init__
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == here:
        frame, level = frame.f_back, level + 1
    return level


class Optimizer:
    """Base class of optimizers that update weight arrays in place.

    Common hyper-parameters (keyword-only): ``learning_rate`` (>= 0, or None),
    ``wd`` (weight decay, any real: MXNet's accepts a negative one), ``rescale_grad``
    (> 0, multiplies the gradient first), ``clip_gradient`` (None, or a real: > 0 clips
    the rescaled gradient to ``[-c, c]``; <= 0 is no clipping, as in MXNet's kernels,
    except in the optimizers whose MXNet update clips in Python, :attr:`kernel_clip`
    False, where MXNet zeroes (0) or inverts (< 0) the gradient, so it is refused),
    ``lr_scheduler`` (None, an LRScheduler or its config dict),
    ``multi_precision`` (MXNet's: a float16 weight is updated through a float32
    master copy kept in its state, and the float32 state; the weight is the copy
    rounded to float16). Invalid values raise ConfigError. Hyper-parameters are
    plain attributes; treat them as read-only and build a new optimizer to change them.

    The learning rate follows MXNet's ``Optimizer``: a ``learning_rate`` that is not
    None is written into the ``base_lr`` of the optimizer's own copy of the scheduler
    (a UserWarning when the scheduler was given another ``base_lr``: MXNet prints one);
    with ``learning_rate=None`` the scheduler's ``base_lr`` is used, and without a
    scheduler 0.01. :attr:`learning_rate` reads the scheduler's ``base_lr`` while one
    is set; :meth:`learning_rate_at` gives the rate of an update.

    Per parameter (a parameter is a key of the store), MXNet's multipliers:
    ``lr_mult`` and ``wd_mult`` (dicts of key, index or name to a multiplier of the
    rate, >= 0, and of ``wd``; MXNet's ``set_lr_mult`` / ``set_wd_mult`` set them too),
    ``param_idx2name`` (key to name: names not ending in ``_weight`` or ``_gamma`` then
    get ``wd_mult`` 0 unless given, as MXNet's) and ``param_dict`` (key to a gluon
    Parameter, or a dict, with ``lr_mult`` and ``wd_mult``; read once, here); see
    :mod:`kvstore.optimizer.multipliers`. ``begin_num_update`` (MXNet's, >= 0): every
    parameter's update count starts there, so its first update is ``t =
    begin_num_update + 1`` (schedules, Adam's bias correction). They travel with the
    config, so the servers apply them too.

    Arrays may be NumPy or CuPy; all math runs in place in the weight's dtype and
    array module, and the gradient passed in is never modified.

    Subclasses set ``name``, ``hyper_params`` (their extra constructor arguments,
    stored as same-named attributes), ``num_states`` and implement ``_step``.
    """

    name: ClassVar[str] = ""
    hyper_params: ClassVar[tuple[str, ...]] = ()
    #: MXNet's names of hyper-parameters under another name here (``{"eps": "epsilon"}``):
    #: accepted by the constructor, :func:`create` and :func:`from_config`, never written.
    aliases: ClassVar[dict[str, str]] = {}
    #: MXNet clips in its update kernel, which ignores ``clip_gradient <= 0`` (False: its
    #: Python update clips with ``clip(g, -c, c)`` whenever ``c`` is not None).
    kernel_clip: ClassVar[bool] = True
    #: The name endings MXNet's ``set_wd_mult`` keeps weight decay for when
    #: ``param_idx2name`` is given (LARS: ``_weight`` only).
    wd_kept: ClassVar[tuple[str, ...]] = WD_KEPT
    #: The multiplier of the rate of the parameter being updated: 1 here, its
    #: ``lr_mult`` in the view :meth:`for_index` returns (for rates an update reads
    #: itself, as LBSGD's of the previous step).
    lr_scale: float = 1.0

    def __init__(self, *, learning_rate=None, wd=0.0, rescale_grad=1.0, clip_gradient=None,
                 lr_scheduler=None, multi_precision=False, lr_mult=None, wd_mult=None,
                 param_idx2name=None, param_dict=None, begin_num_update=0):
        owner = type(self).__name__
        self.multi_precision = boolean(owner, "multi_precision", multi_precision)
        self.begin_num_update = integer(owner, "begin_num_update", begin_num_update, lo=0)
        self._mults = Multipliers(owner, lr_mult, wd_mult, param_idx2name, param_dict, self.wd_kept)
        self._views: dict = {}           # (lr multiplier, wd multiplier) -> the view for_index returns
        self._view = False
        if learning_rate is not None:
            learning_rate = real(owner, "learning_rate", learning_rate, lo=0.0)
        self.wd = real(owner, "wd", wd)
        self.rescale_grad = real(owner, "rescale_grad", rescale_grad, lo=0.0, lo_open=True)
        self.clip_gradient = real(owner, "clip_gradient", clip_gradient, allow_none=True,
                                  lo=None if self.kernel_clip else 0.0, lo_open=True)
        if isinstance(lr_scheduler, dict):
            lr_scheduler = scheduler_from_config(lr_scheduler)
        elif lr_scheduler is not None and not isinstance(lr_scheduler, LRScheduler):
            raise ConfigError(f"{owner}: lr_scheduler must be None, an LRScheduler or its "
                              f"config dict, got {type(lr_scheduler).__name__}")
        self._lr = DEFAULT_BASE_LR if learning_rate is None else learning_rate
        if lr_scheduler is not None:
            # MXNet writes the optimizer's rate into the scheduler's base_lr; here into
            # a copy, so that a scheduler given to two optimizers is not shared
            lr_scheduler = copy.copy(lr_scheduler)
            had = lr_scheduler.base_lr
            if learning_rate is None:
                learning_rate = DEFAULT_BASE_LR if had is None else had
            elif had is not None and learning_rate != had:
                # MXNet prints this also for a scheduler's default base_lr (0.01); here a
                # scheduler without one is meant to take the optimizer's, so only a given one
                warnings.warn(f"{owner}: learning_rate {learning_rate} overrides the base_lr {had} of "
                              f"{lr_scheduler!r}, as in MXNet (a warm-up still ends at {had}, and "
                              "CosineScheduler and PolyScheduler still decay from it)", UserWarning,
                              stacklevel=_callers_level())
            lr_scheduler.check_base_lr(learning_rate)
            lr_scheduler.base_lr = learning_rate
        self.lr_scheduler = lr_scheduler

    # -- per-parameter multipliers (kvstore.optimizer.multipliers) ------------------------
    @property
    def lr_mult(self) -> dict:
        """The learning-rate multipliers by key, index or name (a copy)."""
        return dict(self._mults.lr_mult)

    @property
    def wd_mult(self) -> dict:
        """The weight-decay multipliers by key, index or name, MXNet's defaults for
        ``param_idx2name``'s names included (a copy)."""
        return dict(self._mults.wd_mult)

    @property
    def param_idx2name(self) -> dict:
        return dict(self._mults.idx2name)

    @property
    def param_dict(self) -> dict:
        """``{key: {"lr_mult": m, "wd_mult": m}}``, as read from the ``param_dict`` given."""
        return {k: dict(v) for k, v in self._mults.param_dict.items()}

    def set_lr_mult(self, args_lr_mult: dict) -> None:
        """MXNet's ``set_lr_mult``: ``args_lr_mult`` (key, index or name -> multiplier)
        replaces every learning-rate multiplier. Call it before ``kv.set_optimizer``,
        which takes a copy of the optimizer (the servers build theirs from its config).
        Raises ConfigError for a bad table, changing nothing."""
        self._mults = self._mults.with_lr_mult(args_lr_mult)
        self._views = {}

    def set_wd_mult(self, args_wd_mult: dict) -> None:
        """MXNet's ``set_wd_mult``: every weight-decay multiplier back to its default (0
        for ``param_idx2name``'s names not ending in ``_weight`` or ``_gamma``, else 1),
        then ``args_wd_mult`` over them. Call it before ``kv.set_optimizer``. Raises
        ConfigError for a bad table, changing nothing."""
        self._mults = self._mults.with_wd_mult(args_wd_mult)
        self._views = {}

    def multipliers(self, key) -> tuple[float, float]:
        """``(lr multiplier, wd multiplier)`` of the parameter ``key`` (a store key), in
        MXNet's order: ``param_dict``, the key's entry, its name's, else 1."""
        return self._mults.scales(key)

    def with_multipliers(self, lr_mult: dict | None = None, wd_mult: dict | None = None) -> Optimizer:
        """This optimizer (a new one: the same config) with these entries added to its
        ``lr_mult`` and ``wd_mult`` tables (an entry by key wins over one by name).
        Raises ConfigError for a bad entry."""
        config = self.to_config()
        params = config["params"]
        return from_config({**config, "params": {**params, "lr_mult": {**params["lr_mult"], **(lr_mult or {})},
                                                 "wd_mult": {**params["wd_mult"], **(wd_mult or {})}}})

    def param_name(self, index) -> str:
        """The name of the parameter of updater index ``index`` (a key, or a server's
        ``(key, chunk)``): ``param_idx2name``'s, else ``str(key)``, as MXNet's LARS."""
        return self._mults.name_of(index_key(index))

    def for_index(self, index) -> Optimizer:
        """This optimizer as it updates the parameter of ``index``: itself, or (when the
        parameter's multipliers are not 1) a view whose ``wd`` is ``wd * wd_mult`` and
        whose :attr:`lr_scale` is its ``lr_mult``, made once per pair of multipliers."""
        if self._view or not self._mults.any:
            return self
        scales = self._mults.scales(index_key(index))
        if scales == (1.0, 1.0):
            return self
        view = self._views.get(scales)
        if view is None:
            view = copy.copy(self)
            view.lr_scale, view.wd, view._view, view._views = scales[0], self.wd * scales[1], True, {}
            self._views[scales] = view
        return view

    @property
    def clip_bound(self) -> float | None:
        """The bound the gradient is clipped to, or None: ``clip_gradient`` unless that is
        None or (:attr:`kernel_clip`) <= 0, which MXNet's kernels take as no clipping."""
        c = self.clip_gradient
        return None if c is None or c <= 0.0 else c

    @property
    def learning_rate(self) -> float:
        """The base learning rate: the scheduler's ``base_lr`` while one is set (where
        the constructor wrote ``learning_rate``, as MXNet), else the optimizer's own.
        The rate of update ``t`` is :meth:`learning_rate_at`."""
        if self.lr_scheduler is not None and self.lr_scheduler.base_lr is not None:
            return self.lr_scheduler.base_lr
        return self._lr

    @classmethod
    def param_names(cls):
        """Names of the hyper-parameters recorded in ``to_config()["params"]``."""
        return _BASE_PARAMS + cls.hyper_params

    @property
    def num_states(self):
        """Number of state arrays :meth:`create_state` returns (0 if stateless)."""
        return 0

    def to_config(self):
        """Return ``{"name", "params", "lr_scheduler"}`` made only of str/int/float/bool/
        None values, lists and dicts (the multipliers', keyed by int or str), suitable
        for msgpack; :func:`from_config` inverts it."""
        sched = self.lr_scheduler.to_config() if self.lr_scheduler is not None else None
        return {"name": self.name,
                "params": {p: getattr(self, p) for p in self.param_names()},
                "lr_scheduler": sched}

    def needs_whole_keys(self) -> bool:
        """Whether an update needs the key's every value at once (norms over a layer:
        LARS, LAMB; kvstore.optimizer.layerwise): the stores then refuse row-sparse
        keys, and keys cut into chunks over several servers unless the update splits
        in two phases (:attr:`splits_norms`) and the store can run them."""
        return False

    def lazy_for(self, row_sparse_key: bool) -> bool:
        """Whether a row-sparse gradient updates only its rows: their weights, weight
        decay and optimizer state, every other row left as it is (MXNet's lazy update).
        ``row_sparse_key``: the key is row-sparse (else dense, pushed a row-sparse
        value). Here: yes on a row-sparse key, no on a dense one, where the gradient
        counts as dense with zeros elsewhere (MXNet's fallback for an optimizer without
        a sparse update). SGD, Adam and LARS take MXNet's ``lazy_update`` instead."""
        return row_sparse_key

    #: The update splits into :meth:`norm_terms` (a chunk's partial sums of squares)
    #: and :meth:`apply_norms` (the step with the whole key's sums), so a key cut into
    #: chunks over several servers gets the one-process formula (LARS, LAMB; dist_sync).
    #: A class sets it, or an instance whose hyper-parameters need it (a torch twin
    #: with ``clip_grad_norm`` or ``grad_scale``: :attr:`whole_model`).
    splits_norms: bool = False

    #: The sums phase 2 needs span the whole model, not one key: every key's pushes
    #: take the two phases (not only keys cut over servers) and the leading worker
    #: gives every chunk :meth:`model_sums` of all the keys' terms, instead of its
    #: key's sums (a torch twin clipping by the global norm, or unscaling a
    #: GradScaler's gradients and skipping a step that overflowed). Implies
    #: :attr:`splits_norms`.
    whole_model: bool = False

    def model_sums(self, terms: list) -> list:
        """:attr:`whole_model`: from ``terms``, every key's chunks' terms (keys in the
        call's order, each a list of its chunks' term lists, in chunk order), the sums
        every chunk's :meth:`apply_norms` gets (the same length as a chunk's terms)."""
        raise NotImplementedError(f"{type(self).__name__} has no whole-model sums")

    def skips(self, sums) -> bool:
        """Whether :meth:`apply_norms` with ``sums`` leaves the weight unchanged, its
        update count included (a step skipped: a GradScaler's overflow)."""
        return False

    #: Whether this class runs its two-phase layer-wise update on CuPy arrays itself
    #: (LARS, LAMB): it defines ``fused_norm_terms`` and ``fused_apply_norms``, which
    #: kvstore.optimizer.fused calls with its kernel builder. An optimizer with an
    #: elementwise kernel declares it (``fused.define``) and defines
    #: ``fused_plan(state, t, lr, dtype) -> (kernel name, {scalar: value})`` instead.
    #: Either is used only by the class that defines it itself (a subclass keeps its
    #: own math: kvstore.optimizer.fused.has_kernel).
    fused_norms: ClassVar[bool] = False

    def learning_rate_at(self, t):
        """Return the learning rate used by update ``t`` (1-based, scheduler applied)."""
        t = update_count(type(self).__name__, t)
        if self.lr_scheduler is None:
            return self._lr
        return self.lr_scheduler(t)

    def with_learning_rate(self, learning_rate) -> Optimizer:
        """This optimizer with another base ``learning_rate``: the same kind and other
        hyper-parameters, so that it can take over this one's state (what
        ``kv.set_learning_rate`` does; :meth:`Updater.replace_optimizer`). Raises
        ConfigError while an lr_scheduler is set, which sets the rate (MXNet's
        ``Optimizer.set_learning_rate`` refuses it too), and for a bad value.

        Example: ``SGD(learning_rate=0.1, momentum=0.9).with_learning_rate(0.03)``
        """
        if self.lr_scheduler is not None:
            raise ConfigError(f"{type(self).__name__}: cannot set the learning rate to {learning_rate!r}: "
                              f"its lr_scheduler {self.lr_scheduler!r} sets it (MXNet refuses this too); set "
                              "an optimizer without one, or with another schedule, instead")
        config = self.to_config()
        return from_config({**config, "params": {**config["params"], "learning_rate": learning_rate}})

    def state_scale_from(self, previous: Optimizer, t: int) -> float:
        """The factor that multiplies a weight's state, after ``t`` updates by ``previous``
        (the same kind, other hyper-parameters), when this optimizer takes it over
        (:meth:`Updater.replace_optimizer`): 1.0, unless the meaning of the state
        depends on the rate of the last update (LARS's momentum correction)."""
        return 1.0

    def state_from(self, version: int, t: int, arrays: list) -> list:
        """``arrays``, a weight's state after ``t`` updates as this optimizer kept it at
        state version ``version`` (:data:`STATE_VERSION`), in the current meaning. The
        same arrays unless the meaning changed (NAG's momentum in version 1); raises
        ValueError for a version this optimizer cannot read."""
        if not 1 <= version <= STATE_VERSION:
            raise ValueError(f"{type(self).__name__}: optimizer state version {version!r} is unknown; this "
                             f"kvstore reads 1 to {STATE_VERSION}")
        return arrays

    def keeps_master(self, dtype) -> bool:
        """Whether a weight of ``dtype`` is updated through a float32 master copy
        (``multi_precision=True`` and a float16 weight, as MXNet)."""
        return self.multi_precision and numpy.dtype(dtype) == numpy.float16

    def state_spec(self, dtype) -> tuple:
        """``(count, dtype)`` of the state arrays of a weight of ``dtype``: with a
        master copy, the float32 copy comes first and the state is float32 too."""
        if self.keeps_master(dtype):
            return self.num_states + 1, numpy.dtype(numpy.float32)
        return self.num_states, numpy.dtype(dtype)

    def create_state(self, weight):
        """Return a tuple of ``num_states`` zero arrays like ``weight`` (same dtype,
        shape and array module); ``()`` for a stateless optimizer. With a master
        copy (:meth:`keeps_master`): the weight in float32, then the state in float32."""
        xp = _array_module(weight)
        if self.keeps_master(weight.dtype):
            master = weight.astype(xp.float32)
            return (master,) + tuple(xp.zeros_like(master) for _ in range(self.num_states))
        return tuple(xp.zeros_like(weight) for _ in range(self.num_states))

    def update(self, weight, grad, state, t, *, index=None, rows=None):
        """Apply one update to ``weight`` (and ``state``) in place.

        ``state`` is what :meth:`create_state` returned; ``t`` is the 1-based number
        of updates this weight has received including this one. ``grad`` is left
        unchanged; it may have another float dtype (it is converted). ``index`` (the
        :class:`~kvstore.optimizer.Updater`'s index) and ``rows`` (the row ids of
        a lazy update, whose ``weight`` is those rows of a 2-d weight) say where the
        values are: only an update that depends on position uses them (SGLD's
        noise, :meth:`_step_at`); the weight's parameter also picks its multipliers
        (:meth:`for_index`). Raises TypeError for a non-float weight and
        ValueError for mismatched shapes, dtypes or state length.
        """
        view = self.for_index(index)
        if view is not self:
            return view.update(weight, grad, state, t, index=index, rows=rows)
        state, xp = self._checked(weight, grad, state, t)
        t = update_count(type(self).__name__, t)
        if self.keeps_master(weight.dtype):
            # MXNet's multi_precision: the update runs on the float32 master copy
            # (state[0]) with the float32 state; the float16 weight is its rounding
            self.update(state[0], grad, state[1:], t, index=index, rows=rows)
            multi_tensor.settle(state[0])      # a batched update of the master runs first
            xp.copyto(weight, state[0], casting="same_kind")
            return
        grad, lr = _to_module(grad, xp), self.learning_rate_at(t) * self.lr_scale
        # A server event's updates on a GPU: one launch for all its chunks (multi_tensor.py).
        batch = multi_tensor.collecting()
        if batch is not None and rows is None and batch.add(
                self, weight, grad, state, t, lr, lambda: self._step_at(weight, grad, state, t, lr, xp, index, rows)):
            return
        # On the GPU one fused kernel replaces _step's many small ones (see fused.py).
        if xp is not numpy and fused.fused_step(self, weight, grad, state, t, lr, index, rows):
            return
        self._step_at(weight, grad, state, t, lr, xp, index, rows)

    def norm_terms(self, weight, grad, state, t, *, index=None):
        """Phase 1 of a :attr:`splits_norms` update of one chunk of a key (arguments as
        :meth:`update`): returns ``(terms, carry)``, the chunk's partial sums of squares
        (floats; summed over every chunk of the key, they are the key's) and what
        phase 2 needs. Changes nothing: ``weight`` and ``state`` are left as they are
        until :meth:`apply_norms`."""
        view = self.for_index(index)
        if view is not self:
            return view.norm_terms(weight, grad, state, t, index=index)
        state, xp = self._checked(weight, grad, state, t)
        t = update_count(type(self).__name__, t)
        if self.keeps_master(weight.dtype):
            return self.norm_terms(state[0], grad, state[1:], t, index=index)
        grad, lr = _to_module(grad, xp), self.learning_rate_at(t) * self.lr_scale
        if xp is not numpy and fused.usable(self, weight, grad, state):
            return fused.norm_terms(self, weight, grad, state, t, lr, index, xp)
        return self.chunk_terms(weight, grad, state, t, lr, xp, index)

    def apply_norms(self, weight, grad, state, t, sums, carry, *, index=None):
        """Phase 2: the update of this chunk with ``sums``, the key's sums of the terms
        that :meth:`norm_terms` gave for each chunk, and that call's ``carry``."""
        view = self.for_index(index)
        if view is not self:
            return view.apply_norms(weight, grad, state, t, sums, carry, index=index)
        state, xp = self._checked(weight, grad, state, t)
        t = update_count(type(self).__name__, t)
        if self.keeps_master(weight.dtype):
            self.apply_norms(state[0], grad, state[1:], t, sums, carry, index=index)
            xp.copyto(weight, state[0], casting="same_kind")
            return
        grad, lr = _to_module(grad, xp), self.learning_rate_at(t) * self.lr_scale
        if xp is not numpy and fused.usable(self, weight, grad, state):
            return fused.apply_norms(self, weight, grad, state, t, lr, list(sums), carry)
        self._apply(weight, grad, state, t, lr, xp, index, list(sums), carry)

    def chunk_terms(self, weight, grad, state, t, lr, xp, index):
        """Phase 1 of a :attr:`splits_norms` update (``lr`` already scheduled, arguments
        checked): ``(terms, carry)`` as :meth:`norm_terms` returns them."""
        raise NotImplementedError(f"{type(self).__name__} does not split its update by norms")

    def _apply(self, weight, grad, state, t, lr, xp, index, sums, carry):
        raise NotImplementedError(f"{type(self).__name__} does not split its update by norms")

    def _checked(self, weight, grad, state, t):
        """``(state as a tuple, array module)`` after checking the arguments of an
        update (see :meth:`update`); raises TypeError or ValueError."""
        owner = type(self).__name__
        update_count(owner, t)
        xp = _array_module(weight)
        if getattr(weight, "dtype", None) is None or weight.dtype.kind != "f":
            raise TypeError(f"{owner}: weight must be a floating-point array, got "
                            f"{getattr(weight, 'dtype', type(weight).__name__)}")
        if tuple(grad.shape) != tuple(weight.shape):
            raise ValueError(f"{owner}: grad shape {tuple(grad.shape)} does not match weight "
                             f"shape {tuple(weight.shape)}")
        state = tuple(state) if state is not None else ()
        if self.keeps_master(weight.dtype):
            if not state or tuple(state[0].shape) != tuple(weight.shape) or state[0].dtype != numpy.float32:
                raise ValueError(f"{owner}: multi_precision needs a float32 master copy of the "
                                 f"float16 weight as the first state array")
            return state, xp
        if len(state) != self.num_states:
            raise ValueError(f"{owner}: expected {self.num_states} state array(s), got "
                             f"{len(state)}")
        for s in state:
            if tuple(s.shape) != tuple(weight.shape) or s.dtype != weight.dtype:
                raise ValueError(f"{owner}: state array {s.dtype}{tuple(s.shape)} does not "
                                 f"match weight {weight.dtype}{tuple(weight.shape)}")
        return state, xp

    def _step(self, weight, grad, state, t, lr, xp):
        """The update itself, in place on ``weight`` and ``state`` (validated arrays
        of module ``xp``; ``lr`` is ``learning_rate_at(t)`` times the parameter's
        ``lr_mult``, and ``self.wd`` its weight decay). Subclasses implement it."""
        raise NotImplementedError

    def _step_at(self, weight, grad, state, t, lr, xp, index, rows):
        """:meth:`_step`, told where the values are (see :meth:`update`). An optimizer
        whose update depends on position (SGLD's noise) overrides this instead."""
        self._step(weight, grad, state, t, lr, xp)

    def _rescaled_grad(self, weight, grad, xp, *, wd_before_clip):
        """Return a fresh copy of ``rescale_grad * grad`` in the weight's dtype, clipped.

        MXNet's adam/rmsprop kernels add ``wd * weight`` before clipping while
        sgd/nag/adagrad add it after; ``wd_before_clip`` selects the former.
        """
        g = grad.astype(weight.dtype, copy=True)  # the copy keeps the caller's grad intact
        if self.rescale_grad != 1.0:
            g *= self.rescale_grad
        if wd_before_clip and self.wd:
            g += self.wd * weight
        if self.clip_bound is not None:
            xp.clip(g, -self.clip_bound, self.clip_bound, out=g)
        return g

    def __repr__(self):
        cfg = self.to_config()
        args = [f"{k}={v!r}" for k, v in cfg["params"].items()]
        if self.lr_scheduler is not None:
            args.append(f"lr_scheduler={self.lr_scheduler!r}")
        return f"{type(self).__name__}({', '.join(args)})"


_REGISTRY = Registry("optimizer", Optimizer, "register", own_name)
