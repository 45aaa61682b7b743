"""The training loop shared by train_mnist.py, train_cifar10.py and train_sparse.py,
after MXNet's example/image-classification/common/fit.py: the same flags, the same
log lines.

Flags: :func:`add_fit_args` adds fit.py's flags that the training loop applies
(:func:`train_epochs`, :func:`make_optimizer`), with MXNet's defaults, plus ours
(``--opt-param``, ``--seed``, ``--async-lr-scale``); :func:`add_fit_job_args` adds
those only :func:`fit` applies (``--initializer``, ``--gc-type``, ``--gc-threshold``,
the profile suffixes, ``--test-io``, ``--use-imagenet-data-augmentation``).
:func:`check_fit_args` turns a value this code cannot honour into a
:class:`UsageError`; :func:`usage_errors` turns those (and the library's argument
errors) into exit status 1 with a message.

Log lines (MXNet's format, so existing tools read them; plus communication)::

    Epoch[0] Batch [20]\tSpeed: 1234.56 samples/sec\taccuracy=0.500000
    Epoch[0] Train-accuracy=0.900000
    Epoch[0] Time cost=12.300
    Epoch[0] Comm-sent-bytes=123456789
    Epoch[0] Comm-received-bytes=123456789
    Epoch[0] Validation-accuracy=0.880000

``--top-k K`` adds ``top_k_accuracy_K`` and ``--loss ce,nll`` adds ``cross-entropy``
and ``nll-loss`` to each of the Batch, Train- and Validation- lines, as MXNet's
metrics of those names.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import re
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

import kvstore
import kvstore.torch as kvtorch
from kvstore import optimizer as kvopt
from kvstore.fileio import atomic_write
from initializers import INITIALIZERS, initialize
from monitor import Monitor
from profiling import Profiling, server_label

log = logging.getLogger("fit")

MOMENTUM_OPTIMIZERS = ("sgd", "dcasgd", "nag", "signum", "lbsgd")   # fit.py's has_momentum
WARMUP_OPTIMIZERS = ("lbsgd",)   # fit.py's has_warmup; its 'lbnag' is an optimizer MXNet does not have
DTYPES = ("float32", "float16")
LOSSES = {"ce": "cross-entropy", "nll_loss": "nll-loss"}            # fit.py's supported_loss


class UsageError(Exception):
    """A flag value this script cannot honour (the message names the flag)."""


@contextlib.contextmanager
def usage_errors():
    """Turn a :class:`UsageError`, a ValueError (the library's ConfigError and
    InvalidArgumentError are ones), a missing file or a wrong argument type raised
    inside into ``SystemExit``: exit status 1 and ``<script>: error: <message>`` on
    stderr, with no traceback. For setting a job up, not for the training loop."""
    try:
        yield
    except (UsageError, ValueError, FileNotFoundError, NotADirectoryError, kvstore.ArgumentTypeError) as e:
        raise SystemExit(f"{_prog()}: error: {e}") from None


def _prog() -> str:
    return os.path.basename(sys.argv[0] or "train")


def add_fit_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """fit.py's training flags with MXNet's defaults, and ours. Returns ``parser``."""
    train = parser.add_argument_group("Training", "model training")
    add = train.add_argument
    add("--network", type=str, help="the neural network to use")
    add("--num-layers", type=int, help="number of layers (resnet: 20/56/110, vgg: 11/13/16/19)")
    add("--gpus", type=str, help="list of gpus to run, e.g. 0 or 0,2,5 (several: the batch is split among "
        "them); empty means using cpu")
    add("--kv-store", "--kvstore", dest="kvstore", type=str, default="device",
        help="local, device, dist_sync, dist_async, dist_ssp, dist_device_sync (or dist_sync_device)")
    add("--num-epochs", type=int, default=100, help="max num of epochs")
    add("--lr", type=float, default=0.1, help="initial learning rate")
    add("--lr-factor", type=float, default=0.1, help="the ratio to reduce lr on each step (>= 1: no schedule)")
    add("--lr-step-epochs", type=str, help="the epochs to reduce the lr, e.g. 30,60; or powN, e.g. pow2: "
        "polynomial decay of power N to 0 at the last epoch")
    add("--optimizer", type=str, default="sgd", help=f"the optimizer type: {', '.join(kvopt.registered())}")
    add("--mom", type=float, default=0.9, help=f"momentum for {', '.join(MOMENTUM_OPTIMIZERS)}")
    add("--wd", type=float, default=0.0001, help="weight decay")
    add("--batch-size", type=int, default=128, help="the batch size of each worker")
    add("--disp-batches", type=int, default=20, help="show progress for every n batches")
    add("--model-prefix", type=str, help="save the model and the optimizer states here")
    add("--save-period", type=int, default=1, help="save every n epochs")
    add("--monitor", type=int, default=0, help="log the statistics of every layer's output, parameter "
        "and buffer every n batches if larger than 0")
    add("--load-epoch", type=int, help="resume from the checkpoint of this epoch (needs --model-prefix)")
    add("--top-k", type=int, default=0, help="report the top-k accuracy (k >= 2); 0 means no report")
    add("--loss", type=str, default="", help="also report these losses, comma-separated: ce "
        "(cross-entropy), nll or nll_loss (negative log-likelihood)")
    add("--dtype", type=str, default="float32", help="float32, or float16: mixed precision (float16 compute, "
        "float32 weights)")
    add("--macrobatch-size", type=int, default=0, help="lbsgd: the distributed effective batch size")
    add("--warmup-epochs", type=int, default=5, help="lbsgd: the epochs to ramp the lr up to the "
        "large-batch value")
    add("--warmup-strategy", type=str, default="linear", help="lbsgd: linear, power2, sqrt or lars")
    add("--opt-param", action="append", default=[], metavar="NAME=VALUE",
        help="another hyper-parameter of --optimizer, e.g. eta=0.02 for lars (repeatable)")
    add("--seed", type=int, default=0, help="random seed (data order, augmentation, initial weights)")
    # ours, beyond fit.py: a modern recipe's schedule and weight decay, run by the servers
    add("--lr-schedule", type=str, default="step", help="step: fit.py's (--lr-step-epochs, --lr-factor); "
        "cosine: from --lr to 0 over --num-epochs (ours, not MXNet's flag)")
    add("--lr-warmup-epochs", type=float, default=0.0, help="ramp the lr of --lr-schedule up from 0, "
        "linearly, over this many epochs (any optimizer; ours, not MXNet's flag)")
    add("--no-bias-decay", action="store_true", help="no weight decay on biases and normalisation "
        "parameters (1-d parameters: each key's wd_mult 0, keys named by the model's parameter names; "
        "ours, not MXNet's flag)")
    add("--async-lr-scale", type=float, default=None,
        help="dist_async and dist_ssp: multiply --lr by this (default 1/workers: each worker's "
             "gradient is applied as its own step, on weights up to a round stale)")
    return parser


def add_fit_job_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """fit.py's flags that :func:`fit` applies, with MXNet's defaults. Returns ``parser``."""
    job = parser.add_argument_group("Job", "set up by fit()")
    add = job.add_argument
    add("--initializer", type=str, default="default", help=f"the initializer type: {', '.join(INITIALIZERS)}")
    add("--gc-type", type=str, default="none", help="type of gradient compression: 2bit, 1bit, fp16 or none")
    add("--gc-threshold", type=float, default=0.5, help="threshold for 2bit gradient compression")
    add("--profile-worker-suffix", type=str, default="", help="profile each worker into this Chrome-trace "
        "file (rank<R>_ before its name when there are several workers)")
    add("--profile-server-suffix", type=str, default="", help="profile the servers; each writes "
        "server-<rank>-<this name>.prof into its KVSTORE_PROFILE_DIR")
    add("--test-io", type=int, default=0, help="1 means test reading speed without training")
    add("--use-imagenet-data-augmentation", type=int, default=0,
        help="MXNet: for train_imagenet.py only (no effect here, as in MXNet's other scripts)")
    return parser


def lr_steps(spec: str | None) -> tuple[str, float | list[int]]:
    """``--lr-step-epochs``: ``("pow", power)`` for ``pow2`` (also ``pow 2``, ``pow-0.5``),
    else ``("steps", [epochs])`` (empty for None or ''). Raises UsageError."""
    spec = (spec or "").strip()
    if "pow" in spec:
        try:
            return "pow", float(re.sub(r"pow[- ]*", "", spec))
        except ValueError:
            raise UsageError(f"--lr-step-epochs {spec!r}: expected powN, e.g. pow2") from None
    try:
        epochs = [int(e) for e in spec.split(",") if e.strip()]
    except ValueError:
        epochs = [0]
    if any(e < 1 for e in epochs) or epochs != sorted(set(epochs)):
        raise UsageError(f"--lr-step-epochs {spec!r}: expected increasing epochs >= 1, e.g. 30,60, or powN, "
                         f"e.g. pow2")
    return "steps", epochs


def loss_metrics(spec: str) -> list[str]:
    """``--loss``: the metric names of its entries (fit.py: ``nll`` is ``nll_loss``; an
    unknown one is skipped with MXNet's warning)."""
    names: list[str] = []
    for entry in (spec or "").split(","):
        entry = entry.strip()
        if not entry:
            continue
        entry = "nll_loss" if entry == "nll" else entry
        if entry not in LOSSES:
            log.warning("%s is not an valid loss type, only cross-entropy or negative likelihood loss is "
                        "supported!", entry)
        elif LOSSES[entry] not in names:
            names.append(LOSSES[entry])
    return names


def check_fit_args(args) -> None:
    """UsageError for a value of the flags of :func:`add_fit_args` and
    :func:`add_fit_job_args` (when added) that this code cannot honour."""
    if args.dtype not in DTYPES:
        raise UsageError(f"--dtype {args.dtype!r}: expected float32 or float16")
    if args.top_k == 1:
        raise UsageError("--top-k 1: that is the accuracy itself (MXNet's top_k_accuracy refuses it too); "
                         "use 0 for no report or k >= 2")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.load_epoch is not None and not args.model_prefix:
        raise UsageError("--load-epoch needs --model-prefix")
    kind, _ = lr_steps(args.lr_step_epochs)
    if args.lr_schedule not in ("step", "cosine"):
        raise UsageError(f"--lr-schedule {args.lr_schedule!r}: expected step or cosine")
    if not args.lr_warmup_epochs >= 0:
        raise UsageError(f"--lr-warmup-epochs must be >= 0, got {args.lr_warmup_epochs}")
    if args.lr_warmup_epochs and args.lr_schedule == "step" and args.lr_factor < 1 and kind == "pow":
        raise UsageError("--lr-warmup-epochs with --lr-step-epochs powN: use --lr-schedule cosine")
    parse_gpus(args.gpus)
    if getattr(args, "initializer", "default") not in INITIALIZERS:
        raise UsageError(f"--initializer {args.initializer!r}: expected one of {', '.join(INITIALIZERS)}")
    if getattr(args, "profile_server_suffix", ""):
        server_label(args.profile_server_suffix)


def lr_scheduler(args, updates_per_epoch: int, lr: float):
    """fit.py's ``_get_lr_scheduler``: none when ``--lr-factor >= 1``; for ``powN`` a
    PolyScheduler from ``lr`` to 0 over ``--num-epochs`` epochs; else a
    MultiFactorScheduler at ``--lr-step-epochs``. Its steps count the servers' updates
    since the start of training (a resumed run restores them), so a resumed run needs
    no shifted steps."""
    warmup = int(round(args.lr_warmup_epochs * updates_per_epoch))
    if args.lr_schedule == "cosine":
        return kvopt.CosineScheduler(max_update=max(1, args.num_epochs * updates_per_epoch), base_lr=lr,
                                     final_lr=0.0, warmup_steps=warmup, warmup_begin_lr=0.0)
    if warmup:
        # fit.py's step schedule (or none: factor 1) after the warm-up
        steps = [] if args.lr_factor >= 1 else lr_steps(args.lr_step_epochs)[1]
        assert isinstance(steps, list)       # check_fit_args refused powN with a warm-up
        return kvopt.MultiFactorScheduler(step=[e * updates_per_epoch for e in steps] or [10 ** 12],
                                          factor=args.lr_factor if steps else 1.0, base_lr=lr,
                                          warmup_steps=warmup, warmup_begin_lr=0.0)
    if args.lr_factor >= 1:
        return None
    kind, value = lr_steps(args.lr_step_epochs)
    if kind == "pow":
        return kvopt.PolyScheduler(max_update=args.num_epochs * updates_per_epoch, base_lr=lr, pwr=value)
    assert isinstance(value, list)
    if not value:
        return None
    return kvopt.MultiFactorScheduler(step=[e * updates_per_epoch for e in value], factor=args.lr_factor)


def make_optimizer(args, batches_per_epoch: int, kv=None, no_decay=()) -> kvopt.Optimizer:
    """The optimizer of --optimizer, --lr, --wd, --mom (for fit.py's momentum
    optimizers only), --opt-param and the lr schedule; lbsgd also gets fit.py's
    warm-up (--warmup-epochs, --warmup-strategy, and a batch_scale of
    ceil(--macrobatch-size / (--batch-size x workers))). With a ``kv`` whose servers
    apply each worker's push on its own (dist_async, dist_ssp), the schedule counts W
    updates per batch, and the learning rate is scaled by --async-lr-scale (default
    1/W; logged)."""
    updates_per_batch, lr = 1, args.lr
    one_by_one = kv is not None and (kv.type.startswith("dist_async") or
                                     (kv.type.startswith("dist_ssp") and kv.staleness != 0))
    if one_by_one and kv.num_workers > 1:
        updates_per_batch = kv.num_workers
        scale = 1.0 / kv.num_workers if args.async_lr_scale is None else args.async_lr_scale
        lr = args.lr * scale
        log.info("%s: learning rate %g x %g = %g (each worker's gradient is its own update; "
                 "--async-lr-scale to change)", kv.type, args.lr, scale, lr)
    updates_per_epoch = batches_per_epoch * updates_per_batch
    sched = lr_scheduler(args, updates_per_epoch, lr)
    name = args.optimizer.lower()
    extra: dict = {"momentum": args.mom} if name in MOMENTUM_OPTIMIZERS else {}
    if name in WARMUP_OPTIMIZERS:
        workers = kv.num_workers if kv is not None else 1
        macrobatch = max(args.macrobatch_size, args.batch_size * workers)
        # begin_epoch stays 0: each key's update count, which LBSGD adds it to, comes back
        # from the checkpoint of a resumed run (MXNet's restarts from 0, so it adds it)
        extra.update(updates_per_epoch=max(1, updates_per_epoch), begin_epoch=0,
                     batch_scale=math.ceil(macrobatch / args.batch_size / workers),
                     warmup_strategy=args.warmup_strategy, warmup_epochs=args.warmup_epochs,
                     num_epochs=args.num_epochs)
    extra.update(opt_params(args.opt_param))
    if no_decay:              # --no-bias-decay: these keys (parameter names) get wd_mult 0
        extra["wd_mult"] = {**extra.get("wd_mult", {}), **{key: 0.0 for key in no_decay}}
    return kvopt.create(name, learning_rate=lr, wd=args.wd, lr_scheduler=sched, **extra)


def opt_params(pairs: list) -> dict:
    """``NAME=VALUE`` strings as hyper-parameters: numbers, true/false, none, or text."""
    params = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"--opt-param: expected NAME=VALUE, got {pair!r}")
        low = text.strip().lower()
        if low in ("true", "false"):
            params[name] = low == "true"
        elif low == "none":
            params[name] = None
        else:
            try:
                params[name] = int(text) if low.lstrip("-").isdigit() else float(text)
            except ValueError:
                params[name] = text
    return params


class EvalMetrics:
    """MXNet's metrics of fit.py over the batches seen since :meth:`reset`: ``accuracy``,
    ``top_k_accuracy_K`` (``top_k`` >= 2; K at most the number of classes counts every
    sample), and the losses of :func:`loss_metrics` (``cross-entropy``, ``nll-loss``:
    the mean of -log(softmax[label] + 1e-12), as MXNet's)."""

    def __init__(self, top_k: int = 0, losses: list[str] | None = None):
        self.top_k = top_k if top_k >= 2 else 0
        self.losses = list(losses or [])
        self.reset()

    def reset(self) -> None:
        self.seen = self.correct = self.top = 0
        self.nll = 0.0

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        with torch.no_grad():
            logits, labels = logits.detach().float(), labels.to(logits.device)
            self.correct += int((logits.argmax(1) == labels).sum())
            if self.top_k:
                top = logits.topk(min(self.top_k, logits.shape[1]), dim=1).indices
                self.top += int((top == labels[:, None]).any(1).sum())
            if self.losses:
                prob = logits.softmax(1).gather(1, labels[:, None])[:, 0]
                self.nll += float(-(prob + 1e-12).log().sum())
            self.seen += len(labels)

    def name_values(self) -> list[tuple[str, float]]:
        n = max(self.seen, 1)
        values = [("accuracy", self.correct / n)]
        if self.top_k:
            values.append((f"top_k_accuracy_{self.top_k}", self.top / n))
        values += [(name, self.nll / n) for name in self.losses]
        return values


def new_metrics(args) -> EvalMetrics:
    return EvalMetrics(getattr(args, "top_k", 0), loss_metrics(getattr(args, "loss", "")))


def compute_precision(device: torch.device, dtype: str):
    """The context of a forward pass: ``--dtype float16`` runs it under autocast
    (float16 compute, float32 weights, as MXNet's float16 symbols with
    multi_precision); float32 as it is."""
    if dtype == "float16":
        return torch.autocast(device.type, dtype=torch.float16)
    return contextlib.nullcontext()


def _atomic_save(obj, path: str) -> None:
    with atomic_write(path) as f:
        torch.save(obj, f)


def checkpoint_paths(prefix: str, epoch: int) -> tuple[str, str]:
    return f"{prefix}-{epoch:04d}.params", f"{prefix}-{epoch:04d}.states"


class Speedometer:
    """MXNet's Speedometer: samples/sec and the running metrics every `frequent` batches."""

    def __init__(self, batch_size: int, frequent: int):
        self.batch_size, self.frequent = batch_size, frequent
        self.tic = time.time()

    def __call__(self, epoch: int, nbatch: int, metrics: EvalMetrics) -> None:
        if self.frequent > 0 and nbatch % self.frequent == 0:
            speed = self.frequent * self.batch_size / max(time.time() - self.tic, 1e-9)
            values = metrics.name_values()
            log.info("Epoch[%d] Batch [%d]\tSpeed: %.2f samples/sec" + "\t%s=%f" * len(values),
                     epoch, nbatch, speed, *[v for pair in values for v in pair])
            self.tic = time.time()


def fit(args, model: torch.nn.Module, train_batches, val_batches, num_train_samples: int,
        epoch_size: Callable[[int], int] | None = None) -> float | None:
    """Train ``model``. ``train_batches(epoch, rank, num_workers)`` yields (x, y) of
    this worker's shard, the same number on every worker; ``val_batches()`` yields
    the validation set (None: no validation). ``epoch_size(num_workers)``: the batches
    per epoch of each worker, which ``train_batches`` yields and the lr schedule counts
    (default: a worker's share of ``num_train_samples``, rounded down to whole batches). Applies :func:`add_fit_job_args`' flags
    where the parser has them (gradient compression, profiling, --initializer,
    --test-io). Returns the last validation accuracy (nan without validation; None
    with --test-io)."""
    with usage_errors():
        check_fit_args(args)
        device = get_device(args)
        kv = kvstore.create(args.kvstore)
    assert isinstance(kv, kvstore.KVStore)   # a built-in store type
    log.info("start with arguments %s", args)
    with usage_errors():
        if getattr(args, "gc_type", "none") != "none":
            kv.set_gradient_compression({"type": args.gc_type, "threshold": args.gc_threshold})
            log.info("gradient compression: %s, threshold %g", args.gc_type, args.gc_threshold)
        profiling = Profiling.from_args(args, kv, device)
    if epoch_size is not None:
        steps_per_epoch = epoch_size(kv.num_workers)
        if "dist" in kv.type and "async" not in kv.type:
            log.info("Resizing training data to %d batches per machine", steps_per_epoch)
    else:
        steps_per_epoch = batches_per_epoch(num_train_samples, args.batch_size, kv.num_workers)
    with usage_errors():
        if steps_per_epoch < 1:
            raise UsageError(f"an epoch of {num_train_samples} images is no batch of {args.batch_size} for "
                             f"each of {kv.num_workers} workers")
    if getattr(args, "test_io", 0):
        test_io(args, kv, train_batches, device)
        kv.close()
        return None
    if getattr(args, "initializer", None) is not None:
        initialize(model, args.initializer, args.network)
    model.to(device)
    net = on_gpus(model, args)
    begin = 0
    if args.load_epoch is not None:
        params_path, _ = checkpoint_paths(args.model_prefix, args.load_epoch)
        model.load_state_dict(torch.load(params_path, map_location=device, weights_only=True))
        begin = args.load_epoch
        log.info("resumed from %s", params_path)
    with usage_errors():
        if args.no_bias_decay:      # keys are the parameters' names, so that wd_mult can name them
            no_decay = [n for n, p in model.named_parameters() if p.ndim == 1]
            trainer = kvtorch.Trainer(model.named_parameters(), kv,
                                      make_optimizer(args, steps_per_epoch, kv, no_decay))
            log.info("no weight decay on %d biases and normalisation parameters", len(no_decay))
        else:
            trainer = kvtorch.Trainer(model.parameters(), kv, make_optimizer(args, steps_per_epoch, kv))
    if args.load_epoch is not None:
        if kv.rank == 0:  # the servers' optimizer state, as saved at the end of that epoch
            trainer.load_states(checkpoint_paths(args.model_prefix, args.load_epoch)[1])
        kv.barrier()
    profiling.start()
    val_acc = train_epochs(args, kv, net, trainer, train_batches, val_batches, device, begin)
    profiling.stop()
    trainer.close()
    kv.close()
    return val_acc


def test_io(args, kv, train_batches, device) -> None:
    """fit.py's --test-io 1: read one epoch of this worker's batches (onto the device),
    logging the speed every --disp-batches batches, without training."""
    tic = time.time()
    place = kv.members.index(kv.rank)
    for i, (x, _) in enumerate(train_batches(0, place, kv.num_workers)):
        torch.as_tensor(x, device=device)
        if args.disp_batches > 0 and (i + 1) % args.disp_batches == 0:
            log.info("Batch [%d]\tSpeed: %.2f samples/sec", i,
                     args.disp_batches * args.batch_size / max(time.time() - tic, 1e-9))
            tic = time.time()


def train_epochs(args, kv, model: torch.nn.Module, trainer, train_batches, val_batches, device,
                 begin: int = 0, after_step=None) -> float:
    """The epoch loop of :func:`fit` (epochs ``begin`` .. ``args.num_epochs - 1``, its
    log lines and checkpoints: every --save-period epochs), for a script that builds
    its own store and Trainer; --dtype, --top-k, --loss and --monitor act here.
    ``after_step()`` runs after every ``trainer.step()``: a ShardedEmbedding's
    ``step``, which pushes the rows of the step's gradient. ``val_batches`` None: no
    validation. Returns the last validation accuracy (nan without validation)."""
    val_acc = float("nan")
    epoch, starting = begin, True
    dtype = getattr(args, "dtype", "float32")
    if dtype != "float32":
        log.info("mixed precision: %s compute (autocast), float32 weights and gradients", dtype)
    monitor = Monitor(model, args.monitor) if getattr(args, "monitor", 0) > 0 else None
    save_period = max(1, getattr(args, "save_period", 1))      # MXNet's do_checkpoint: at least 1
    metrics = new_metrics(args)
    while epoch < args.num_epochs:
        if kv.elastic:
            epoch = elastic_epoch(kv, trainer, epoch, starting, args.batch_size)
            if epoch >= args.num_epochs:
                break
        starting = False
        tic, stats0 = time.time(), kv.comm_stats()
        speedometer = Speedometer(args.batch_size, args.disp_batches)
        model.train()
        metrics.reset()
        place = kv.members.index(kv.rank)    # = kv.rank, unless an elastic job lost a worker
        for nbatch, (x, y) in enumerate(train_batches(epoch, place, kv.num_workers), start=1):
            x, y = torch.as_tensor(x, device=device), torch.as_tensor(y, device=device)
            if monitor is not None:
                monitor.tic()
            trainer.zero_grad()
            with compute_precision(device, dtype):
                out = model(x)
            F.cross_entropy(out.float(), y).backward()
            trainer.step()
            if after_step is not None:
                after_step()
            if monitor is not None:
                monitor.toc_print()
            metrics.update(out, y)
            speedometer(epoch, nbatch, metrics)
        stats = kv.comm_stats()
        for name, value in metrics.name_values():
            log.info("Epoch[%d] Train-%s=%f", epoch, name, value)
        log.info("Epoch[%d] Time cost=%.3f", epoch, time.time() - tic)
        log.info("Epoch[%d] Comm-sent-bytes=%d", epoch, stats["bytes_sent"] - stats0["bytes_sent"])
        log.info("Epoch[%d] Comm-received-bytes=%d", epoch, stats["bytes_received"] - stats0["bytes_received"])
        if val_batches is not None:
            val = evaluate(model, val_batches(), device, new_metrics(args), dtype)
            for name, value in val.name_values():
                log.info("Epoch[%d] Validation-%s=%f", epoch, name, value)
            val_acc = val.name_values()[0][1]
        if args.model_prefix and (epoch + 1) % save_period == 0:
            kv.barrier()          # every worker's pushes of this epoch are applied
            if kv.rank == kv.members[0]:
                params_path, states_path = checkpoint_paths(args.model_prefix, epoch + 1)
                _atomic_save(getattr(model, "module", model).state_dict(), params_path)   # unwrapped: on_gpus
                trainer.save_states(states_path)
                log.info("Saved checkpoint to %s", params_path)
            kv.barrier()
        epoch += 1
    if kv.elastic and not starting:
        kv.save_progress({"epoch": args.num_epochs})   # a worker joining now has nothing to do
    if monitor is not None:
        monitor.close()
    return val_acc


def elastic_epoch(kv, trainer, epoch: int, starting: bool, batch_size: int) -> int:
    """The start of an epoch of an elastic job (docs/elastic.md): the members
    record the epoch, then a barrier gives every worker the same members to shard
    the data by. A worker that joined the running job meets the others at that
    barrier, takes their epoch and copies their weights. Returns the epoch to run."""
    joining = starting and kv.joined
    if not joining:     # every member (one that was first may have left since the last barrier)
        kv.save_progress({"epoch": epoch})
    before = kv.members
    kv.barrier()
    if joining:
        epoch = int(kv.progress.get("epoch", epoch))
        trainer.pull_weights()
        log.info("joined the running job at epoch %d as worker %d of %s", epoch, kv.rank, list(kv.members))
    elif kv.members != before:
        log.info("Epoch[%d] workers %s (were %s): each takes 1/%d of the data, and a step's batch "
                 "is %d samples in all", epoch, list(kv.members), list(before), kv.num_workers,
                 kv.num_workers * batch_size)
    return epoch


def parse_gpus(text: str | None) -> list[int]:
    """``--gpus``: ``"0,2"`` -> [0, 2]; None or empty: [] (the CPU). Raises UsageError."""
    if text is None or not text.strip():
        return []
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"--gpus {text!r}: expected GPU ids, e.g. 0 or 0,1 (empty: the CPU)") from None
    if min(ids) < 0 or len(set(ids)) != len(ids):
        raise UsageError(f"--gpus {text!r}: expected distinct GPU ids >= 0")
    return ids


def get_device(args) -> torch.device:
    """The device of ``--gpus`` (its first GPU), or the CPU. Exits (status 1, a message)
    when a GPU asked for is not there."""
    ids = parse_gpus(args.gpus)
    if not ids:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit(f"{_prog()}: error: --gpus {args.gpus}: no CUDA device is available (empty: the CPU)")
    if max(ids) >= torch.cuda.device_count():
        raise SystemExit(f"{_prog()}: error: --gpus {args.gpus}: this machine has {torch.cuda.device_count()} "
                         f"GPU(s), numbered from 0")
    return torch.device(f"cuda:{ids[0]}")


def on_gpus(model: torch.nn.Module, args) -> torch.nn.Module:
    """``model`` (on the first GPU of --gpus) to run the forward with: with several
    GPUs, a ``torch.nn.DataParallel`` that splits each batch among them, as MXNet's
    module does with a list of contexts (the gradients add up on the first GPU, whose
    parameters the Trainer exchanges)."""
    ids = parse_gpus(args.gpus)
    return torch.nn.DataParallel(model, device_ids=ids) if len(ids) > 1 else model


def evaluate(model: torch.nn.Module, batches, device, metrics: EvalMetrics | None = None,
             dtype: str = "float32") -> EvalMetrics:
    """``metrics`` (a new accuracy-only one by default) over ``batches``."""
    metrics = metrics if metrics is not None else EvalMetrics()
    model.eval()
    with torch.no_grad():
        for x, y in batches:
            with compute_precision(device, dtype):
                out = model(torch.as_tensor(x, device=device))
            metrics.update(out, torch.as_tensor(y, device=out.device))
    return metrics


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)-15s %(message)s")


def batches_per_epoch(num_samples: int, batch_size: int, num_workers: int) -> int:
    return (num_samples // num_workers) // batch_size
