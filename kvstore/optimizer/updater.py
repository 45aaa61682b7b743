"""Updater: applies one optimizer to many weights, like MXNet's ``get_updater``."""

from __future__ import annotations

import numbers

from ._util import _array_module, _to_module
from .base import Optimizer

__all__ = ["Updater"]


def _key(index):
    """Normalise a index to a hashable int / str / tuple of those."""
    if isinstance(index, bool):
        raise TypeError("updater index must be an int, str or tuple, got bool")
    if isinstance(index, numbers.Integral):
        return int(index)  # numpy ints become plain ints, so get_states() stays msgpack-able
    if isinstance(index, str):
        return index
    if isinstance(index, tuple):
        return tuple(_key(i) for i in index)
    raise TypeError(f"updater index must be an int, str or tuple, got {type(index).__name__}")


def _is_array(a):
    return hasattr(a, "shape") and hasattr(a, "dtype") and hasattr(a, "__setitem__")


class Updater:
    """Apply ``optimizer`` to many weights, keeping per-weight state and counts.

    ``updater(index, grad, weight)`` (MXNet's updater signature) updates
    ``weight`` in place. ``index`` is an int, str or tuple naming one weight (a
    tuple is one composite key, e.g. ``(key, chunk)``, not a batch as in MXNet).
    The weight's state is created on first use and its update count ``t`` goes
    1, 2, 3, ... (from ``begin_num_update + 1``, as MXNet's); if the optimizer
    raises, the count is not advanced.

    Not thread-safe: callers must serialise calls for the same weight and around
    :meth:`get_states` / :meth:`set_states`.

    Example::

        u = Updater(SGD(learning_rate=0.1, momentum=0.9))
        w = numpy.zeros(3, numpy.float32)
        u(0, numpy.ones(3, numpy.float32), w)    # w is now [-0.1, -0.1, -0.1]
        u.get_states()    # {0: {"t": 1, "state": [array([-0.1, -0.1, -0.1])]}}
    """

    def __init__(self, optimizer):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"Updater needs an Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self._states = {}
        self._counts = {}

    def __call__(self, index, grad, weight):
        """Update ``weight`` in place from ``grad`` for weight ``index``."""
        key = _key(index)
        state = self._state_of(key, weight)
        t = self._count(key) + 1
        self.optimizer.update(weight, grad, state, t, index=key)
        self._states[key] = state
        self._counts[key] = t

    def _count(self, key) -> int:
        """The updates weight ``key`` has had, counted from the optimizer's
        ``begin_num_update`` (MXNet's ``_index_update_count``)."""
        return self._counts.get(key, self.optimizer.begin_num_update)

    def norm_terms(self, index, grad, weight):
        """Phase 1 of weight ``index``'s next update when its key is cut into chunks and
        the optimizer :attr:`~kvstore.optimizer.Optimizer.splits_norms`: returns
        ``(terms, carry)`` (see ``Optimizer.norm_terms``). Changes nothing: the weight's
        state and count move at :meth:`apply_norms`."""
        key = _key(index)
        state = self._state_of(key, weight)
        t = self._count(key) + 1
        terms, carry = self.optimizer.norm_terms(weight, grad, state, t, index=key)
        return terms, (state, carry)

    def apply_norms(self, index, grad, weight, sums, carry, rows=None):
        """Phase 2: the update of weight ``index`` with ``sums`` (the key's sums of the
        terms over its chunks) and the ``carry`` that :meth:`norm_terms` returned.
        ``rows`` (see :meth:`update_lazy`): a lazy update, of those rows only, when the
        optimizer is lazy on dense keys; the norms stay the whole key's."""
        key = _key(index)
        state, inner = carry
        t = self._count(key) + 1
        if self.optimizer.skips(sums):        # a skipped step: no update, the count stays
            return
        if rows is not None and self.optimizer.lazy_for(row_sparse_key=False):
            self._on_rows(weight, grad, state, rows, lambda w, g, st: self.optimizer.apply_norms(
                w, g, st, t, sums, inner, index=key))
        else:
            self.optimizer.apply_norms(weight, grad, state, t, sums, inner, index=key)
        self._states[key] = state
        self._counts[key] = t

    def update_lazy(self, index, grad, weight, rows) -> None:
        """A row-sparse gradient's update of a dense weight. ``weight`` is the weight's
        value as the weight is otherwise updated (the same shape), ``grad`` the whole
        gradient (zero outside its rows), ``rows`` the unique ids, along the first axis,
        of the rows the gradient names (a server's flat chunk: element positions). When
        the optimizer is lazy on dense keys (MXNet's ``lazy_update``: SGD, Adam, LARS)
        only those rows of the weight and of the state change (LARS: its norms are the
        whole key's, the step is on the rows); otherwise this is ``self(index, grad,
        weight)``, every row updated. The count ``t`` moves either way."""
        if not self.optimizer.lazy_for(row_sparse_key=False):
            self(index, grad, weight)
            return
        key = _key(index)
        state = self._state_of(key, weight)
        t = self._count(key) + 1
        optimizer = self.optimizer
        if optimizer.splits_norms:       # norms over the whole key, then the step on its rows
            terms, carry = optimizer.norm_terms(weight, grad, state, t, index=key)
            self._on_rows(weight, grad, state, rows, lambda w, g, st: optimizer.apply_norms(
                w, g, st, t, terms, carry, index=key))
        else:
            self._on_rows(weight, grad, state, rows, lambda w, g, st: optimizer.update(
                w, g, st, t, index=key, rows=rows))
        self._states[key] = state
        self._counts[key] = t

    @staticmethod
    def _on_rows(weight, grad, state, rows, step) -> None:
        """``step(w, g, st)`` on gathered copies of ``rows`` (along the first axis) of the
        weight, the gradient and each state array, then the copies written back."""
        xp = _array_module(weight)
        n = weight.shape[0] if weight.ndim else 1
        rows = _to_module(rows, xp)
        w2 = weight.reshape(n, -1)
        views = [s.reshape(n, -1) for s in state]
        w, g, st = w2[rows], _to_module(grad, xp).reshape(n, -1)[rows], tuple(v[rows] for v in views)
        step(w, g, st)
        w2[rows] = w
        for view, part in zip(views, st):
            view[rows] = part

    def _state_of(self, key, weight):
        state = self._states.get(key)
        if state is None:
            return self.optimizer.create_state(weight)
        # State restored by set_states may live in another array module than the
        # weight (e.g. a host checkpoint for a GPU weight): move it once.
        xp = _array_module(weight)
        return tuple(_to_module(s, xp) for s in state)

    def update_rows(self, index, rows, grad, weight):
        """The update of a row-sparse key's weight by its gradient rows: lazy (MXNet's
        default for row-sparse gradients; :meth:`Optimizer.lazy_for`), only
        ``weight[rows]`` and the same rows of the weight's state change; with an optimizer
        that is not lazy there (``lazy_update=False``) every row, the gradient zero
        outside ``rows``. ``weight`` is 2-d (rows, row width) over the weight's memory,
        ``rows`` unique and ``grad`` (len(rows), width). The weight's state covers the
        whole ``weight`` (flat); its count ``t`` counts updates of the weight, whichever
        rows they touched (as MXNet's lazy Adam)."""
        key = _key(index)
        xp = _array_module(weight)
        if not self.optimizer.lazy_for(row_sparse_key=True):
            dense = xp.zeros(weight.shape, grad.dtype)
            dense[_to_module(rows, xp)] = _to_module(grad, xp)
            self(index, dense.reshape(-1), weight.reshape(-1))
            return
        state = self._states.get(key)
        if state is None:
            state = self.optimizer.create_state(weight.reshape(-1))
        else:
            state = tuple(_to_module(s, xp) for s in state)
        views = [s.reshape(weight.shape) for s in state]
        w, row_state = weight[rows], tuple(v[rows] for v in views)   # gathered copies
        t = self._count(key) + 1
        self.optimizer.update(w, grad, row_state, t, index=key, rows=rows)
        weight[rows] = w
        for view, part in zip(views, row_state):
            view[rows] = part
        self._states[key] = state
        self._counts[key] = t

    def replace_optimizer(self, optimizer, state_scale: float = 1.0) -> None:
        """Use ``optimizer`` from now on, keeping every weight's state and count: it must
        be the same kind (its state arrays mean the same), e.g. another learning rate.
        ``state_scale`` multiplies every state array (see KVStore.set_learning_rate),
        and so does ``optimizer.state_scale_from(old optimizer, t)`` those of a weight
        updated ``t`` times (LARS's momentum correction); a multi_precision master
        copy of the weight is left as it is. Raises TypeError or ValueError
        otherwise, changing nothing."""
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"Updater needs an Optimizer, got {type(optimizer).__name__}")
        if type(optimizer) is not type(self.optimizer) or optimizer.num_states != self.optimizer.num_states:
            raise ValueError(f"cannot keep the state of {self.optimizer!r} for {optimizer!r}: "
                             "only hyper-parameters may change")
        previous, self.optimizer = self.optimizer, optimizer
        for key, state in self._states.items():
            scale = state_scale * optimizer.state_scale_from(previous, self._counts[key])
            master = optimizer.multi_precision and len(state) == optimizer.num_states + 1
            if scale != 1.0:
                for s in state[1 if master else 0:]:
                    s *= scale

    def get_states(self):
        """Return ``{index: {"t": int, "state": [arrays]}}`` for every known weight.

        The arrays are the live state arrays, not copies: copy them before the next
        update if you need a snapshot.
        """
        return {key: {"t": self._counts[key], "state": list(state)}
                for key, state in self._states.items()}

    def set_states(self, states):
        """Load ``{index: {"t": int, "state": [arrays]}}`` (as from :meth:`get_states`).

        Values are copied: into the existing arrays of a weight that has state (whose
        shapes and dtypes must match), or into fresh copies for a new weight. Weights not
        in ``states`` are left as they are. Everything is validated before anything
        is changed, so a bad entry leaves the updater untouched. Raises TypeError for
        wrong types and ValueError for a wrong count, number of arrays, shape or dtype.
        """
        if not isinstance(states, dict):
            raise TypeError(f"set_states expects a dict, got {type(states).__name__}")
        n = self.optimizer.num_states
        staged = []
        for index, entry in states.items():
            key = _key(index)
            where = f"set_states[{index!r}]"
            if not isinstance(entry, dict) or set(entry) != {"t", "state"}:
                raise ValueError(f"{where} must be a dict with exactly the keys 't' and 'state'")
            t = entry["t"]
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise TypeError(f"{where}['t'] must be an int, got {type(t).__name__}")
            if t < 0:
                raise ValueError(f"{where}['t'] must be >= 0, got {t}")
            arrays = entry["state"]
            if not isinstance(arrays, (list, tuple)) or not all(map(_is_array, arrays)):
                raise TypeError(f"{where}['state'] must be a list of arrays")
            allowed = {n, n + 1} if self.optimizer.multi_precision else {n}  # + a master copy
            if len(arrays) not in allowed:
                raise ValueError(f"{where}['state'] has {len(arrays)} array(s); "
                                 f"{type(self.optimizer).__name__} uses {n}")
            existing = self._states.get(key)
            if existing is not None:
                for old, new in zip(existing, arrays):
                    if tuple(old.shape) != tuple(new.shape) or old.dtype != new.dtype:
                        raise ValueError(f"{where}: state {new.dtype}{tuple(new.shape)} does "
                                         f"not match existing {old.dtype}{tuple(old.shape)}")
            staged.append((key, int(t), arrays, existing))
        for key, t, arrays, existing in staged:
            if existing is not None:
                for old, new in zip(existing, arrays):
                    old[...] = _to_module(new, _array_module(old))
            else:
                self._states[key] = tuple(_array_module(a).array(a, copy=True) for a in arrays)
            self._counts[key] = t
