"""The API every built-in store type implements.

Subclasses implement the ``_do_*`` hooks on already validated, normalised
arguments (kvstore.worker.arguments): numpy arrays and :class:`KeyInfo` records.
"""

from __future__ import annotations

import logging

import numpy as np

from ..devices import arrays
from ..rows import keys as rowkeys
from ..rows import sparse as rowsparse
from ..rows.dynamic import DynamicRows
from . import states_file
from .arguments import KeyInfo, Keys, check_priority
from .plans import CallPlan, Plans
from ..compression import Compressor
from .. import optimizer as _optimizer
from ..errors import ArgumentTypeError, InvalidArgumentError
from ..protocol.codec import ALLOWED_DTYPES
from .types import KVStoreBase

log = logging.getLogger(__name__)

__all__ = ["KVStore", "KeyInfo", "Handle", "fill_outputs"]


class KVStore(KVStoreBase):
    """A key-value store for gradients and weights, with MXNet's KVStore API.

    Keys are ``int`` (64-bit) or ``str``, one kind per store. Values are numpy
    arrays, torch tensors or cupy arrays; a list of values for one key (one per
    device) is summed. Create stores with :func:`kvstore.create`. Every built-in
    type runs optimizers (``kv.is_capable(KVStore.OPTIMIZER)`` is True).
    """

    capabilities = frozenset({KVStoreBase.OPTIMIZER})

    def __init__(self, name: str):
        self._type = name
        self._args = Keys()          # the keys held, and the checks of call arguments (kvstore.worker.arguments)
        self._keys = self._args.infos     # key -> KeyInfo, filled by the stores' init hooks
        # repeated calls' resolutions (kvstore.worker.plans), cleared whenever what they
        # depend on changes (init, optimizer, compression, members, close)
        self._plans = Plans()
        self._optimizer = None
        self._compressor: Compressor | None = None
        self._closed = False
        #: A whole-model optimizer's sums of the last pushpull that ran its two phases
        #: (``Optimizer.model_sums``: a torch twin's ``[clip_coef, overflowed]``), the
        #: same on every worker; None before one.
        self.last_model_sums: list | None = None

    @property
    def key_type(self) -> type | None:
        """``int`` or ``str``: the kind of key this store holds (one kind per store),
        or None before the first ``init``."""
        return self._args.kind

    @property
    def type(self) -> str:
        """The name the store was created with, lower-cased, e.g. ``"dist_sync"``
        (an alias stays as given, as in MXNet: ``"dist_sync_device"``)."""
        return self._type

    # -- the API --------------------------------------------------------------------
    def init(self, key, value) -> None:
        """Create keys with initial values. In dist mode every worker calls it with
        the same keys; rank 0's values win and nobody returns before the servers
        hold them. Raises InvalidArgumentError for a key initialised twice."""
        what = "init"
        self._check_open(what)
        self._plans.clear()
        items, rows_items, seen, names = [], [], set(), {}
        for k, vals in self._args.pairs(key, value, what):
            if len(vals) != 1:
                raise InvalidArgumentError(f"{what}: key {k!r} needs one initial value, got {len(vals)}")
            if k in self._keys or k in seen:
                raise InvalidArgumentError(f"{what}: key {k!r} is already initialised")
            seen.add(k)
            if rowkeys.is_rows_init(vals[0]):          # a row-sparse key (kvstore.rows.sparse)
                rows_items.append((k, *rowkeys.init_parts(vals[0], f"{what} of key {k!r}")))
                names[k] = rows_items[-1][2].name
                continue
            shape, dtype = arrays.shape_dtype(vals[0], what)
            if dtype.str not in ALLOWED_DTYPES:
                raise InvalidArgumentError(f"{what}: key {k!r} has unsupported dtype {dtype.name}")
            items.append((k, shape, dtype, arrays.to_numpy(vals[0], what)))
            names[k] = arrays.dtype_name(vals[0])
        if self._args.kind is None and seen:
            self._args.kind = type(next(iter(seen)))
        if items or not rows_items:
            self._do_init(items)
        if rows_items:
            infos = [KeyInfo(k, tuple(shape), np.dtype(dtype), sparse=True,
                             dynamic=spec if isinstance(spec, DynamicRows) else None)
                     for k, shape, dtype, spec, *_ in rows_items]
            self._check_whole_keys(self._optimizer, infos, what)
            self._check_lazy_rows(self._optimizer, infos, what)
            self._do_init_rows(rows_items)
        self._args.dtype_names.update(names)

    def push(self, key, value, priority: int = 0) -> None:
        """Push values (gradients) for keys. A list of values for one key is summed.
        Without an optimizer the (merged) sum replaces the stored value; with one,
        the optimizer applies it. May return before the servers applied it."""
        self._push(key, value, priority, wait_sent=True)

    def _push(self, key, value, priority: int, wait_sent: bool) -> None:
        """push(); with ``wait_sent=False`` it may return while the network still reads
        the caller's buffers: the caller must not modify them before its next pull."""
        what = "push"
        self._check_open(what)
        check_priority(priority, what)
        found = self._plans.find(what, key, value)       # a repeated call (kvstore.worker.plans)
        if found is not None:
            plan, values, _ = found
            self._do_push([(info, self._merged(info, [values[i] for i in at], what)) for info, at in plan.groups],
                          wait_sent)
            return
        pairs = self._args.pairs(key, value, what)
        named = self._lazy_rows(pairs, what)          # before the sparse values become dense
        pairs = self._args.densify(pairs, what)       # MXNet: sparse on dense sums densely
        rows = [(self._args.info(k, what), vals) for k, vals in pairs if self._args.info(k, what).sparse]
        groups = self._args.grouped_pairs([p for p in pairs if not self._keys[p[0]].sparse] if rows else pairs, what)
        self._check_optimizable(groups + rows, what)
        row_parts = [(info, *rowkeys.push_parts(vals, info.shape, info.dtype, f"{what} of key {info.key!r}"))
                     for info, vals in rows]             # everything is checked before anything is sent
        if not rows and not named:
            self._plans.record(what, key, value, None, groups)
        if groups:
            self._do_push([(info, self._merged(info, vals, what)) for info, vals in groups], wait_sent,
                          rows=named or None)
        if row_parts:
            self._do_push_rows(row_parts)

    def _lazy_rows(self, pairs: list, what: str) -> dict:
        """``{key: row ids}`` of the dense keys in ``pairs`` whose values are all
        row-sparse, when the optimizer updates such a push lazily (MXNet's
        ``lazy_update``, :meth:`Optimizer.lazy_for`): the unique rows they name, which
        alone (weights, weight decay and state) the update moves. A key listed twice
        gets the union; one that also got a dense value is updated densely."""
        if self._optimizer is None or not self._optimizer.lazy_for(row_sparse_key=False):
            return {}
        found: dict = {}
        dense: set = set()
        for key, vals in pairs:
            info = self._keys.get(key)
            if info is None or info.sparse or not info.shape:
                continue
            if not all(rowsparse.is_sparse_value(v) for v in vals):
                dense.add(key)
                continue
            ids = rowsparse.named_rows(vals, info.shape[0], f"{what} of key {key!r}")
            found[key] = np.union1d(found[key], ids) if key in found else ids
        return {k: v for k, v in found.items() if k not in dense}

    def row_sparse_pull(self, key, out=None, priority: int = 0, row_ids=None):
        """Pull rows ``row_ids`` of row-sparse keys into ``out`` (MXNet's signature):
        ``row_ids`` are integers of any shape and order, duplicates allowed; one
        array (or list of ints) for every out, or a list with one per out. A
        :class:`~kvstore.RowSparse` out then holds the unique sorted rows and their
        values; a dense ``(R, ...)`` out gets those rows and zeros elsewhere. Includes
        this worker's earlier pushes. Returns ``out``."""
        what = "row_sparse_pull"
        self._check_open(what)
        check_priority(priority, what)
        if out is None or row_ids is None:
            raise InvalidArgumentError(f"{what}: out= and row_ids= are required")
        keyed = isinstance(key, (list, tuple))
        ids = list(row_ids) if keyed and isinstance(row_ids, (list, tuple)) else [row_ids]
        pairs = self._args.pairs(key, out, what, "output")
        if len(ids) != len(pairs):
            raise InvalidArgumentError(f"{what}: {len(pairs)} keys need {len(pairs)} row_ids, got {len(ids)}")
        requests = []
        for (k, outs), key_ids in zip(pairs, ids):
            info = self._args.info(k, what)
            if not info.sparse:
                raise InvalidArgumentError(f"{what}: key {k!r} is dense: read it with pull")
            per_out = rowkeys.per_output(key_ids, len(outs))
            requests.append((info, outs, *rowkeys.pull_requests(outs, per_out, info.shape, info.dtype,
                                                                f"{what} of key {k!r}")))
        for info, outs, union, wanted in requests:      # everything was checked first
            data = self._do_pull_rows(info, union)
            for target, rows in zip(outs, wanted):
                rowkeys.fill(target, rows, rowkeys.select(union, data, rows))
        return out

    def assign_rows(self, key, value) -> None:
        """Set some rows of a row-sparse key: ``value`` is a :class:`~kvstore.RowSparse`
        holding the row ids (unique) and their new values. Not in MXNet: it is how a
        table is loaded from a file (``ShardedEmbedding.load_state_dict``). Ordered
        after this worker's pushes; the optimizer's state of those rows is kept (as a
        module's ``load_state_dict`` leaves the optimizer alone). In a sync job, call it
        between steps, from one worker, then ``barrier()``: a server refuses it while a
        round of pushes is open on the table. Everything is checked before anything
        changes."""
        what = "assign_rows"
        self._check_open(what)
        info = self._args.info(key, what)
        if not info.sparse:
            raise InvalidArgumentError(f"{what}: key {key!r} is dense: set it with init, or push "
                                       "without an optimizer")
        if info.dynamic is not None:
            raise InvalidArgumentError(f"{what}: key {key!r} holds dynamic rows (kvstore.DynamicRows): "
                                       "pushes make its rows; they are not assigned")
        rows, data = rowkeys.assign_parts(value, info.shape, info.dtype, f"{what} of key {key!r}")
        self._do_assign_rows(info, rows, data)

    def row_stats(self, key) -> dict:
        """The counters of a key made with :class:`~kvstore.DynamicRows` (not in MXNet),
        after this worker's pushes: summed over the servers, ``rows`` (held now),
        ``created``, ``evicted`` (``evicted_by_age`` + ``evicted_by_budget``), ``hits`` and
        ``misses`` (ids pulled that had a row or not), ``hit_rate`` (hits / ids pulled,
        None before any pull), ``max_rows`` (the most rows one server holds: what the
        budget bounds), ``rounds`` and ``updates`` (the largest of any server), and
        ``servers``: each server's own counters (``rows``, ``capacity``, ...)."""
        what = "row_stats"
        self._check_open(what)
        info = self._args.info(key, what)
        if info.dynamic is None:
            raise InvalidArgumentError(f"{what}: key {key!r} has no dynamic rows: only keys initialised with "
                                       "kvstore.DynamicRows count rows")
        per = self._do_row_stats(info)
        total = {k: sum(int(p[k]) for p in per) for k in
                 ("rows", "capacity", "created", "evicted", "evicted_by_age", "evicted_by_budget", "hits", "misses")}
        looked = total["hits"] + total["misses"]
        return {**total, "hit_rate": total["hits"] / looked if looked else None,
                "max_rows": max(int(p["rows"]) for p in per), "rounds": max(int(p["rounds"]) for p in per),
                "updates": max(int(p["updates"]) for p in per), "servers": per}

    def pull(self, key, out=None, priority: int = 0, ignore_sparse: bool = True) -> None:
        """Fill ``out`` (an array, or every array of a list) with the stored value,
        including the effect of this worker's earlier pushes. A row-sparse key is
        read with :meth:`row_sparse_pull`; with ``ignore_sparse=False`` this call reads
        all of its rows (as MXNet does), otherwise it is an error naming
        row_sparse_pull (MXNet skips such keys silently)."""
        what = "pull"
        self._check_open(what)
        check_priority(priority, what)
        if out is None:
            raise InvalidArgumentError("pull: out= is required (the arrays to fill)")
        if not isinstance(ignore_sparse, bool):
            raise ArgumentTypeError(f"pull: ignore_sparse must be True or False, got {ignore_sparse!r}")
        found = self._plans.find(what, key, out)         # a repeated call of dense keys (kvstore.worker.plans)
        if found is not None:
            plan, outs, _ = found
            self._do_pull_finish(self._do_pull_start([(info, [outs[i] for i in at]) for info, at in plan.groups],
                                                     paced=True))
            return
        pairs = self._args.pairs(key, out, what, "output")
        whole = [] if ignore_sparse else [(k, outs) for k, outs in pairs if self._args.info(k, what).sparse]
        dense = self._args.grouped_pairs(
            [(k, outs) for k, outs in pairs if ignore_sparse or not self._args.info(k, what).sparse], what)
        for k, _ in whole:
            if self._args.info(k, what).dynamic is not None:
                raise InvalidArgumentError(f"{what}: key {k!r} holds dynamic rows (ids up to 2**63): read the "
                                           "ids you want with row_sparse_pull")
        if not whole:
            self._plans.record(what, key, out, None, dense)
        if whole:     # every row of each table: as big as the table, which the caller asked for
            self.row_sparse_pull([k for k, _ in whole], out=[outs for _, outs in whole], priority=priority,
                                 row_ids=[np.arange(self._args.info(k, what).shape[0]) for k, _ in whole])
        if dense:
            self._do_pull_finish(self._do_pull_start(dense, paced=True))

    def pushpull(self, key, value, out=None, priority: int = 0) -> None:
        """Push ``value`` then pull the result into ``out`` (into ``value`` when
        ``out`` is None), in one round trip."""
        items, rows, plan = self._pushpull_items(key, value, out, priority)
        self._do_pushpull_finish(self._do_pushpull_start(items, rows=rows, paced=True, plan=plan))

    def pushpull_async(self, key, value, out=None, priority: int = 0) -> "Handle":
        """pushpull() that returns once the request is on its way: ``out`` (``value``
        when None) is filled, at the latest, by the returned handle's ``wait()``, which
        also raises the call's errors. Until then ``value`` must stay unchanged and
        ``out`` unread. For overlapping the exchange with other work, as Horovod's
        ``allreduce_async_`` and ``synchronize``; stores that cannot overlap complete
        the call here. Handles may be waited for in any order.

        Example::

            h = kv.pushpull_async(3, grad, out=weight)
            ...                                  # compute something else
            h.wait()
        """
        items, rows, plan = self._pushpull_items(key, value, out, priority)
        handle = self._do_pushpull_start(items, rows=rows, plan=plan)
        return Handle(lambda: self._do_pushpull_finish(handle))

    def pushpull_open(self, key, value, out=None):
        """Phase 1 of a whole-model pushpull, held open (not in MXNet; dist_sync, under
        an optimizer with ``whole_model``: a torch twin with ``clip_grad_norm`` or
        ``grad_scale``): push ``value`` and return, once every chunk's round is
        complete on the servers, the open round, whose ``terms`` hold every key's
        chunks' phase-1 terms (a twin's ``[norm, overflowed]`` per chunk), the same on
        every worker. The servers step only at :meth:`pushpull_close`, with the sums
        the caller decides from them; until then ``out`` (``value`` when None) is not
        written. How ``kvstore.torch.Trainer`` lets a loop unscale and clip between
        backward and step (docs/training.md). Raises InvalidArgumentError for a store
        or optimizer without the two phases.

        Example::

            opened = kv.pushpull_open(keys, grads, out=weights)
            sums = twin.model_sums(opened.terms)     # twin: the optimizer set; or the loop's own verdict
            kv.pushpull_close(opened, sums)          # weights hold the new values
        """
        items, _, _ = self._pushpull_items(key, value, out, 0)
        return self._do_pushpull_open(items)

    def pushpull_close(self, opened, sums) -> None:
        """Phase 2 of :meth:`pushpull_open`'s round: the servers step every key with
        ``sums`` (the same list for every chunk: a twin's ``[clip_coef, overflowed]``;
        ``overflowed`` skips the step, leaving every key and its step count as it was)
        and the outputs are filled. Every worker calls it with the same sums (worker 0's
        are applied); ``last_model_sums`` becomes them. Raises InvalidArgumentError
        for a round closed already."""
        self._check_open("pushpull_close")
        self._do_pushpull_close(opened, list(sums))
        self.last_model_sums = list(sums)

    def pull_async(self, key, out=None, priority: int = 0) -> "Handle":
        """pull() that may return before the values arrived: ``out`` is filled, at the
        latest, by the returned handle's ``wait()`` (which raises the call's errors)."""
        what = "pull"
        self._check_open(what)
        check_priority(priority, what)
        if out is None:
            raise InvalidArgumentError("pull: out= is required (the arrays to fill)")
        handle = self._do_pull_start(self._args.grouped(key, out, what))
        return Handle(lambda: self._do_pull_finish(handle))

    def _pushpull_items(self, key, value, out, priority: int) -> tuple[list[tuple], dict | None, CallPlan | None]:
        """``([(info, merged, targets)], rows, plan)``: what the pushpull hooks take (rows:
        :meth:`_lazy_rows`, or None; plan: the call's :class:`CallPlan`, or None). A call
        that a plan takes (the same keys, and values and outputs of the same kind, as an
        earlier call that passed every check) skips the checks it passed."""
        what = "pushpull"
        self._check_open(what)
        check_priority(priority, what)
        found = self._plans.find(what, key, value, out)
        if found is not None:
            taken, values, outs = found
            targets = values if outs is None else outs
            return [(info, self._merged(info, [values[i] for i in at], what), [targets[i] for i in at])
                    for info, at in taken.groups], None, taken
        pairs = self._args.pairs(key, value, what)
        named = self._lazy_rows(pairs, what)
        pushes = self._args.grouped_pairs(self._args.densify(pairs, what, written_back=out is None), what)
        self._check_optimizable(pushes, what)
        outs = pushes if out is None else self._args.grouped(key, out, what)
        merged = {info.key: self._merged(info, vals, what) for info, vals in pushes}
        plan = None if named else self._plans.record(what, key, value, out, pushes)
        return [(info, merged[info.key], targets) for info, targets in outs], named or None, plan

    def broadcast(self, key, value, out, priority: int = 0) -> None:
        """Initialise keys with rank 0's ``value`` and pull it into ``out`` on every worker."""
        self.init(key, value)
        self.pull(key, out=out, priority=priority)

    def set_gradient_compression(self, compression_params: dict) -> None:
        """Compress pushed gradients: ``{'type': '2bit', 'threshold': 0.5}``, ``'1bit'``
        or ``'fp16'`` (``'none'`` turns it off). The quantisation error is kept and
        added to the next push of the same key (error feedback). In dist mode only
        worker -> server traffic is compressed; in 'local' each value of a pushed
        list is compressed on its own, as MXNet does between devices.
        Raises ConfigError for an unknown type or a bad threshold; a push raises
        InvalidArgumentError if the threshold does not fit the gradient's dtype
        (float16: at most 65504)."""
        self._check_open("set_gradient_compression")
        compressor = Compressor(compression_params)
        self._plans.clear()
        self._compressor = compressor if compressor.active else None

    def set_multi_precision(self, enabled: bool = True) -> None:
        """Let float32 keys take float16 and bfloat16 values (AMP gradients) and
        outputs, as MXNet's ``multi_precision``: a pushed float16/bfloat16 gradient goes
        to the servers as it is, in half the bytes (bfloat16 as its raw 2-byte
        patterns), and they widen it exactly and sum, store and update in float32
        (kvstore.precision); a float16/bfloat16 output gets the float32 value rounded
        once (to nearest even), a float32 output the float32 value itself. Several
        values for one key in one call are summed in float32 here and sent in float32.
        Off (the default) a value whose dtype is not its key's is refused before
        anything is sent. Each worker sets it for its own pushes (no collective step).
        Raises InvalidArgumentError on a store type that cannot carry it (see
        :meth:`_multi_precision_refusal`); ArgumentTypeError for a non-bool."""
        what = "set_multi_precision"
        self._check_open(what)
        if not isinstance(enabled, bool):
            raise ArgumentTypeError(f"{what}: enabled must be True or False, got {enabled!r}")
        refusal = self._multi_precision_refusal() if enabled else None
        if refusal is not None:
            raise InvalidArgumentError(f"{what}: {refusal}")
        self._plans.clear()       # (plans were made under the checks of the old setting)
        self._args.low_precision = enabled

    def _multi_precision_refusal(self) -> str | None:
        """Why this store cannot carry float16/bfloat16 values for float32 keys, or None."""
        return f"{self._type!r} stores keep values in their keys' dtypes only (use a dist store)"

    def set_optimizer(self, optimizer, *, keep_state: bool = False) -> None:
        """Apply ``optimizer`` to every push (on the servers in dist mode). In dist
        mode every worker calls it; rank 0's optimizer is used. ``keep_state`` (ours):
        ``optimizer`` differs from the one set in hyper-parameters only (the same kind,
        the same state arrays), and every key keeps its state and update count, as
        with :meth:`set_learning_rate` (kvstore.torch.Trainer sends a torch scheduler's
        changes so); raises InvalidArgumentError without an optimizer set, or for
        another kind, changing nothing."""
        self._check_open("set_optimizer")
        if not isinstance(optimizer, _optimizer.Optimizer):
            raise ArgumentTypeError("set_optimizer: expected a kvstore.optimizer.Optimizer "
                                    f"(e.g. kvstore.optimizer.SGD(...)), got {type(optimizer).__name__}")
        optimizer = _optimizer.from_config(optimizer.to_config())  # validated, and our own copy
        if keep_state and (self._optimizer is None or type(optimizer) is not type(self._optimizer)
                           or optimizer.num_states != self._optimizer.num_states):
            raise InvalidArgumentError(f"set_optimizer(keep_state=True): {optimizer!r} cannot keep the state of "
                                       f"{self._optimizer!r}: only hyper-parameters may change")
        self._check_whole_keys(optimizer, list(self._keys.values()), "set_optimizer")
        self._check_lazy_rows(optimizer, list(self._keys.values()), "set_optimizer")
        self._plans.clear()
        self._do_set_optimizer(optimizer, keep_state=keep_state)
        self._optimizer = optimizer

    def _check_optimizable(self, groups, what: str) -> None:
        if self._optimizer is None:
            return
        for info, _ in groups:
            if info.dtype.kind != "f":
                raise InvalidArgumentError(f"{what}: key {info.key!r} holds {info.dtype.name}; "
                                           "optimizers update floating-point values only")

    def _merged(self, info: KeyInfo, vals: list, what: str) -> np.ndarray:
        """The sum of ``vals`` as a flat C-contiguous numpy array (a view if only one);
        with multi-precision a single float16 value stays float16 and a single bfloat16
        value becomes its uint16 patterns (kvstore.precision), several are summed in
        the key's dtype."""
        if len(vals) == 1 and self._args.low_precision and arrays.dtype_name(vals[0]) == arrays.BFLOAT16:
            return arrays.bfloat16_bits(vals[0])     # (kvstore.precision: on the wire as it is)
        first = arrays.to_numpy(vals[0], what)
        if len(vals) == 1:
            return np.ascontiguousarray(first).reshape(-1)
        acc = np.array(first, dtype=info.dtype, order="C", copy=True).reshape(-1)
        for v in vals[1:]:
            acc += arrays.to_numpy(v, what).reshape(-1)
        return acc

    def _check_whole_keys(self, optimizer, infos: list, what: str) -> None:
        """Refuse keys that ``optimizer`` would see only part of, where it needs a key's
        every value at once (LARS, LAMB: norms over the layer; kvstore.optimizer.layerwise):
        row-sparse keys (updated row by row), and keys cut into chunks over servers
        unless this store adds up their norms across servers (:meth:`_norms_across_servers`)."""
        if optimizer is not None and optimizer.whole_model and not self._norms_across_servers(optimizer):
            raise InvalidArgumentError(
                f"{what}: {type(optimizer).__name__} with clip_grad_norm or grad_scale steps on the whole model's "
                f"gradient, which the servers' two phases give ({self._why_no_norms_across_servers(optimizer)}); "
                "let the workers update (a torch optimizer, update_on_kvstore=False) to clip or scale here")
        if optimizer is None or not optimizer.needs_whole_keys():
            return
        name = type(optimizer).__name__
        for info in infos:
            if info.sparse:
                raise InvalidArgumentError(
                    f"{what}: {name} scales each key's step by norms over the whole key, but row-sparse "
                    f"key {info.key!r} is updated row by row; use another optimizer in this store")
            if len(info.chunks) > 1 and not self._norms_across_servers(optimizer):
                nbytes = info.size * np.dtype(info.dtype).itemsize
                raise InvalidArgumentError(
                    f"{what}: {name} needs each key whole on one server, but key {info.key!r} ({nbytes} bytes) "
                    f"is cut into {len(info.chunks)} chunks over the servers: set KVSTORE_CHUNK_BYTES above "
                    f"the largest key's size ({self._why_no_norms_across_servers(optimizer)})")

    @staticmethod
    def _check_lazy_rows(optimizer, infos: list, what: str) -> None:
        """Refuse dynamic keys (kvstore.rows.dynamic) under an optimizer that updates every
        row of a row-sparse key (``lazy_update=False``): their rows exist once pushed."""
        if optimizer is None or optimizer.lazy_for(row_sparse_key=True):
            return
        for info in infos:
            if info.dynamic is not None:
                raise InvalidArgumentError(
                    f"{what}: {type(optimizer).__name__}(lazy_update=False) updates every row of a row-sparse "
                    f"key, but key {info.key!r} holds dynamic rows, which exist only once pushed: use "
                    "lazy_update=True (the default) for it")

    def _norms_across_servers(self, optimizer) -> bool:
        """Whether this store runs ``optimizer``'s two-phase update for keys cut into
        chunks over servers (dist_sync: kvstore.worker.dist)."""
        return False

    def _why_no_norms_across_servers(self, optimizer) -> str:
        return "this store type does not add up norms across servers"

    def set_learning_rate(self, learning_rate: float, *, state_scale: float = 1.0) -> None:
        """Change the learning rate of the optimizer set by :meth:`set_optimizer`,
        keeping its state (momentum, Adam moments, update counts), as Gluon's
        ``Trainer.set_learning_rate``. In dist mode every worker calls it (rank 0's
        value is used) and the servers change it between rounds. ``state_scale``
        (ours) also multiplies every optimizer state array: kvstore.torch.Trainer
        mirrors torch's SGD, whose momentum buffer excludes the learning rate while
        MXNet's includes it, so it scales by new/old rate. Raises
        InvalidArgumentError without an optimizer, ConfigError for a bad value and
        while the optimizer has an ``lr_scheduler``, which sets the rate (MXNet's
        ``set_learning_rate`` raises then too, a ``UserWarning``), changing nothing."""
        what = "set_learning_rate"
        self._check_open(what)
        if self._optimizer is None:
            raise InvalidArgumentError(f"{what}: no optimizer is set")
        optimizer = self._optimizer.with_learning_rate(learning_rate)   # refuses a scheduled one, as MXNet
        self._plans.clear()
        self._do_set_optimizer(optimizer, keep_state=True, state_scale=float(state_scale))
        self._optimizer = optimizer

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        """Write the optimizer state of every key (momentum, Adam moments, update
        counts) to ``fname`` atomically; with ``dump_optimizer`` also the optimizer."""
        self._check_open("save_optimizer_states")
        if self._optimizer is None:
            raise InvalidArgumentError("save_optimizer_states: no optimizer is set")
        self._refuse_dynamic("save_optimizer_states", self._keys.values())
        config = self._optimizer.to_config() if dump_optimizer else None
        states_file.dump(fname, config, self._get_states())

    def load_optimizer_states(self, fname: str) -> None:
        """Restore states written by :meth:`save_optimizer_states` (by any store
        type). An optimizer saved in the file replaces the current one."""
        what = "load_optimizer_states"
        self._check_open(what)
        config, states = states_file.load(fname)
        optimizer = _optimizer.from_config(config) if config is not None else self._optimizer
        if optimizer is None:
            raise InvalidArgumentError(f"{what}: call set_optimizer() first (the file holds no optimizer)")
        self._refuse_dynamic(what, self._keys.values())
        for key, entry in states.items():   # validate everything before changing anything
            info = self._args.info(self._args.check_key(key, what), what)
            count, dtype = optimizer.state_spec(info.dtype)   # multi_precision: + a float32 master
            if len(entry["state"]) != count:
                raise InvalidArgumentError(f"{what}: key {key!r} has {len(entry['state'])} state arrays; "
                                           f"{optimizer.to_config()['name']} keeps {count} for "
                                           f"{info.dtype.name} values")
            for s in entry["state"]:
                if s.shape != info.shape or s.dtype != dtype:
                    raise InvalidArgumentError(f"{what}: state of key {key!r} is {s.shape} {s.dtype.name}; "
                                               f"it must be {info.shape} {dtype.name}")
        if config is not None:
            self._set_optimizer_only(optimizer)
        self._set_states(states)

    @staticmethod
    def _refuse_dynamic(what: str, infos) -> None:
        """The optimizer-state file holds whole keys; a dynamic key's state is per row,
        kept (with its rows) by the servers' checkpoints."""
        for info in infos:
            if info.dynamic is not None:
                raise InvalidArgumentError(
                    f"{what}: key {info.key!r} holds dynamic rows, whose optimizer state lives with each row "
                    "and is saved by the servers' checkpoints (KVSTORE_CHECKPOINT_DIR), not in this file")

    def barrier(self) -> None:
        """Wait until every worker called barrier() (after this worker's pushes landed)."""

    def allgather_bytes(self, data: bytes, timeout: float | None = None) -> list[bytes]:
        """Every worker's ``data`` (bytes of any length, which may differ between
        workers), in the order of ``kv.members`` (rank order). Collective: every worker
        calls it, in the same order as its other collective calls. In the dist stores
        it travels through the job's scheduler, over its authenticated control channel
        (KVSTORE_SECRET), in rounds of at most 768 KiB in all; waiting at most
        ``timeout`` seconds per round (default: KVSTORE_TIMEOUT). A store of one
        process returns ``[data]``. For a few bytes per step (metrics, decisions), not
        for tensors: push and pull those.

        Raises ArgumentTypeError for ``data`` that is not bytes-like, and as
        :meth:`barrier` does (DeadlineError naming the workers that did not come).

        Example::

            parts = kv.allgather_bytes(str(loss).encode())
            losses = [float(p) for p in parts]        # one per worker, kv.members order
        """
        self._check_open("allgather_bytes")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ArgumentTypeError(f"allgather_bytes: data must be bytes, got {type(data).__name__}")
        if timeout is not None and not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
                                        and timeout > 0):
            raise InvalidArgumentError(f"allgather_bytes: timeout must be a number of seconds > 0, "
                                       f"got {timeout!r}")
        return self._do_allgather(bytes(data), timeout)

    def _send_command_to_servers(self, head: str, body: str = "") -> list:
        """MXNet's call; a store without servers has nothing to run it (as MXNet's
        local store, which ignores it): returns [], one result per server."""
        self._check_open("_send_command_to_servers")
        return []

    def _barrier(self) -> None:
        """MXNet's name of :meth:`barrier` (its scripts and tests call ``kv._barrier()``)."""
        self.barrier()

    def comm_stats(self) -> dict:
        """Bytes this worker sent to and received from the servers so far, headers
        included, by transport (see DistStore.comm_stats); zeros for 'local'."""
        return {"bytes_sent": 0, "bytes_received": 0, "by_transport": {}}

    def close(self) -> None:
        """Release the store; in dist mode tell the job this worker is done."""
        self._plans.clear()
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise InvalidArgumentError(f"{what}: the store is closed")

    # -- hooks for subclasses ------------------------------------------------------------
    def _do_init(self, items: list[tuple]) -> None: raise NotImplementedError
    # rows: {key: unique row ids} of dense keys pushed row-sparse values whose update is
    # lazy (MXNet's lazy_update: only those rows and their state move), or None
    def _do_push(self, items: list[tuple], wait_sent: bool = True, rows: dict | None = None) -> None:
        raise NotImplementedError
    # row-sparse keys: (key, shape, dtype, RowInit|None, rows, data); (info, rows, data);
    # pull returns the (len(rows), ...) values of unique sorted rows
    def _do_init_rows(self, items: list[tuple]) -> None: raise NotImplementedError
    def _do_push_rows(self, items: list[tuple]) -> None: raise NotImplementedError
    def _do_pull_rows(self, info: KeyInfo, rows: np.ndarray) -> np.ndarray: raise NotImplementedError
    def _do_assign_rows(self, info: KeyInfo, rows: np.ndarray, data: np.ndarray) -> None: raise NotImplementedError
    # dynamic rows (kvstore.rows.dynamic): each server's counters (DynTable.stats), in server order
    def _do_row_stats(self, info: KeyInfo) -> list[dict]: raise NotImplementedError

    # A pull or pushpull is a start, which returns a handle, and a finish, which takes
    # it: pull/pushpull call both at once (``paced``: the caller waits for the call
    # anyway, so its start may wait for replies to keep a window of messages in
    # flight, kvstore/transport/pace.py), pull_async/pushpull_async the finish at the
    # handle's wait(). A store whose calls cannot run in the background completes
    # them in the start and keeps the default finish.
    def _do_pull_start(self, items: list[tuple], paced: bool = False):
        raise NotImplementedError

    def _do_pull_finish(self, handle) -> None:
        pass

    # plan: the call's CallPlan (kvstore.worker.plans; None: none), whose routes a store
    # may use instead of grouping the call's chunks by server again
    def _do_pushpull_start(self, items: list[tuple], rows: dict | None = None, paced: bool = False,
                           plan: CallPlan | None = None):
        raise NotImplementedError

    def _do_pushpull_finish(self, handle) -> None:
        pass

    # a whole-model pushpull held open between its phases (dist_sync: kvstore.worker.dist)
    def _do_pushpull_open(self, items: list[tuple]):
        raise InvalidArgumentError(f"pushpull_open: {self._type} has no servers to hold a round open between two "
                                   "phases; dist_sync does")

    def _do_pushpull_close(self, opened, sums: list) -> None:
        raise InvalidArgumentError(f"pushpull_close: {self._type} holds no open round")
    # keep_state: the optimizer differs from the current one in hyper-parameters only
    # (set_learning_rate): keep the per-key state and update counts
    def _do_set_optimizer(self, optimizer, collective: bool = True, keep_state: bool = False,
                          state_scale: float = 1.0) -> None: raise NotImplementedError
    def _get_states(self) -> dict: raise NotImplementedError
    def _set_states(self, states: dict) -> None: raise NotImplementedError

    def _do_allgather(self, data: bytes, timeout: float | None) -> list[bytes]:
        return [data]     # the one worker of a store without servers

    def _set_optimizer_only(self, optimizer) -> None:
        self._plans.clear()
        self._do_set_optimizer(optimizer, collective=False)
        self._optimizer = optimizer


class Handle:
    """An exchange in flight (:meth:`KVStore.pushpull_async`, :meth:`KVStore.pull_async`).
    ``wait()`` completes it (the outputs are filled, errors raised); later calls do
    nothing. ``done`` says whether ``wait()`` has completed."""

    def __init__(self, finish):
        self._finish = finish
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        finish, self._finish = self._finish, None
        self.done = True
        finish()


def fill_outputs(targets: list, flat: np.ndarray, direct: bool, what: str) -> None:
    """After ``flat`` was filled: copy it into the first target unless it is that
    target's memory, then into every other target."""
    if not direct:
        arrays.write(targets[0], flat)
    for t in targets[1:]:
        arrays.write(t, flat)


def fill_bfloat16(targets: list, bits: np.ndarray, direct: bool) -> None:
    """:func:`fill_outputs` for bfloat16 outputs whose reply came as bfloat16
    patterns (``bits``; kvstore.server.reply_precision)."""
    for t in targets[1:] if direct else targets:
        arrays.write_bfloat16_bits(t, bits)
