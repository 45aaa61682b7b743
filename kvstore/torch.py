"""PyTorch integration for custom training loops: :class:`Trainer`.

Like MXNet Gluon's ``Trainer(params, optimizer, kvstore, update_on_kvstore)``:

- ``update_on_kvstore=True``: the servers run the optimizer. Workers push
  gradients and pull the updated weights. Pass a :mod:`kvstore.optimizer`
  optimizer, or a ``torch.optim`` SGD, Adam, AdamW, RMSprop, Adagrad or Adadelta
  (run on the servers by its twin, torch's own step: bit for bit, every param group
  and every change a torch scheduler makes to them followed).
- ``update_on_kvstore=False``: the servers only sum. Workers pull the summed
  gradient into ``.grad`` and run their own torch optimizer.

Gradients are averaged over workers (as DDP does), so W workers on batches of b
train like one process on batches of W*b. Each gradient is exchanged as soon as
backward produced it (a post-accumulate-grad hook starts a pushpull per bucket;
small gradients are grouped into buckets sized by the model), so both directions
of the exchange overlap the rest of backward, and the exchange is finished when
``backward()`` returns, as DDP's: with the workers updating, ``.grad`` then holds
the average, so clipping or unscaling between ``backward()`` and ``step()`` acts on
it as under DDP. ``with trainer.no_sync():`` accumulates gradients without
exchanging them. The initial parameters are rank 0's. With ``kvstore.create("local")``
the same loop runs in one process.

Example::

    kv = kvstore.create("dist_sync")
    trainer = kvstore.torch.Trainer(model.parameters(), kv,
                                    torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for x, y in batches:
        trainer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        trainer.step()
"""

from __future__ import annotations

import contextlib
import os
import queue
import tempfile
import threading
from collections.abc import Callable, Iterator

import torch
from torch.autograd import Variable

from .devices import gpu
from . import optimizer as kvopt
from .worker import states_file
from .worker.exchange import OpenRound
from .worker.store import KVStore
from .errors import ArgumentTypeError, ConfigError, InvalidArgumentError
from .fileio import atomic_write
from .flat_buckets import Bucket, FlatBuckets
from .embedding import ShardedEmbedding  # noqa: F401  (re-exported: kvstore.torch.ShardedEmbedding)

__all__ = ["Trainer", "ShardedEmbedding", "shard", "optimizer_from_torch", "bucket_bytes_for",
           "DEFAULT_BUCKET_BYTES", "MIN_BUCKET_BYTES", "BUCKETS_PER_MODEL"]


def __dir__() -> list[str]:     # dir(kvstore.torch): the public names, not our imports
    return sorted(__all__)

DEFAULT_BUCKET_BYTES = 4 << 20     # the largest bucket a model gets by default
MIN_BUCKET_BYTES = 256 << 10       # the smallest, unless that would leave the model one bucket
BUCKETS_PER_MODEL = 4              # between the two: the model in this many buckets


def bucket_bytes_for(model_bytes: int, last_bytes: int = 0) -> int:
    """The Trainer's default ``bucket_bytes`` for ``model_bytes`` of trained
    parameters: a ``BUCKETS_PER_MODEL``-th of the model, at least ``MIN_BUCKET_BYTES``
    and at most ``DEFAULT_BUCKET_BYTES`` (4 MiB); a model under twice the floor is cut
    in half (two buckets); and with ``last_bytes``, the bytes of the parameter whose
    gradient backward produces last (the model's first; the Trainer passes it), at
    most the rest of the model, so that a bucket fills before that gradient arrives.
    Every model of two or more trained parameters thus has a bucket in flight while
    backward still runs (when backward produces their gradients in reverse order, as
    it usually does, and they share one dtype and device). A fixed 4 MiB made every model under 4 MiB one bucket, sent
    when backward ended: no overlap at all. The floor keeps the requests few where
    they cost more than they hide: each bucket is a request to every server it
    spans, and where every core is busy each costs CPU that nothing idle hides
    (ResNet-20, W=2, S=2 on 2 cores: about 3 ms of the servers' CPU per step per
    bucket; docs/performance.md, 2.4).

    Example::

        bucket_bytes_for(100 << 20)        # ResNet-50: 4 MiB, 25 buckets
        bucket_bytes_for(1 << 20)          # 256 KiB: 4 buckets
        bucket_bytes_for(1000)             # 500: 2 buckets
    """
    model_bytes, last_bytes = int(model_bytes), int(last_bytes)
    size = min(DEFAULT_BUCKET_BYTES, max(-(-model_bytes // BUCKETS_PER_MODEL),
                                         min(MIN_BUCKET_BYTES, -(-model_bytes // 2))))
    if 0 < last_bytes < model_bytes:
        size = min(size, model_bytes - last_bytes)
    return max(1, size)


# torch.optim's optimizers with a twin on the servers (kvstore.optimizer.torch_twin), by
# exact type: a subclass may change the step
_TWINS: dict[type, type[kvopt.TorchTwin]] = {
    torch.optim.SGD: kvopt.TorchSGD, torch.optim.Adam: kvopt.TorchAdam, torch.optim.AdamW: kvopt.TorchAdamW,
    torch.optim.RMSprop: kvopt.TorchRMSprop, torch.optim.Adagrad: kvopt.TorchAdagrad,
    torch.optim.Adadelta: kvopt.TorchAdadelta}

# torch's options that choose an implementation, not the math, and the values the
# twins honour: they run the single-tensor step, which foreach=True computes too (on
# CPU tensors the default); the fused, capturable and differentiable steps compute
# otherwise (torch's fused Adam its own way), so the twins refuse them.
_IMPLEMENTATION = {"foreach": (None, False, True), "fused": (None, False), "capturable": (False,),
                   "differentiable": (False,)}


def optimizer_from_torch(opt: torch.optim.Optimizer, keys=None) -> kvopt.TorchTwin:
    """The servers' twin of torch optimizer ``opt``: ``torch.optim.SGD``, ``Adam``,
    ``AdamW``, ``RMSprop``, ``Adagrad`` or ``Adadelta`` (exactly those classes), whose
    update the servers compute with torch's own single-tensor step, bit for bit
    (kvstore.optimizer.torch_twin), every param group with its hyper-parameters.

    ``keys``: the (parameter, store key) pairs; each key gets its parameter's group
    (needed for several groups), and bfloat16 parameters' keys are stepped in
    bfloat16 (the stores keep them in float32). Raises ArgumentTypeError for another optimizer and
    InvalidArgumentError, naming the group and the option, for what a twin cannot
    honour: ``fused``, ``capturable`` or ``differentiable`` steps, a hyper-parameter
    the twin does not know, a tensor hyper-parameter that requires grad, a parameter
    of ``keys`` in no group (torch would not update it). Group entries that are no
    hyper-parameter of the optimizer (``initial_lr``, ``max_momentum``: a scheduler's
    bookkeeping, which torch's step never reads) are left out.

    Example::

        opt = torch.optim.AdamW([{"params": weights}, {"params": biases, "weight_decay": 0.0}], lr=1e-3)
        twin = kvstore.torch.optimizer_from_torch(opt, zip(params, keys))   # a torch_adamw
    """
    twin = _twin_class(opt)
    top = {n: _plain(opt, "its constructor", n, v) for n, v in opt.defaults.items() if n in twin.fields}
    groups = torch_groups(opt, twin)
    key_groups: dict = {}
    bfloat16_keys = []
    if keys is not None:
        group_of = {id(p): i for i, g in enumerate(opt.param_groups) for p in g["params"]}
        for p, key in keys:
            if p.dtype == torch.bfloat16:       # kept in float32 by the stores, stepped in bfloat16
                bfloat16_keys.append(key)
            if id(p) not in group_of:
                raise InvalidArgumentError(
                    f"update_on_kvstore=True: parameter {key!r} is in no param group of the torch "
                    f"{type(opt).__name__}, which would not update it; the servers update every key: pass "
                    "the optimizer's parameters only (or freeze it: requires_grad=False)")
            if group_of[id(p)]:
                key_groups[key] = group_of[id(p)]
    elif len(groups) > 1:
        raise InvalidArgumentError("optimizer_from_torch: several param groups need keys, the (parameter, "
                                   "store key) pairs, to give each key its group")
    try:
        return twin(**top, groups=groups, key_groups=key_groups, bfloat16_keys=bfloat16_keys)
    except ConfigError as e:
        raise InvalidArgumentError(f"update_on_kvstore=True: torch {type(opt).__name__}: {e}") from None


def _twin_class(opt) -> type[kvopt.TorchTwin]:
    twin = _TWINS.get(type(opt))
    if twin is None:
        names = ", ".join(f"torch.optim.{c.__name__}" for c in _TWINS)
        raise ArgumentTypeError(
            f"update_on_kvstore=True runs the optimizer on the servers, which have twins of {names} only (exactly "
            f"those classes), not {type(opt).__module__}.{type(opt).__name__}: pass a kvstore.optimizer optimizer "
            "or use update_on_kvstore=False")
    if twin is kvopt.TorchAdam and opt.defaults.get("decoupled_weight_decay"):
        return kvopt.TorchAdamW     # Adam(decoupled_weight_decay=True) is AdamW's step
    return twin


def torch_groups(opt: torch.optim.Optimizer, twin: type[kvopt.TorchTwin]) -> list[dict]:
    """The hyper-parameters of every param group of ``opt`` as ``twin`` takes them
    (plain floats, bools and lists), read now: what a scheduler wrote is included.
    Raises InvalidArgumentError naming the group and option the twin cannot honour."""
    out = []
    for i, g in enumerate(opt.param_groups):
        where = f"param group {i}"
        for name in opt.defaults:
            if name in twin.fields:
                continue
            value = g.get(name, opt.defaults[name])
            if name == "decoupled_weight_decay":
                if bool(value) != (twin is kvopt.TorchAdamW):
                    raise InvalidArgumentError(
                        f"update_on_kvstore=True: torch {type(opt).__name__} {where} has decoupled_weight_decay="
                        f"{value!r}, its other groups not: the servers' twin is Adam or AdamW for all groups")
            elif name in _IMPLEMENTATION:
                if value not in _IMPLEMENTATION[name]:
                    raise InvalidArgumentError(
                        f"update_on_kvstore=True: torch {type(opt).__name__} {where} has {name}={value!r}, which "
                        f"the servers' twin cannot honour: it runs torch's single-tensor step (foreach=False), "
                        f"bit for bit; use {name}={_IMPLEMENTATION[name][0]!r}, or update_on_kvstore=False")
            else:
                raise InvalidArgumentError(
                    f"update_on_kvstore=True: torch {type(opt).__name__} {where} has hyper-parameter {name!r} "
                    f"(= {value!r}), which the servers' twin ({twin.name}) does not know, so it cannot honour it; "
                    "use update_on_kvstore=False")
        out.append({n: _plain(opt, where, n, g[n]) for n in twin.fields if n in g})
    return out


def _plain(opt, where: str, name: str, value):
    """A hyper-parameter as a twin takes it: a tensor read as its number (as torch's
    step reads it), a tuple as a list. Raises InvalidArgumentError for a tensor that
    requires grad (torch's differentiable step) or has several elements."""
    if isinstance(value, (tuple, list)):
        return [_plain(opt, where, f"{name}[{i}]", v) for i, v in enumerate(value)]
    if isinstance(value, torch.Tensor):
        if value.requires_grad or value.numel() != 1:
            raise InvalidArgumentError(
                f"update_on_kvstore=True: torch {type(opt).__name__} {where} has {name} = a tensor of "
                f"{value.numel()} element(s){' that requires grad' if value.requires_grad else ''}; the servers' "
                "twin takes numbers (a one-element tensor is read as its value, as torch's step does)")
        return value.item()
    return value


class Trainer:
    """Synchronises a model's gradients and weights through a KVStore.

    ``params``: ``model.parameters()`` (keys 0..n-1, or ``"param.0"``.. when the
    store already holds str keys, e.g. a :class:`ShardedEmbedding`'s table) or
    ``model.named_parameters()`` (keys are the names). ``optimizer``: a kvstore optimizer (servers update) or a
    torch optimizer over the same parameters. ``bucket_bytes``: gradients smaller
    than this are grouped into one push of about this size (default: sized by the
    model, :func:`bucket_bytes_for`; :attr:`bucket_bytes` says which). ``overlap``:
    buckets are sent during backward (True) or all in one pushpull when backward ends
    (False: one round trip, no overlap). ``flat_buckets``: the
    parameters that train become views of flat buffers of about ``bucket_bytes``,
    each exchanged as one key (DDP's ``gradient_as_bucket_view``;
    :mod:`kvstore.flat_buckets`): a few keys instead of one per parameter, which
    the per-key cost of an exchange makes faster for models of many small
    parameters; not with layer-wise server optimizers (LARS, LAMB) or sparse
    gradients, and the set of trained parameters is fixed when the Trainer is made.

    DDP's habits hold (docs/training.md, "DDP's habits"): when ``backward()``
    returns, the exchange is finished; with the workers updating ``.grad`` holds the
    average, so ``clip_grad_norm_``, ``scaler.unscale_(trainer)`` and
    ``scaler.step(trainer)`` (or the torch optimizer's own) act on it as under DDP;
    ``with trainer.no_sync():`` accumulates without exchanging. With the servers
    updating, an edit of ``.grad`` before ``step()`` is refused (the servers hold
    the gradients as pushed), as is a second backward without ``no_sync()``; DDP's
    ``scaler.unscale_(trainer)``, :meth:`clip_grad_norm_` (FSDP's method) and
    ``scaler.step(trainer)`` work there with a Trainer made with ``grad_scaler=``
    (below).

    Mixed precision and clipping in both modes: ``clip_grad_norm`` (``max_norm``
    of ``torch.nn.utils.clip_grad_norm_`` over the averaged gradients of every
    trained parameter) and ``grad_scaler`` (a ``torch.amp.GradScaler``, whose
    ``scale(loss).backward()`` the loop calls, then ``step()``, then
    ``scaler.update()``). Workers updating, ``step()`` runs ``scaler.unscale_``,
    ``clip_grad_norm_`` and ``scaler.step`` on the torch optimizer (DDP's loop).
    Servers updating (a torch optimizer's twin; dist_sync), the whole model's
    gradient goes in one pushpull when backward ends and the servers, in two
    phases, unscale it, clip it by its norm over every server and step, or skip
    the step everywhere when any gradient overflowed: phase 1 (each chunk's
    unscaled norm, any inf or nan) when backward ends, phase 2 at ``step()``
    (:meth:`KVStore.pushpull_open <kvstore.worker.store.KVStore.pushpull_open>`),
    so that DDP's loop runs too: ``scaler.unscale_(trainer)`` (the
    :attr:`param_groups` stand-in gives every worker's scaler phase 1's verdict),
    ``trainer.clip_grad_norm_(max_norm)`` (the total norm from phase 1, the clip
    applied by the servers), ``scaler.step(trainer)`` (an overflowed round is
    skipped when backward ends, every worker alike), ``scaler.update()``. With
    ``trainer.step()`` instead, the Trainer tells the scaler. Either way the same
    bits as the workers updating and as DDP (docs/training.md). No overlap with
    backward then.

    Every parameter starts from rank 0's value. Frozen ones (``requires_grad=False``
    at ``step()``) are neither exchanged nor updated; one that got no gradient in a
    step is exchanged as zeros (the other workers may have one), as DDP does with
    ``find_unused_parameters``.

    Per-parameter hyper-parameters on the servers (update_on_kvstore=True): a torch
    optimizer's param groups become each key's group on the servers, with every
    hyper-parameter (:func:`optimizer_from_torch`); :meth:`state_dict` gives the
    servers' state in torch's format. A kvstore optimizer takes MXNet's ``lr_mult`` /
    ``wd_mult`` by key, which ``model.named_parameters()`` makes the parameters'
    names. The usual recipe, no weight decay on biases and norms::

        no_decay = {n: 0.0 for n, p in model.named_parameters() if p.ndim == 1}
        Trainer(model.named_parameters(), kv, kvstore.optimizer.SGD(learning_rate=0.1, wd=1e-4,
                                                                    wd_mult=no_decay))

    With flat buckets, parameters sharing a bucket must share their multipliers (or
    torch param group). A sparse gradient (``nn.Embedding(sparse=True)``) updates only
    its rows with a kvstore SGD, Adam or LARS (MXNet's ``lazy_update``), every row
    with a torch optimizer's twin (as torch's own SGD step does).
    """

    def __init__(self, params, kv: KVStore, optimizer, *, update_on_kvstore: bool | None = None,
                 bucket_bytes: int | None = None, overlap: bool = True, flat_buckets: bool = False,
                 clip_grad_norm: float | None = None, grad_scaler=None):
        if not isinstance(kv, KVStore):
            raise ArgumentTypeError(f"kv must be a kvstore store, got {type(kv).__name__}")
        named = list(params)
        if named and isinstance(named[0], tuple):
            self._keys, self._params = [n for n, _ in named], [p for _, p in named]
        else:   # one kind of key per store: beside str keys (a sharded table) these are str too
            self._keys = [f"param.{i}" for i in range(len(named))] if kv.key_type is str \
                else list(range(len(named)))
            self._params = named
        self._params = [p for p in self._params]
        if not all(isinstance(p, torch.Tensor) for p in self._params):
            raise ArgumentTypeError("params must be torch tensors (model.parameters())")
        self.kv = kv
        is_torch = isinstance(optimizer, torch.optim.Optimizer)
        if update_on_kvstore is None:
            update_on_kvstore = not is_torch
        self.update_on_kvstore = update_on_kvstore
        self.torch_optimizer = None if update_on_kvstore else optimizer
        # servers updating for a torch optimizer follow its param groups, whose
        # hyper-parameters a torch scheduler changes between steps (sent before the next push)
        self._torch_source = optimizer if update_on_kvstore and is_torch else None
        self._twin: kvopt.TorchTwin | None = None      # the servers' twin of it, as last sent
        if not update_on_kvstore and not is_torch:
            raise ArgumentTypeError("update_on_kvstore=False runs a torch optimizer on every worker: "
                                    f"pass a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self._clip, self._scaler = self._whole_model_options(clip_grad_norm, grad_scaler, is_torch)
        # servers updating with clipping or a scaler: the whole model's gradient in one
        # pushpull when backward ends, stepped by the servers in two phases
        self._whole_model = update_on_kvstore and (self._clip is not None or self._enabled(self._scaler))
        self._overflow = _Overflow()       # how the servers' skip reaches the scaler (scaler.step)
        # servers updating, whole model: the round between its phases (phase 1 when backward
        # ended, phase 2 at step(): KVStore.pushpull_open / pushpull_close), whether a scaler
        # read the stand-in's param_groups this round (DDP's scaler.unscale_/step(trainer)),
        # and this step's trainer.clip_grad_norm_ (max_norm, the total it returned)
        self._open: OpenRound | None = None
        self._groups_read = False
        self._clip_now: float | None = None
        self._clip_total: torch.Tensor | None = None
        if bucket_bytes is None:
            trained = [p.numel() * p.element_size() for p in self._params if p.requires_grad]
            # backward produces the first parameter's gradient last: a bucket fills before it
            bucket_bytes = bucket_bytes_for(sum(trained), trained[0] if trained else 0)
        elif isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ArgumentTypeError(f"bucket_bytes must be a positive int (or None: sized by the model), "
                                    f"got {bucket_bytes!r}")
        self._bucket_bytes = bucket_bytes
        self._overlap = overlap
        self._bucket: list[int] = []
        self._bucket_size = 0
        self._pushed: set[int] = set()
        self._handles: list = []      # exchanges started during backward, finished when it ends
        self._hooks = []
        self._lock = threading.Lock()
        self._seen: set[int] = set()   # parameters whose gradient arrived in this round (hooks)
        self._sync = True              # False inside no_sync(): gradients accumulate, unsent
        self._finish_queued = False    # autograd will run _finish_backward when this backward ends
        self._reduced = False          # the exchange finished when backward ended; step() has none to do
        # servers updating: (parameter index, its .grad, the .grad's version) as pushed,
        # to tell at step() that the gradients were edited after backward
        self._sent: list[tuple[int, torch.Tensor, int]] = []
        # CUDA models: autograd runs the hooks on its device threads, which must not
        # use the store; a communication thread (one per backward, ended when the
        # backward ends) starts their exchanges instead
        self._use_comm = overlap and any(p.is_cuda for p in self._params)
        self._comm: _CommThread | None = None
        self._side_streams: dict = {}     # device index -> the communication thread's CUDA stream
        self._timeline = kv.timeline       # KVSTORE_TIMELINE (kvstore.timeline), or None

        if kv.joined and not update_on_kvstore:
            raise InvalidArgumentError(
                "a worker that joins a running elastic job takes the weights from the servers, "
                "which hold them only with update_on_kvstore=True (a kvstore optimizer on the servers)")
        server_opt = None
        if update_on_kvstore:
            server_opt = optimizer if not is_torch else self._twin_of(optimizer)
            if not isinstance(server_opt, kvopt.Optimizer):
                raise ArgumentTypeError("optimizer must be a kvstore.optimizer optimizer or a torch "
                                        f"optimizer, got {type(optimizer).__name__}")
            if self._whole_model:
                server_opt = self._with_whole_model(server_opt)
        self._flat = self._flat_buckets(kv, server_opt, bucket_bytes) if flat_buckets else None
        if server_opt is not None and self._flat is not None:
            server_opt = self._bucket_multipliers(server_opt)
        # rank 0's parameters everywhere
        keys, values = self._weights()
        try:
            kv.init(keys, [v.detach() for v in values])
        except InvalidArgumentError as e:   # the workers' models differ: name the parameters
            raise InvalidArgumentError(f"{e}{self._bucket_contents(str(e), kv.rank)}") from None
        kv.pull(keys, out=values)
        if server_opt is not None:
            config = server_opt.to_config()
            params = dict(config["params"])
            params["rescale_grad"] = params.get("rescale_grad", 1.0) / kv.num_workers  # average
            sent = kvopt.from_config({**config, "params": params})
            kv.set_optimizer(sent)
            if isinstance(sent, kvopt.TorchTwin):
                self._twin = sent
        # with overlap=False too: the hooks note the gradients and have the exchange
        # finished when backward ends (one pushpull then)
        for index, p in enumerate(self._params):
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(index)))

    def _flat_buckets(self, kv: KVStore, server_opt, bucket_bytes: int) -> FlatBuckets:
        """The flat buckets of the parameters that train (flat_buckets=True)."""
        if server_opt is not None and server_opt.splits_norms:
            what = "clip_grad_norm_ computes a norm per parameter" if server_opt.whole_model else \
                f"{type(server_opt).__name__} computes a norm per key"
            raise InvalidArgumentError(
                f"flat_buckets: {what}, which on a flat bucket (one key on the servers) would span several "
                "parameters; create the Trainer with flat_buckets=False")
        trained = [i for i, p in enumerate(self._params) if p.requires_grad]
        key_of: Callable[[int], object]
        if kv.key_type is not str and all(isinstance(k, int) for k in self._keys):
            key_of = lambda b: len(self._params) + b        # noqa: E731 (after the parameters' keys)
        elif {f"bucket.{b}" for b in range(len(trained))}.isdisjoint(self._keys):
            key_of = lambda b: f"bucket.{b}"                # noqa: E731
        else:
            raise InvalidArgumentError("flat_buckets: a parameter is named like a bucket key (bucket.N)")
        return FlatBuckets(self._params, trained[::-1], bucket_bytes, key_of, lambda *a: self._grad_memory(kv, *a))

    def _bucket_contents(self, message: str, rank: int) -> str:
        """For an init error naming a flat bucket's key (workers whose models differ
        differ in their buckets' sizes): the parameters that bucket holds on this
        worker, with their shapes (``""`` when it names none)."""
        for bucket in self._flat.buckets if self._flat is not None else ():
            if f"key {bucket.key!r} " in message:
                held = ", ".join(f"{self._keys[i]!r} {tuple(self._params[i].shape)}" for i in bucket.indices)
                return f"; on worker {rank}, flat bucket {bucket.key!r} holds parameters {held}"
        return ""

    def _bucket_multipliers(self, server_opt: kvopt.Optimizer) -> kvopt.Optimizer:
        """``server_opt`` with each flat bucket's key given the lr_mult and wd_mult its
        parameters share (by their keys or names: a bucket is one key on the servers),
        or for a torch optimizer's twin the param group they share. Raises
        InvalidArgumentError naming two parameters of a bucket that differ."""
        assert self._flat is not None
        twin = server_opt if isinstance(server_opt, kvopt.TorchTwin) else None
        lr_mult: dict = {}
        wd_mult: dict = {}
        key_groups: dict = {}
        bfloat16_keys: list = []
        for bucket in self._flat.buckets:
            if twin is not None:
                groups = {i: twin.group_of(self._keys[i]) for i in bucket.indices}
                shared = set(groups.values())
                if len(shared) > 1:
                    a, b = [next(i for i, g in groups.items() if g == want)
                            for want in list(dict.fromkeys(groups.values()))[:2]]
                    raise InvalidArgumentError(
                        f"flat_buckets: parameters {self._keys[a]!r} (param group {groups[a]}) and {self._keys[b]!r} "
                        f"(param group {groups[b]}) share bucket {bucket.key!r}, which the servers update as one key: "
                        "create the Trainer with flat_buckets=False, or put them in one group")
                group = shared.pop() if shared else 0
                if group:
                    key_groups[bucket.key] = group
                if bucket.indices and self._params[bucket.indices[0]].dtype == torch.bfloat16:
                    bfloat16_keys.append(bucket.key)      # a bucket holds one dtype
                continue
            found = {i: server_opt.multipliers(self._keys[i]) for i in bucket.indices}
            if len(set(found.values())) > 1:
                (a, ma), (b, mb) = [next((i, m) for i, m in found.items() if m == want)
                                    for want in list(dict.fromkeys(found.values()))[:2]]
                raise InvalidArgumentError(
                    f"flat_buckets: parameters {self._keys[a]!r} (lr_mult, wd_mult {ma}) and {self._keys[b]!r} "
                    f"({mb}) share bucket {bucket.key!r}, which the servers update as one key: create the "
                    "Trainer with flat_buckets=False, or give them the same multipliers")
            mults = next(iter(found.values()), (1.0, 1.0))
            if mults != (1.0, 1.0):
                lr_mult[bucket.key], wd_mult[bucket.key] = mults
        if twin is not None:
            return twin.with_groups(twin.groups, {**twin.key_groups, **key_groups},
                                    twin.bfloat16_keys + bfloat16_keys)
        return server_opt.with_multipliers(lr_mult, wd_mult) if lr_mult else server_opt

    def _whole_model_options(self, clip_grad_norm, grad_scaler, is_torch: bool) -> tuple:
        """The checked ``clip_grad_norm`` and ``grad_scaler``. Raises ArgumentTypeError
        for a wrong type, InvalidArgumentError where the servers would run a kvstore
        optimizer (which neither clips nor unscales: its twin of a torch one does)."""
        if clip_grad_norm is not None:
            if isinstance(clip_grad_norm, bool) or not isinstance(clip_grad_norm, (int, float)) \
                    or not clip_grad_norm >= 0 or clip_grad_norm == float("inf"):
                raise ArgumentTypeError(f"clip_grad_norm must be a finite number >= 0 (max_norm) or None, got "
                                        f"{clip_grad_norm!r}")
            clip_grad_norm = float(clip_grad_norm)
        if grad_scaler is not None:
            if not all(callable(getattr(grad_scaler, n, None)) for n in ("get_scale", "is_enabled", "step", "update")):
                raise ArgumentTypeError(f"grad_scaler must be a torch.amp.GradScaler, got "
                                        f"{type(grad_scaler).__name__}")
        if self.update_on_kvstore and not is_torch and (clip_grad_norm is not None or grad_scaler is not None):
            raise InvalidArgumentError(
                "clip_grad_norm and grad_scaler with the servers updating need a torch optimizer, whose twin the "
                "servers run with them (a kvstore optimizer has MXNet's clip_gradient and rescale_grad instead)")
        return clip_grad_norm, grad_scaler

    @staticmethod
    def _enabled(scaler) -> bool:
        return scaler is not None and bool(scaler.is_enabled())

    def _scale_now(self) -> float | None:
        """The loss scale of the gradients being pushed (the GradScaler's), or None."""
        return float(self._scaler.get_scale()) if self._enabled(self._scaler) else None

    def _with_whole_model(self, twin: kvopt.Optimizer) -> kvopt.Optimizer:
        """The servers' twin with ``clip_grad_norm`` and the scaler's current scale
        (kvstore.optimizer.torch_twin: whole-model steps)."""
        config = twin.to_config()
        return kvopt.from_config({**config, "params": {**config["params"], "clip_grad_norm": self._clip,
                                                       "grad_scale": self._scale_now()}})

    def _twin_of(self, optimizer: torch.optim.Optimizer) -> kvopt.TorchTwin:
        """The servers' twin of the torch optimizer (:func:`optimizer_from_torch`)."""
        return optimizer_from_torch(optimizer, zip(self._params, self._keys))

    @staticmethod
    def _grad_memory(kv: KVStore, size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """A flat bucket's gradient buffer that co-located GPU servers read in place
        (``kv.empty(..., device=i)`` of dist_device_sync on GPUs), or None: torch's memory."""
        from .worker.device import DistDeviceStore
        if device.type != "cuda" or not isinstance(kv, DistDeviceStore) or not kv.device_memory \
                or dtype == torch.bfloat16:
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        numpy_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        return torch.from_dlpack(kv.empty(size, numpy_dtype, device=index))

    def _weights(self) -> tuple[list, list]:
        """Every key of the model with the tensor holding its weights: a parameter's,
        or a flat bucket's buffer for the parameters in buckets."""
        alone = [i for i in range(len(self._params)) if self._flat is None or i not in self._flat.of]
        keys = [self._keys[i] for i in alone]
        values = [self._params[i].data for i in alone]
        if self._flat is not None:
            keys += [b.key for b in self._flat.buckets]
            values += [b.weight for b in self._flat.buckets]
        return keys, values

    # -- backward hooks -----------------------------------------------------------
    def _hook(self, index: int):
        def ready(param):
            if not self._sync:
                return          # no_sync(): accumulated here, exchanged by a later backward
            with self._lock:
                if self.update_on_kvstore and (self._reduced or index in self._seen):
                    raise InvalidArgumentError(
                        f"parameter {self._keys[index]!r} got a second gradient before step(): the servers "
                        "applied this step's gradients when the backward before ended (update_on_kvstore="
                        "True); call step() after every backward, and accumulate over several backward "
                        "passes inside `with trainer.no_sync():` (all but the last; the last exchanges the "
                        "sum), as with DDP. A reentrant backward inside this one (torch.utils.checkpoint "
                        "with use_reentrant=True) does the same: pass use_reentrant=False")
                first, queue_finish = not self._seen, not self._finish_queued
                self._seen.add(index)
                self._finish_queued = True
                if first:
                    self._reduced = False      # workers updating: a new round, on the average so far
                    if not self.update_on_kvstore:
                        self._clip_now = None  # (servers updating: reset as the round opens)
            if queue_finish:
                # the exchange finishes when this backward ends (DDP's reducer does the
                # same), so .grad is final for whatever runs between backward() and step()
                Variable._execution_engine.queue_callback(self._finish_backward)
            if self._timeline is not None and first:
                self._timeline.instant("trainer", "first gradient")
            if not self._overlap or self._whole_model:
                return          # sent in one pushpull when backward ends
            if self._flat is not None and index in self._flat.of:
                self._flat.take(index)
                with self._lock:
                    done = self._flat.arrived(index)
                    if done is not None:
                        done.started = True
                if done is not None:
                    self._launch(done.indices, lambda main: self._start_bucket(done, main))
                return
            with self._lock:
                self._bucket.append(index)
                self._bucket_size += param.numel() * param.element_size()
                full = self._bucket_size >= self._bucket_bytes
            if full:
                self._flush_bucket()
        return ready

    def _flush_bucket(self) -> None:
        with self._lock:
            indices, self._bucket, self._bucket_size = self._bucket, [], 0
        if indices:
            self._launch(indices, lambda main: self._start(indices, main))

    def _launch(self, indices: list[int], start_exchange) -> None:
        """Start the exchange of these parameters' gradients (``start_exchange(main)``):
        here, or on the communication thread for a CUDA model."""
        with self._lock:
            if self._use_comm and self._comm is None:
                self._comm = _CommThread()
            comm = self._comm
        if self._timeline is not None:
            self._timeline.instant("trainer", "bucket ready", {
                "keys": [self._keys[i] for i in indices],
                "bytes": sum(self._params[i].numel() * self._params[i].element_size() for i in indices)})
        if comm is None:
            start_exchange(None)
            return
        # the gradients are being computed on this thread's current CUDA stream: the
        # communication thread queues its copies on a stream of its own that waits for
        # this event on the device (no host wait, not the whole device), so that they
        # run beside the rest of backward instead of behind it on the default stream
        # (issue 29); a host copy or an IPC reference then waits for that stream
        device = self._params[indices[0]].device
        if device.type != "cuda":
            comm.submit(lambda: start_exchange(None))
            return
        main = torch.cuda.current_stream(device)
        ready = torch.cuda.Event()
        ready.record(main)
        side = self._side_streams.get(device.index)
        if side is None:
            side = self._side_streams[device.index] = torch.cuda.Stream(device)

        def start() -> None:
            with gpu.on_stream(side, device.index):
                side.wait_event(ready)
                start_exchange(main)
        comm.submit(start)

    def _start(self, indices: list[int], main=None) -> None:
        """Start the exchange of these parameters' gradients: one pushpull whose
        results (the summed gradient into ``.grad``, or the servers' new weights into
        the parameter) arrive in the background, while backward goes on. A hook runs
        after its parameter's last use in this backward, so writing the parameter
        early is safe; ``step()`` waits for all of them."""
        if not self._pushed:           # the step's first exchange
            self._sync_hyper_params()
        grads, outs = [], []
        for i in indices:
            p = self._params[i]
            if p.grad is None:       # no gradient this step: zeros keep the sync rounds aligned
                zeros = torch.zeros_like(p)
                if main is not None:     # made on the side stream, used by the training loop's
                    zeros.record_stream(main)
                if not self.update_on_kvstore:
                    p.grad = zeros
                grads.append(zeros)
            else:
                grads.append(p.grad)
            outs.append(p.data if self.update_on_kvstore else grads[-1])
        keys = [self._keys[i] for i in indices]
        if self._whole_model:
            self._open_round(keys, grads, outs)
        else:
            self._handles.append(self.kv.pushpull_async(keys, grads, out=outs))
        self._pushed.update(indices)

    def _open_round(self, keys: list, grads: list, outs: list) -> None:
        """Servers updating, whole model: phase 1 of the model's pushpull (every key's
        unscaled norm and overflow, on every worker alike), the round held open until
        :meth:`allreduce_grads` closes it, so that what the loop decides in between
        (``scaler.unscale_(trainer)``, :meth:`clip_grad_norm_`) reaches the servers. A
        round that overflowed is closed now, skipped: nothing the loop does changes that
        (torch's ``scaler.step`` skips ``optimizer.step()``, and never calls
        ``trainer.step()`` then)."""
        assert self._twin is not None       # whole-model steps need a torch optimizer's twin
        self._open = self.kv.pushpull_open(keys, grads, out=outs)
        self._groups_read, self._clip_now, self._clip_total = False, None, None
        overflowed = self._twin.overflowed(self._open.terms)
        # what the stand-in's gradient holds for a scaler: inf (skip), or 1 (unscale_
        # multiplies it by the scale's float32 reciprocal, which step() reads back)
        self._overflow.grad = torch.full((1,), float("inf") if overflowed else 1.0)
        if overflowed:
            self.kv.pushpull_close(self._open, self._twin.model_sums(self._open.terms))    # [1, 1]: skipped

    def _start_bucket(self, bucket: Bucket, main=None) -> None:
        """:meth:`_start` for a flat bucket: one key, its gradient buffer pushed, the
        result into its weight buffer (servers updating) or back into the gradients."""
        if not self._pushed:           # the step's first exchange
            self._sync_hyper_params()
        out = bucket.weight if self.update_on_kvstore else bucket.grad
        self._handles.append(self.kv.pushpull_async(bucket.key, bucket.grad, out=out))
        self._pushed.update(bucket.indices)

    def _sync_hyper_params(self) -> None:
        """Send the torch optimizer's param groups to the servers if any hyper-parameter
        of any group changed since they were last sent (a torch scheduler's lr,
        momentum, betas, ...), keeping the servers' state (``kv.set_optimizer(...,
        keep_state=True)``), so that the update this step's gradients get uses them,
        as torch's step would. Raises InvalidArgumentError for a change the twin
        cannot honour (a group added, one that changes which state arrays a key keeps)."""
        if self._torch_source is None or self._twin is None:
            return
        twin = self._twin
        groups = torch_groups(self._torch_source, type(twin))
        scale = self._scale_now()
        if groups == twin.groups and scale == twin.grad_scale:
            return
        if scale != twin.grad_scale:     # the scaler backed off or grew: the servers unscale by it
            config = twin.to_config()
            twin = kvopt.from_config({**config, "params": {**config["params"], "grad_scale": scale}})
            assert isinstance(twin, kvopt.TorchTwin)
        if len(groups) != len(twin.groups):
            raise InvalidArgumentError(
                f"step: the torch optimizer has {len(groups)} param groups, {len(twin.groups)} when the Trainer was "
                "made; the servers' keys keep their groups: make a new Trainer after add_param_group")
        try:
            new = twin.with_groups(groups)
        except ConfigError as e:
            raise InvalidArgumentError(f"step: a param group's new hyper-parameters: {e}") from None
        if new.state_layout() != twin.state_layout():
            raise InvalidArgumentError(
                f"step: the param groups' new hyper-parameters change the state the servers keep for each key "
                f"({', '.join(twin.state_layout()) or 'none'} -> {', '.join(new.state_layout()) or 'none'}), "
                "which they cannot honour mid-run; make the Trainer with them from the start")
        self.kv.set_optimizer(new, keep_state=True)
        self._twin = new

    # -- the training-loop API ---------------------------------------------------------
    def pull_weights(self) -> None:
        """Copy the servers' current weights into the parameters. A worker that joined
        a running elastic job calls it after its first barrier, where every other
        worker's pushes are applied: it then holds exactly the others' weights."""
        if not self.update_on_kvstore:
            raise InvalidArgumentError("pull_weights: the servers hold the weights only with "
                                       "update_on_kvstore=True")
        keys, values = self._weights()
        self.kv.pull(keys, out=values)


    def zero_grad(self) -> None:
        """Clear gradients (set to None, as torch's default; with flat buckets, zeros
        in the buckets, whose views the ``.grad`` stay)."""
        for i, p in enumerate(self._params):
            if self._flat is None or i not in self._flat.of:
                p.grad = None
        if self._flat is not None:
            self._flat.zero_grad()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's ``no_sync()``: backward passes inside accumulate their gradients in
        ``.grad`` without exchanging them; the first backward after the context
        exchanges the sum. The loop for accumulating over k micro-batches::

            trainer.zero_grad()
            for i, (x, y) in enumerate(micro_batches):
                with trainer.no_sync() if i < k - 1 else contextlib.nullcontext():
                    (loss_fn(model(x), y) / k).backward()
            trainer.step()
        """
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    @property
    def bucket_bytes(self) -> int:
        """The bucket size in use: the one given, or :func:`bucket_bytes_for` the model."""
        return self._bucket_bytes

    @property
    def param_groups(self) -> list:
        """What a ``torch.amp.GradScaler`` reads, so that ``scaler.unscale_(trainer)``
        and ``scaler.step(trainer)`` work as with a torch optimizer. Workers updating:
        the torch optimizer's param groups. Servers updating (made with
        ``grad_scaler=``; dist_sync), after a backward: one stand-in group whose one
        parameter's gradient is inf when any averaged gradient of the model overflowed
        (the servers' phase 1, the same on every worker; the round is then skipped),
        else 1, so that every worker's scaler records the same verdict, skips
        ``trainer.step()`` alike and backs off alike; the inverse scale ``unscale_``
        multiplies in is checked at :meth:`step` against the Trainer's scaler. Raises
        InvalidArgumentError with the servers updating without the Trainer's
        ``grad_scaler`` (naming it), or before a backward."""
        if not self.update_on_kvstore:
            assert self.torch_optimizer is not None      # update_on_kvstore=False has one
            return self.torch_optimizer.param_groups
        if not (self._whole_model and self._enabled(self._scaler)):
            raise InvalidArgumentError(self._SCALER_ON_SERVERS)
        if self._open is None:
            raise InvalidArgumentError(
                "scaler.unscale_(trainer) / scaler.step(trainer) with the servers updating read the verdict of the "
                "servers' first phase, which runs when backward ends: call them after scaler.scale(loss).backward() "
                "(once per backward)")
        self._groups_read = True
        if self._open.closed and self._reduced:
            # overflowed: skipped already, and the scaler will not call step(): the
            # round ends here, so that the next backward starts a new one
            self._end_round()
        return self._overflow.param_groups

    _SCALER_ON_SERVERS = (
        "with the servers updating (update_on_kvstore=True) they unscale the gradients, check them for inf/nan "
        "and clip them, for the whole model, and need the GradScaler for that before backward pushes: give it to "
        "the Trainer, Trainer(..., grad_scaler=scaler) (a torch optimizer, dist_sync); then DDP's loop, "
        "scaler.scale(loss).backward(); scaler.unscale_(trainer); trainer.clip_grad_norm_(max_norm); "
        "scaler.step(trainer); scaler.update(), works as with a torch optimizer (or trainer.step() in place of "
        "scaler.step(trainer))")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the averaged gradient of the whole model by its global norm, as FSDP's
        ``clip_grad_norm_`` method (for gradients no worker holds whole), and return
        that total norm (a float32 tensor, as ``torch.nn.utils.clip_grad_norm_``). Call
        it between ``backward()`` and :meth:`step` (after ``scaler.unscale_(trainer)``
        with a GradScaler, as under DDP). It replaces the Trainer's ``clip_grad_norm``
        for this step.

        Workers updating: ``torch.nn.utils.clip_grad_norm_`` over the averaged
        gradients of the parameters that have one. Servers updating (a Trainer made
        with ``grad_scaler=`` or ``clip_grad_norm=``, dist_sync): the total from the
        norms the servers took in phase 1 (of the unscaled gradients), the clipping
        applied by the servers at :meth:`step`; every worker computes the same total.
        Raises InvalidArgumentError there for a Trainer without those options, a
        ``norm_type`` other than 2, a call before a backward, a second call in a step,
        and with a GradScaler a call before ``scaler.unscale_(trainer)`` (the servers'
        norms are of the unscaled gradient)."""
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm >= 0 \
                or max_norm == float("inf"):
            raise ArgumentTypeError(f"clip_grad_norm_: max_norm must be a finite number >= 0, got {max_norm!r}")
        if not self.update_on_kvstore:
            total = torch.nn.utils.clip_grad_norm_([p for p in self._params if p.grad is not None], max_norm,
                                                   norm_type)
            self._clip_now = float(max_norm)
            return total
        if not self._whole_model:
            raise InvalidArgumentError(
                "clip_grad_norm_ with the servers updating needs the whole model's gradient held on the servers "
                "between backward and step: make the Trainer with grad_scaler=scaler (mixed precision) or "
                "clip_grad_norm=max_norm (the servers then clip every step; clip_grad_norm_ may still be called, "
                "its max_norm for that step); a torch optimizer and dist_sync")
        if float(norm_type) != 2.0:
            raise InvalidArgumentError(f"clip_grad_norm_: norm_type={norm_type!r}; the servers take 2-norms "
                                       "(norm_type=2.0)")
        if self._open is None:
            raise InvalidArgumentError("clip_grad_norm_: no backward's gradient to clip; call it between "
                                       "backward() and step()")
        if self._clip_now is not None:
            raise InvalidArgumentError("clip_grad_norm_: called twice in one step; the servers clip once")
        if self._enabled(self._scaler) and not self._groups_read:
            raise InvalidArgumentError(
                "clip_grad_norm_: the gradients are still scaled by the GradScaler; call scaler.unscale_(trainer) "
                "first, as torch's AMP recipe does (the servers' norms are of the unscaled gradient)")
        assert self._twin is not None       # whole-model steps need a torch optimizer's twin
        total = self._twin.total_norm(self._open.terms)
        self._clip_now, self._clip_total = float(max_norm), total
        return total.clone()

    def step(self, scaler=None) -> None:
        """Finish the exchange (when a backward produced gradients, it finished as that
        backward ended), then (workers updating) run the torch optimizer on the
        averaged gradients: :meth:`allreduce_grads`, then :meth:`update`. ``scaler``: a
        ``torch.amp.GradScaler`` (mixed precision), which unscales the averaged
        gradients and skips the step if they overflowed (``scaler.step(trainer)`` is
        the same, workers updating); the Trainer's ``grad_scaler`` when none is given.
        Servers updating, the scaler must be the Trainer's ``grad_scaler``: the servers
        unscaled and checked the gradients as the backward ended; here they clip
        (:meth:`clip_grad_norm_`'s max_norm, else ``clip_grad_norm``) and step, or
        skipped the step already on an overflow, and the scaler records whether they
        skipped, for ``scaler.update()`` (unless ``scaler.step(trainer)`` called this:
        it read the verdict itself)."""
        start = self._timeline.now() if self._timeline is not None else 0
        if scaler is not None:
            self._check_scaler(scaler)       # before waiting on the exchange
        scaler = self._scaler if scaler is None else scaler
        self.allreduce_grads()
        if not self.update_on_kvstore:
            self._optimizer_step(scaler)
        elif self._torch_source is not None:
            if self._enabled(scaler) and not self._groups_read:
                self._record_overflow(scaler)      # (scaler.step(trainer) read the verdict itself)
            # what torch's own step records for its LR schedulers (the servers stepped):
            # without it, the first scheduler step warns it came before optimizer.step()
            self._torch_source._opt_called = True  # type: ignore[attr-defined]
        if self._timeline is not None:
            self._timeline.span("trainer", "step", start)

    def allreduce_grads(self) -> None:
        """The first half of :meth:`step`, as in MXNet Gluon: finish the exchange
        (done already when a backward produced gradients: it finishes when backward
        ends; otherwise, e.g. after backward passes inside :meth:`no_sync` only, the
        gradients are exchanged here). Servers updating, the parameters then hold the
        new weights (a whole-model round held open since backward is closed here: its
        phase 2); workers updating, every ``.grad`` holds the gradient averaged over
        the workers, to clip or unscale (``scaler.unscale_(trainer)``) before
        :meth:`update`. Raises InvalidArgumentError, with the servers updating, if a
        gradient was changed after the backward that sent it."""
        if self._reduced:
            self._end_round()
        elif self._open is not None and self._open.closed and self._groups_read:
            pass        # a skipped round the scaler ended (param_groups): nothing to exchange
        else:
            self._finish_exchange()
            self._seen.clear()
            self._sent = []
        if self._open is not None and not self._open.closed:
            self._close_round()

    def _end_round(self) -> None:
        """Servers updating: the round the last backward pushed is over (stepped or
        skipped); refuse a gradient edited since it was pushed, and let the next
        backward push again."""
        self._reduced = False
        self._check_unchanged()
        self._seen.clear()
        self._sent = []

    def _close_round(self) -> None:
        """Phase 2 of the open round (servers updating, whole model), with the sums
        every worker decides alike from phase 1's terms and what the loop did: the
        clip coefficient of :meth:`clip_grad_norm_`'s max_norm if it ran, else the
        twin's (the Trainer's ``clip_grad_norm``, or 1). Raises InvalidArgumentError
        when a scaler other than the Trainer's ``grad_scaler`` unscaled the stand-in
        (``scaler.unscale_(trainer)``), or for a non-finite norm to clip without a
        scaler to skip the step."""
        opened, self._open = self._open, None
        assert opened is not None and self._twin is not None
        twin = self._twin
        if self._groups_read and self._enabled(self._scaler) and twin.grad_scale is not None:
            inv = float(self._overflow.param.grad[0]) if self._overflow.param.grad is not None else float("nan")
            want = float(torch.tensor(twin.grad_scale, dtype=torch.float64).reciprocal().float())
            if inv != want:
                raise InvalidArgumentError(
                    f"step: scaler.unscale_(trainer) multiplied by {inv!r}, but the gradients the servers hold were "
                    f"scaled by the Trainer's grad_scaler's scale {twin.grad_scale!r} (its reciprocal {want!r}): "
                    "unscale and step with the scaler given to Trainer(..., grad_scaler=scaler)")
        if self._clip_now is None:
            sums = twin.model_sums(opened.terms)
        else:
            assert self._clip_total is not None
            if not bool(torch.isfinite(self._clip_total)):
                raise InvalidArgumentError(
                    f"step: the gradient norm clip_grad_norm_ returned is {float(self._clip_total)} (an inf or nan "
                    "gradient) and no GradScaler skips the step: the servers cannot clip it")
            sums = [twin.clip_coef(self._clip_total, self._clip_now), 0.0]
        self.kv.pushpull_close(opened, sums)

    def _finish_backward(self) -> None:
        """Run by autograd when a backward that produced gradients ends (on its thread,
        with the streams of the caller of ``backward()``): finish the exchange. Workers
        updating, the next backward starts a new round (on the average so far, as DDP
        without no_sync); servers updating, :meth:`step` must come first, and finds
        there what was pushed, to refuse a gradient edited since."""
        self._finish_queued = False
        if self._timeline is not None:     # what was sent before this overlapped the backward
            self._timeline.instant("trainer", "backward ended")
        exchanged = self._finish_exchange()
        if self.update_on_kvstore:
            self._sent = [(i, g, g._version) for i in exchanged if (g := self._params[i].grad) is not None]
        else:
            self._seen.clear()
        self._reduced = True

    def _check_unchanged(self) -> None:
        """Servers updating: refuse a gradient changed (in place, or replaced) since it
        was pushed. torch's version counter counts every in-place change of a tensor
        and its views (what autograd checks saved tensors with): exact for torch's
        operations, clip_grad_norm_ and GradScaler included, and one integer read per
        parameter; an edit through ``.data`` or numpy escapes it, as it escapes autograd."""
        for i, grad, version in self._sent:
            now = self._params[i].grad
            if now is not grad or now._version != version:
                raise InvalidArgumentError(
                    f"step: the gradient of parameter {self._keys[i]!r} was changed after backward() (gradient "
                    "clipping? unscaling?), but the servers applied the gradients as backward produced them "
                    "(update_on_kvstore=True), so the change would be lost. Have the servers clip and unscale: "
                    "Trainer(..., grad_scaler=scaler) and DDP's scaler.unscale_(trainer), "
                    "trainer.clip_grad_norm_(max_norm), scaler.step(trainer), or Trainer(..., clip_grad_norm=max_norm, "
                    "grad_scaler=scaler) and trainer.step(); or let the workers update "
                    "(update_on_kvstore=False, a torch optimizer): .grad then holds the average when backward() "
                    "returns, to clip before step() as with DDP, or with trainer.allreduce_grads(), clipping, "
                    "then trainer.update()")

    def _finish_exchange(self) -> list[int]:
        """Exchange what was not sent during backward, wait for every exchange and
        (workers updating) average: the parameters exchanged."""
        self._flush_bucket()
        if self._flat is not None:
            self._start_unstarted_buckets()
        with self._lock:
            comm, self._comm = self._comm, None
        if comm is not None:
            try:
                comm.drain()            # every exchange of this backward has started
            finally:
                comm.close()
        # frozen parameters (requires_grad=False) are left out, as DDP and torch's
        # optimizers leave them: no gradient exchange, no weight decay or momentum
        exchanged = [i for i, p in enumerate(self._params) if p.requires_grad or i in self._pushed]
        rest = [i for i in exchanged if i not in self._pushed]
        if rest:
            # overlap=False: everything in one pushpull here (one round trip); and
            # the parameters without a gradient this round (zeros)
            self._start(rest)
        handles, self._handles = self._handles, []
        self._pushed.clear()
        if self._flat is not None:
            self._flat.new_step()
        start = self._timeline.now() if self._timeline is not None else 0
        for handle in handles:
            handle.wait()
        for index, side in self._side_streams.items():
            # a store that finished an exchange on the communication thread wrote its
            # outputs on that thread's stream: the training loop's stream goes after it
            torch.cuda.current_stream(index).wait_stream(side)
        if self._timeline is not None:
            self._timeline.span("trainer", "wait for exchanges", start, args={"exchanges": len(handles)})
        if not self.update_on_kvstore and self.kv.num_workers > 1:
            flat = self._flat
            for i in exchanged:
                if flat is None or i not in flat.of:
                    self._params[i].grad.div_(self.kv.num_workers)
            for bucket in flat.buckets if flat is not None else []:
                bucket.grad.div_(self.kv.num_workers)     # (every .grad in it is a view)
        return exchanged

    def _start_unstarted_buckets(self) -> None:
        """The buckets not complete during backward (overlap=False, unused parameters):
        gradients that did not arrive are zeros, replaced ones copied in, then exchanged."""
        assert self._flat is not None
        for bucket in self._flat.unstarted():
            frozen = [self._keys[i] for i in bucket.indices if not self._params[i].requires_grad]
            if frozen:
                raise InvalidArgumentError(
                    f"flat_buckets: parameter {frozen[0]!r} was frozen after the Trainer was made; its "
                    "bucket would still exchange it (create the Trainer after freezing, or use "
                    "flat_buckets=False)")
            for i in bucket.waiting:
                self._flat.take(i)
            bucket.started = True
            self._launch(bucket.indices, lambda main, bucket=bucket: self._start_bucket(bucket, main))

    def update(self, scaler=None) -> None:
        """The second half of :meth:`step` (workers updating): run the torch
        optimizer on the averaged gradients, through ``scaler.step`` if a
        ``torch.amp.GradScaler`` is given (call ``scaler.update()`` after, as with
        any optimizer; the Trainer's ``grad_scaler`` when none is given, which also
        unscales before the Trainer's ``clip_grad_norm`` clips). Every worker holds
        the same averaged gradients, so every worker's scaler finds the same overflow
        and skips or steps alike."""
        if self.update_on_kvstore:
            raise InvalidArgumentError("update: the servers run the optimizer "
                                       "(update_on_kvstore=True); call step()")
        if scaler is not None:
            self._check_scaler(scaler)
        self._optimizer_step(self._scaler if scaler is None else scaler)

    def _optimizer_step(self, scaler) -> None:
        start = self._timeline.now() if self._timeline is not None else 0
        assert self.torch_optimizer is not None      # update_on_kvstore=False has one
        if self._clip is not None and self._clip_now is None:
            # the Trainer's clip_grad_norm (unless the loop called clip_grad_norm_: it
            # replaces it for this step): unscaled first, as DDP's loop does
            if self._enabled(scaler):
                scaler.unscale_(self.torch_optimizer)
            torch.nn.utils.clip_grad_norm_([p for p in self._params if p.grad is not None], self._clip)
        if scaler is None:
            self.torch_optimizer.step()
        else:
            scaler.step(self.torch_optimizer)
        self._clip_now = None
        if self._timeline is not None:
            self._timeline.span("trainer", "optimizer step", start)

    def _record_overflow(self, scaler) -> None:
        """Servers updating: give ``scaler`` the servers' verdict on this step (an inf
        or nan anywhere in the model's averaged gradient, the same on every worker:
        ``kv.last_model_sums``), through ``scaler.step`` on a stand-in optimizer whose
        one gradient is inf or 0, so that ``scaler.update()`` backs off or grows the
        scale as after ``scaler.step(optimizer)`` under DDP."""
        sums = self.kv.last_model_sums
        if sums is None:
            raise InvalidArgumentError("step: the servers gave no whole-model verdict for this step (no pushpull "
                                       "ran their two phases): was the Trainer made with grad_scaler=?")
        self._overflow.grad = torch.full((1,), float("inf") if sums[1] else 0.0)
        scaler.step(self._overflow)

    def _check_scaler(self, scaler) -> None:
        if not callable(getattr(scaler, "step", None)) or not callable(getattr(scaler, "unscale_", None)):
            raise ArgumentTypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        if self._scaler is not None and scaler is not self._scaler:
            raise InvalidArgumentError("step: scaler is not the Trainer's grad_scaler; pass the same one (or none)")
        if self.update_on_kvstore and scaler is not self._scaler:
            raise InvalidArgumentError(self._SCALER_ON_SERVERS)

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The optimizer state in torch's format (``torch.optim.Optimizer.state_dict()``:
        ``{"state": {index: {"step", "exp_avg", ...}}, "param_groups": [...]}``), in
        both update modes: workers updating, the torch optimizer's own; servers
        updating, the servers' state of every key (gathered as ``save_states`` does)
        under the torch optimizer's param groups, so that a state saved in one mode
        loads in the other, or into a plain torch optimizer. Raises
        InvalidArgumentError with the servers updating for a kvstore optimizer (use
        :meth:`save_states`) or flat buckets (a bucket's state spans parameters)."""
        if not self.update_on_kvstore:
            assert self.torch_optimizer is not None      # update_on_kvstore=False has one
            return self.torch_optimizer.state_dict()
        opt, twin = self._torch_twin("state_dict")
        with tempfile.TemporaryDirectory(prefix="kvstore-state-") as folder:
            path = os.path.join(folder, "states")
            self.kv.save_optimizer_states(path)
            _, states = states_file.load(path)
        key_of = {id(p): k for p, k in zip(self._params, self._keys)}
        layout = twin.state_layout()
        out = opt.state_dict()       # the groups as torch writes them; its own state is empty
        state: dict = {}
        index = 0
        for gi, group in enumerate(opt.param_groups):
            for p in group["params"]:
                entry = states.get(key_of.get(id(p)))
                if entry is not None and entry["t"] > 0:
                    one = {"step": torch.tensor(float(entry["t"]))} if twin.keeps_step else {}
                    for name in twin.used_states(twin.groups[gi]):    # (bfloat16: kept in float32, exactly)
                        array = entry["state"][layout.index(name)]
                        one[name] = torch.from_numpy(array.copy()).reshape(p.shape).to(p.dtype)
                    if one:      # (torch keeps nothing for SGD without momentum)
                        state[index] = one
                index += 1
        out["state"] = state
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what :meth:`state_dict` returned (or a torch optimizer's
        ``state_dict()`` over the same parameters): the groups' hyper-parameters and
        every parameter's state, as ``torch.optim.Optimizer.load_state_dict`` does;
        with the servers updating, sent to the servers (the torch optimizer keeps no
        copy). Raises as torch's for a state of other parameters, and as
        :meth:`state_dict`."""
        if not self.update_on_kvstore:
            assert self.torch_optimizer is not None      # update_on_kvstore=False has one
            self.torch_optimizer.load_state_dict(state_dict)
            return
        opt, twin = self._torch_twin("load_state_dict")
        opt.load_state_dict(state_dict)      # torch checks it, casts the state to each parameter's dtype
        new = twin.with_groups(torch_groups(opt, type(twin)))
        layout = new.state_layout()
        states = {}
        key_of = {id(p): k for p, k in zip(self._params, self._keys)}
        for p, one in opt.state.items():
            if not one or id(p) not in key_of or (twin.keeps_step and int(one.get("step", 1)) == 0):
                continue         # no step yet (Adagrad's constructor makes its sum): a fresh state
            if twin.keeps_step and "step" not in one:
                raise InvalidArgumentError(f"load_state_dict: the state of parameter {key_of[id(p)]!r} has no step")
            t = int(one["step"].item()) if twin.keeps_step else 1
            kept = torch.float32 if p.dtype == torch.bfloat16 else p.dtype     # what the stores keep
            arrays = [(one[n].detach().cpu().reshape(-1).to(kept) if n in one else
                       torch.zeros(p.numel(), dtype=kept)).numpy().copy() for n in layout]
            states[key_of[id(p)]] = {"t": t, "state": [a.reshape(tuple(p.shape)) for a in arrays]}
        opt.state.clear()            # the servers hold it
        # the twin with the loaded groups (collective: every worker is here, no round in
        # flight), the states (every worker sends the same), then a barrier, so that no
        # worker reads or pushes before every state is in place
        self.kv.set_optimizer(new)
        self._twin = new
        with tempfile.TemporaryDirectory(prefix="kvstore-state-") as folder:
            path = os.path.join(folder, "states")
            states_file.dump(path, None, states)
            self.kv.load_optimizer_states(path)
        self.kv.barrier()

    def _torch_twin(self, what: str) -> tuple[torch.optim.Optimizer, kvopt.TorchTwin]:
        if self._torch_source is None or self._twin is None:
            raise InvalidArgumentError(f"{what}: torch's format needs a torch optimizer; the servers run a kvstore "
                                       "optimizer here: use save_states() / load_states()")
        if self._flat is not None:
            raise InvalidArgumentError(f"{what}: with flat_buckets the servers keep one state per bucket, not per "
                                       "parameter: use save_states() / load_states()")
        return self._torch_source, self._twin

    def save_states(self, path: str) -> None:
        """Save the optimizer state atomically: the servers' (update_on_kvstore) or
        the local torch optimizer's."""
        if self.update_on_kvstore:
            self.kv.save_optimizer_states(path, dump_optimizer=True)
            return
        assert self.torch_optimizer is not None      # update_on_kvstore=False has one
        with atomic_write(path) as f:
            torch.save(self.torch_optimizer.state_dict(), f)

    def load_states(self, path: str) -> None:
        """Restore what :meth:`save_states` wrote."""
        if self.update_on_kvstore:
            self.kv.load_optimizer_states(path)
        else:
            assert self.torch_optimizer is not None  # update_on_kvstore=False has one
            self.torch_optimizer.load_state_dict(torch.load(path, weights_only=True))

    def close(self) -> None:
        """Remove the backward hooks (the store stays open)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


class _Overflow:
    """What ``torch.amp.GradScaler.step`` takes for an optimizer, standing in for the
    servers (servers updating, :meth:`Trainer._record_overflow`): one parameter whose
    gradient is inf when they skipped the step, 0 otherwise; ``step()`` does
    nothing (the servers stepped already)."""

    def __init__(self) -> None:
        self.param = torch.zeros(1)
        self.param_groups = [{"params": [self.param]}]

    @property
    def grad(self) -> torch.Tensor | None:
        return self.param.grad

    @grad.setter
    def grad(self, value: torch.Tensor) -> None:
        self.param.grad = value

    def step(self, *args, **kwargs) -> None:
        """Nothing: the servers stepped (or skipped) as the backward ended."""


class _CommThread:
    """Runs the exchanges a CUDA model's backward hooks start, one after another, on
    one thread (the hooks run on autograd's device threads). The store is used by
    this thread during backward and, once :meth:`drain` (the hand-over, which also
    re-raises the first failure) returned, by the thread that ends the backward
    (autograd's, running the Trainer's end-of-backward callback) and then the
    training loop's, one at a time."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvstore-trainer-comm", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                if self._error is None:
                    job()
            except BaseException as e:  # noqa: BLE001 - handed to the training loop by drain()
                self._error = e
            finally:
                self._queue.task_done()

    def submit(self, job) -> None:
        self._queue.put(job)

    def drain(self) -> None:
        self._queue.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


def shard(n_items, kv, *, contiguous: bool = False, shuffle: bool = False, epoch: int = 0,
          seed: int = 0) -> range | list:
    """This worker's indices of ``n_items`` items (an int, or anything with ``len()``,
    e.g. a dataset), the remainder dropped, so that every worker gets exactly
    ``n_items // num_workers`` and takes the same number of steps. In ``dist_sync``
    that is required: a round needs a push from every worker, so a worker with more
    batches than another would wait for one that has already finished (it then
    fails, naming that worker).

    - default: every ``kv.num_workers``-th index from this worker's place (``kv.rank``;
      in an elastic job its place in ``kv.members``: call it again after a barrier);
    - ``contiguous=True``: one block of consecutive indices per worker, for data read
      in order with state carried from batch to batch (a language model's stream);
    - ``shuffle=True``: the indices are first permuted by a generator seeded with
      ``seed`` and ``epoch``, the same on every worker (``DistributedSampler`` with
      ``set_epoch``): pass the epoch to reshuffle every epoch. Returns a list then.

    Example::

        for epoch in range(epochs):
            mine = torch.utils.data.Subset(dataset, kvstore.torch.shard(dataset, kv, shuffle=True, epoch=epoch))
            for x, y in torch.utils.data.DataLoader(mine, batch_size=64):
                ...
    """
    n = n_items if isinstance(n_items, int) and not isinstance(n_items, bool) else len(n_items)
    if n < 0:
        raise InvalidArgumentError(f"shard: n_items must be >= 0, got {n}")
    # in an elastic job ranks may have gaps: this worker's place among the members
    workers, place = len(kv.members), kv.members.index(kv.rank)
    per = n // workers
    mine = range(place * per, (place + 1) * per) if contiguous else range(place, per * workers, workers)
    if not shuffle:
        return mine
    order = torch.randperm(n, generator=torch.Generator().manual_seed(int(seed) * 1_000_003 + int(epoch)))
    return order[list(mine)].tolist()
