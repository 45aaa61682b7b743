"""Lightning integration: :class:`KVStoreStrategy`, a strategy for
``lightning.Trainer(strategy=...)`` that trains a LightningModule through the
parameter servers (``pip install 'kvstore[lightning]'``; Lightning 2.x, the
``lightning`` package).

The gradient exchange is :class:`kvstore.torch.Trainer`'s (buckets of gradients
pushed by post-accumulate-grad hooks while backward runs), held by the strategy:

- ``update_on_kvstore=False`` (the default): the servers sum; every worker's
  ``.grad`` gets the average over the workers and the LightningModule's own torch
  optimizer steps on it, as with DDP.
- ``update_on_kvstore=True``: the servers run the optimizer, the
  LightningModule's torch optimizer (SGD, Adam, AdamW, RMSprop, Adagrad or
  Adadelta) by its twin, torch's own step on the servers
  (:func:`kvstore.torch.optimizer_from_torch`; what a torch scheduler changes in any
  param group is followed; Lightning's checkpoints keep the servers' optimizer state,
  in torch's format, and resuming sends it back; the precision plugin's GradScaler
  and ``gradient_clip_val`` act on the servers, for the whole model);
  the workers push gradients and pull the new weights.

The processes come from our launchers or torch's: ``python -m tracker.local -n 2
-s 2 python train.py`` or ``torchrun --nproc-per-node 2 train.py``. Ranks, world
size and the data sampler's shard come from the store; ``barrier`` is the store's.
Lightning's small collectives (``reduce`` and ``all_gather`` of logged metrics,
torchmetrics' state sync, ``broadcast`` of paths and decisions) gather a few bytes
from every worker with :meth:`kv.allgather_bytes <kvstore.worker.store.KVStore.allgather_bytes>`:
through the job's scheduler, whose control channel authenticates every peer with
the job's secret, in both update modes. The strategy listens on no socket of its
own. Objects travel as msgpack (no pickle): None, bool, int, float, str, bytes,
lists, dicts, paths and tensors.

Importing this module registers the strategy with Lightning by name, as DDP's
``"ddp"``: ``strategy="kvstore"`` (``dist_sync``, the workers update) and
``strategy="kvstore_update_on_kvstore"`` (``dist_sync``, the servers update), which
LightningCLI takes as ``--trainer.strategy=kvstore`` (the script imports
``kvstore.lightning``).

Example::

    import lightning as L
    from kvstore.lightning import KVStoreStrategy

    trainer = L.Trainer(strategy=KVStoreStrategy("dist_sync"), accelerator="cpu", max_epochs=2)
    # or, by its registered name: L.Trainer(strategy="kvstore", ...)
    trainer.fit(MyLightningModule(), train_dataloaders=loader)
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import torch

try:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.optimizer import _optimizers_to_device
    from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities import GradClipAlgorithmType
    from lightning.pytorch.utilities.model_helpers import is_overridden
    from lightning.pytorch.utilities import rank_zero as _pl_rank_zero
    from lightning_utilities.core import rank_zero as _utils_rank_zero
except ImportError as e:   # the optional extra
    raise ImportError("kvstore.lightning needs Lightning 2.x: pip install 'kvstore[lightning]' "
                      "(or pip install lightning)") from e

from . import create as _create_store
from .errors import ArgumentTypeError, InvalidArgumentError
from .worker.store import KVStore
from .torch import Trainer

__all__ = ["KVStoreStrategy"]

log = logging.getLogger(__name__)

_EXT_TENSOR, _EXT_PATH = 1, 2


class KVStoreStrategy(ParallelStrategy):
    """Train a LightningModule through a KVStore.

    ``kvstore``: a store type for :func:`kvstore.create` (``"dist_sync"``,
    ``"dist_device_sync"``, ``"dist_async"``, ``"local"``...), created when the
    Lightning Trainer is built, or a store you created. ``update_on_kvstore``:
    whether the servers run the optimizer (the module's torch optimizer by its twin,
    every param group with its hyper-parameters: kvstore.optimizer.torch_twin) or the workers run the module's torch optimizer on the
    averaged gradients (any optimizer; the servers only sum, so a synchronous
    store). ``bucket_bytes`` (default: sized by the model), ``overlap``: as
    :class:`kvstore.torch.Trainer` (with ``accumulate_grad_batches > 1`` the backward
    passes before an optimizer step run in the Trainer's ``no_sync()``, as under DDP:
    the exchange overlaps the last one's). ``timeout``: seconds Lightning's
    collectives wait for every worker (default: the store's KVSTORE_TIMEOUT).

    Mixed precision and clipping with the servers updating: the precision plugin's
    GradScaler (``precision="16-mixed"``; on a CPU, whose ``"16-mixed"`` Lightning
    turns into ``"bf16-mixed"``, ``plugins=[MixedPrecision("16-mixed", "cpu")]``) and
    ``L.Trainer(gradient_clip_val=max_norm)`` become the exchange's ``grad_scaler``
    and ``clip_grad_norm``: the servers unscale the averaged gradient, clip it by the
    whole model's norm and step, or skip the step on every worker, and the scaler
    backs off as under DDP.

    Raises InvalidArgumentError at ``fit`` for what it cannot do: more than one
    optimizer; with the servers updating, ``gradient_clip_algorithm="value"``, an
    overridden ``configure_gradient_clipping`` and a gradient scaler with manual
    optimization (the servers apply the gradients when backward ends, before any of
    them could act).
    """

    strategy_name = "kvstore"

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        """Lightning's hook for naming a strategy (DDPStrategy registers "ddp" so):
        ``"kvstore"`` and ``"kvstore_update_on_kvstore"``, both on ``dist_sync``."""
        strategy_registry.register(cls.strategy_name, cls, description="kvstore's parameter servers (dist_sync); "
                                   "the workers run the module's optimizer on the averaged gradients",
                                   override=True)
        strategy_registry.register(f"{cls.strategy_name}_update_on_kvstore", cls,
                                   description="kvstore's parameter servers (dist_sync) run the module's torch optimizer",
                                   override=True, update_on_kvstore=True)

    def __init__(self, kvstore: str | KVStore = "dist_sync", *, update_on_kvstore: bool = False,
                 bucket_bytes: int | None = None, overlap: bool = True, timeout: float | None = None,
                 accelerator: pl.accelerators.Accelerator | None = None,
                 parallel_devices: list[torch.device] | None = None,
                 checkpoint_io=None, precision_plugin=None) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        if not isinstance(kvstore, (str, KVStore)):
            raise ArgumentTypeError("KVStoreStrategy: kvstore must be a store type (e.g. 'dist_sync') "
                                    f"or a kvstore store, got {type(kvstore).__name__}")
        if not isinstance(update_on_kvstore, bool):
            raise ArgumentTypeError(f"KVStoreStrategy: update_on_kvstore must be True or False, "
                                    f"got {update_on_kvstore!r}")
        self._store_spec = kvstore
        self._kv: KVStore | None = kvstore if isinstance(kvstore, KVStore) else None
        self.update_on_kvstore = update_on_kvstore
        self._bucket_bytes = bucket_bytes
        self._overlap = overlap
        if timeout is not None and not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
                                        and timeout > 0):
            raise ArgumentTypeError(f"KVStoreStrategy: timeout must be a number of seconds > 0, got {timeout!r}")
        self._timeout = None if timeout is None else float(timeout)   # None: the store's KVSTORE_TIMEOUT
        self._exchange: Trainer | None = None
        self._servers_step: _ServersStep | None = None     # the optimizer as Lightning steps it, servers updating

    # -- the store and the job ---------------------------------------------------------
    @property
    def kv(self) -> KVStore:
        """The store (created on first use from the type given)."""
        if self._kv is None:
            store = _create_store(str(self._store_spec))
            if not isinstance(store, KVStore):
                raise ArgumentTypeError(f"KVStoreStrategy needs one of kvstore's own store types, "
                                        f"not the registered {type(store).__name__}")
            self._kv = store
        return self._kv

    @property
    def exchange(self) -> Trainer | None:
        """The :class:`kvstore.torch.Trainer` exchanging the gradients during ``fit``."""
        return self._exchange

    @property
    def is_distributed(self) -> bool:   # Lightning then adds a DistributedSampler
        return True

    @property
    def global_rank(self) -> int:
        return self.kv.rank

    @property
    def world_size(self) -> int:
        return self.kv.num_workers

    @property
    def local_rank(self) -> int:
        # a store that knows the workers of its host says; else the launcher's LOCAL_RANK
        local = getattr(self.kv, "local_rank", None)
        return local if isinstance(local, int) else super().local_rank

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        return devices[self.local_rank % len(devices)]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        members = list(self.kv.members)        # ranks may have gaps in an elastic job
        return {"num_replicas": len(members), "rank": members.index(self.kv.rank)}

    def set_world_ranks(self) -> None:
        """Called while the Lightning Trainer is built: joins the job (creates the
        store) and makes Lightning's rank-zero utilities follow its rank."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.global_rank)
            self.cluster_environment.set_world_size(self.world_size)
        rank = self.global_rank
        _pl_rank_zero.rank_zero_only.rank = _utils_rank_zero.rank_zero_only.rank = rank  # type: ignore[attr-defined]

    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # -- training ------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            self._start_exchange(trainer)
        self._connect_metrics()

    def _connect_metrics(self) -> None:
        """Make the module's torchmetrics metrics synchronise through the store: they
        gather their states with torch.distributed, which this strategy does not start,
        and would otherwise compute each worker's own value without a word. Metrics
        given their own ``dist_sync_fn`` or ``distributed_available_fn`` are left alone."""
        try:
            from torchmetrics import Metric
            from torchmetrics.metric import jit_distributed_available
        except ImportError:       # no torchmetrics: nothing to connect
            return
        if self.model is None:
            return
        for module in self.model.modules():
            if isinstance(module, Metric) and module.dist_sync_fn is None \
                    and module.distributed_available_fn is jit_distributed_available:
                module.dist_sync_fn = self._metric_gather
                module.distributed_available_fn = self._metrics_distributed

    def _metrics_distributed(self) -> bool:
        return self.world_size > 1

    def _metric_gather(self, tensor: torch.Tensor, group: Any | None = None) -> list[torch.Tensor]:
        """torchmetrics' ``dist_sync_fn``: every worker's ``tensor`` (their shapes may
        differ, as a ``CatMetric``'s do), in rank order, on ``tensor``'s device."""
        parts = [_decode(b) for b in self._gather(_encode(tensor.detach()))]
        return [p.to(tensor.device) for p in parts]

    def _start_exchange(self, trainer: pl.Trainer) -> None:
        if self._exchange is not None:
            raise InvalidArgumentError(
                "KVStoreStrategy runs one fit(): the model's keys are on the servers already; "
                "use a new strategy and job for another fit (validate/test/predict are fine)")
        if len(self.optimizers) != 1:
            raise InvalidArgumentError(
                f"KVStoreStrategy exchanges the gradients of one optimizer per step; "
                f"configure_optimizers returned {len(self.optimizers)}")
        clip, scaler = self._servers_clip_and_scaler(trainer) if self.update_on_kvstore else (None, None)
        module = self.lightning_module
        assert module is not None
        try:
            self._exchange = Trainer(module.named_parameters(), self.kv, self.optimizers[0],
                                     update_on_kvstore=self.update_on_kvstore,
                                     bucket_bytes=self._bucket_bytes, overlap=self._overlap,
                                     clip_grad_norm=clip, grad_scaler=scaler)
        except InvalidArgumentError as e:
            if clip is None and scaler is None:
                raise
            given = [f"gradient_clip_val={clip} as clip_grad_norm"] if clip is not None else []
            given += ["the precision plugin's GradScaler as grad_scaler"] if scaler is not None else []
            raise InvalidArgumentError(f"KVStoreStrategy (servers updating) gave kvstore.torch.Trainer "
                                       f"{' and '.join(given)}: {e}") from None
        self._servers_step = _ServersStep(self.optimizers[0]) if self.update_on_kvstore else None

    def _servers_clip_and_scaler(self, trainer: pl.Trainer) -> tuple[float | None, Any]:
        """Servers updating: what Lightning's settings ask of the servers, for
        :class:`kvstore.torch.Trainer`'s ``clip_grad_norm`` and ``grad_scaler``: the
        clip value (``L.Trainer(gradient_clip_val=...)``, by the norm; None without)
        and the precision plugin's GradScaler (``MixedPrecision.scaler``:
        ``precision="16-mixed"`` on a GPU, or ``plugins=[MixedPrecision("16-mixed",
        "cpu")]``; None without). Raises InvalidArgumentError, naming the option, for
        what the servers cannot do: they clip the whole model's averaged gradient by
        its norm when backward ends, before any hook of the worker could change it."""
        module = self.lightning_module
        assert module is not None
        scaler = getattr(self.precision_plugin, "scaler", None)
        clip_val = trainer.gradient_clip_val
        algorithm = trainer.gradient_clip_algorithm or GradClipAlgorithmType.NORM
        if is_overridden("configure_gradient_clipping", module):
            raise InvalidArgumentError(
                f"{type(module).__name__}.configure_gradient_clipping is overridden, but with the servers updating "
                "(update_on_kvstore=True) they apply the gradients when backward ends, before that hook runs; "
                "clip with L.Trainer(gradient_clip_val=max_norm) (by the norm, on the servers), or let the workers "
                "update (strategy='kvstore')")
        if clip_val and algorithm == GradClipAlgorithmType.VALUE:
            raise InvalidArgumentError(
                "gradient_clip_algorithm='value' with the servers updating (update_on_kvstore=True): the servers "
                "clip by the whole model's norm only (gradient_clip_algorithm='norm'); let the workers update "
                "(strategy='kvstore') to clip by value")
        if scaler is not None and not module.automatic_optimization:
            raise InvalidArgumentError(
                "a gradient scaler (precision='16-mixed') with manual optimization (automatic_optimization=False) "
                "and the servers updating (update_on_kvstore=True): the servers unscale when each manual_backward "
                "ends, so the loop's own unscaling and clipping would be lost; use automatic optimization, "
                "'bf16-mixed' (no scaler), or let the workers update (strategy='kvstore')")
        return (float(clip_val) if clip_val else None), scaler

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any],
                       model=None, **kwargs: Any) -> Any:
        """The closure (forward, backward: the hooks start the exchange) runs inside the
        optimizer's step, as Lightning does it; the exchange finishes right after it.
        Workers updating: the module's optimizer then steps on the averaged gradients
        (after Lightning's clipping and unscaling). Servers updating: the parameters
        then hold the servers' new weights (unscaled, clipped and stepped there, or
        the step skipped on an overflow: :meth:`Trainer.step
        <kvstore.torch.Trainer.step>` gives the precision plugin's scaler that verdict
        before the plugin's ``scaler.step`` and ``scaler.update()``), and the torch
        optimizer does not step."""
        exchange = self._exchange
        if exchange is None:
            raise InvalidArgumentError("KVStoreStrategy.optimizer_step outside fit()")
        if self.update_on_kvstore:
            stand_in = self._servers_step
            assert stand_in is not None and stand_in.optimizer is optimizer

            def then_step():
                result = closure()
                owner = model if model is not None else self.lightning_module
                if result is None and getattr(owner, "automatic_optimization", True):
                    # training_step returned None: no backward and, with a scaler,
                    # no scaler.step or update() after (Lightning skips them); the
                    # round still completes (zeros), as every worker's must
                    exchange.allreduce_grads()
                else:
                    exchange.step()      # the servers' new weights; their skip verdict to the scaler
                return result
            return super().optimizer_step(stand_in, then_step, model, **kwargs)  # type: ignore[arg-type]

        def then_average():
            result = closure()
            exchange.allreduce_grads()
            return result
        return super().optimizer_step(optimizer, then_average, model, **kwargs)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """What Lightning's checkpoints keep of the optimizer: with the servers
        updating, their state in torch's format (:meth:`Trainer.state_dict`), which
        the module's torch optimizer does not hold; else the optimizer's own."""
        if self.update_on_kvstore and self._exchange is not None:
            return self._exchange.state_dict()
        return super().optimizer_state(optimizer)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Resuming from a Lightning checkpoint: with the servers updating, its
        optimizer state goes to the servers (:meth:`Trainer.load_state_dict`, every
        worker together); else into the module's optimizer, as Lightning's own."""
        if self.update_on_kvstore:
            if self._exchange is None:      # the servers would never see it
                raise InvalidArgumentError("KVStoreStrategy: an optimizer state to load before fit() set up the "
                                           "exchange; the servers hold it with update_on_kvstore=True")
            self._exchange.load_state_dict(checkpoint["optimizer_states"][0])
            return
        super().load_optimizer_state_dict(checkpoint)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Accumulating (``accumulate_grad_batches > 1``), Lightning runs the backward
        passes before an optimizer step in here: the Trainer's ``no_sync()``, as DDP's
        strategy uses DDP's, so they are summed locally and exchanged with the last."""
        if self._exchange is None:
            yield None
            return
        with self._exchange.no_sync():
            yield None

    def teardown(self) -> None:
        if self._exchange is not None:
            self._exchange.close()      # the hooks go; the keys stay on the servers
        super().teardown()

    def close(self) -> None:
        """Close the store if this strategy created it (otherwise it closes at exit)."""
        if self._exchange is not None:
            self._exchange.close()
        if self._kv is not None and not isinstance(self._store_spec, KVStore):
            self._kv.close()

    # -- Lightning's collectives --------------------------------------------------------
    def barrier(self, name: str | None = None) -> None:
        self.kv.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of the worker ``src`` (msgpack types, paths, tensors) on every worker."""
        if self.world_size == 1:
            return obj
        place = self._place()
        sent = _encode(obj) if place == src else b""
        return _decode(self._gather(sent)[src])

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """The sum, mean, max or min of ``tensor`` over the workers (a non-tensor is
        returned as it is, as DDP does); a tensor of the same dtype and device."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        op = _op_name(reduce_op)
        if self.world_size == 1:
            return tensor
        stacked = self._gather_tensors(tensor)
        if op == "sum":
            out = stacked.sum(0)
        elif op == "mean":
            out = stacked.sum(0) / len(stacked)
        elif op == "max":
            out = stacked.amax(0)
        else:
            out = stacked.amin(0)
        return out.to(dtype=tensor.dtype, device=tensor.device)

    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        """Every worker's ``tensor`` stacked: shape ``(world_size, *tensor.shape)``."""
        if sync_grads:
            raise InvalidArgumentError("KVStoreStrategy.all_gather: sync_grads=True (gradients "
                                       "through the gather) is not supported")
        if self.world_size == 1:
            return tensor.unsqueeze(0)
        return self._gather_tensors(tensor).to(tensor.device)

    def _gather_tensors(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [_decode(b) for b in self._gather(_encode(tensor.detach()))]
        if any(p.shape != tensor.shape for p in parts):
            raise InvalidArgumentError(f"reduce/all_gather: the workers' tensors differ in shape: "
                                       f"{[tuple(p.shape) for p in parts]}")
        return torch.stack(parts)

    def _place(self) -> int:
        return list(self.kv.members).index(self.kv.rank)

    def _gather(self, data: bytes) -> list[bytes]:
        """Every worker's ``data``, in the order of the store's members: the store's
        all-gather, over the scheduler's authenticated channel (not the servers, which
        may run an optimizer, nor a socket of the strategy's own)."""
        return self.kv.allgather_bytes(data, timeout=self._timeout)


class _ServersStep:
    """Stands for the module's torch optimizer while the servers update, in what
    Lightning's precision plugin does with it: ``step(closure)`` only runs the
    closure (forward, backward, whose hooks push the gradients, then
    :meth:`Trainer.step <kvstore.torch.Trainer.step>`, which waits for the servers'
    new weights and hands a GradScaler their skip verdict); the torch optimizer
    itself never steps. Everything else is the optimizer's: ``param_groups`` (read by
    Lightning's hooks; with ``"16-mixed"`` the plugin's ``scaler.unscale_`` and the
    clipping of ``gradient_clip_val`` act on this worker's own ``.grad``, after the
    servers used the gradients as pushed, which changes nothing on the servers)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        return closure() if closure is not None else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


# -- objects as bytes (msgpack, no pickle) ------------------------------------------------
def _default(obj: Any) -> msgpack.ExtType:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        header = msgpack.packb([str(t.dtype).removeprefix("torch."), list(t.shape)])
        return msgpack.ExtType(_EXT_TENSOR, header + t.reshape(-1).view(torch.uint8).numpy().tobytes())
    if isinstance(obj, pathlib.PurePath):
        return msgpack.ExtType(_EXT_PATH, str(obj).encode())
    raise ArgumentTypeError(f"KVStoreStrategy.broadcast: cannot send a {type(obj).__name__} "
                            "(None, bool, int, float, str, bytes, lists, dicts, paths and tensors can)")


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _EXT_PATH:
        return pathlib.Path(data.decode())
    if code == _EXT_TENSOR:
        unpacker = msgpack.Unpacker()
        unpacker.feed(data)
        dtype_name, shape = next(unpacker)
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise InvalidArgumentError(f"a gathered tensor has an unknown dtype {dtype_name!r}")
        raw = bytearray(data[unpacker.tell():])
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(shape)
    return msgpack.ExtType(code, data)


def _encode(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def _decode(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)


def _op_name(reduce_op: Any) -> str:
    """'sum', 'mean', 'max' or 'min' from Lightning's reduce_op (a str or a ReduceOp)."""
    name = reduce_op if isinstance(reduce_op, str) else str(getattr(reduce_op, "name", reduce_op))
    name = name.lower().rsplit(".", 1)[-1]
    name = {"avg": "mean", "none": "mean"}.get(name, name)
    if name not in ("sum", "mean", "max", "min"):
        raise InvalidArgumentError(f"KVStoreStrategy.reduce: reduce_op {reduce_op!r} is not one of "
                                   "sum, mean, max, min")
    return name


KVStoreStrategy.register_strategies(StrategyRegistry)
