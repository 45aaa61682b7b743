"""The training loop shared by train_mnist.py, train_cifar10.py and train_sparse.py,
after MXNet's example/image-classification/common/fit.py: the same flags, the same
log lines.

Log lines (MXNet's format, so existing tools read them; plus communication)::

    Epoch[0] Batch [20]\tSpeed: 1234.56 samples/sec\taccuracy=0.500000
    Epoch[0] Train-accuracy=0.900000
    Epoch[0] Time cost=12.300
    Epoch[0] Comm-sent-bytes=123456789
    Epoch[0] Comm-received-bytes=123456789
    Epoch[0] Validation-accuracy=0.880000
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
import torch.nn.functional as F

import kvstore
import kvstore.torch as kvtorch
from kvstore import optimizer as kvopt
from kvstore.fileio import atomic_write

log = logging.getLogger("fit")


def add_fit_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add = parser.add_argument
    add("--network", type=str, help="the neural network to use")
    add("--num-layers", type=int, help="number of layers (resnet: 20/56/110, vgg: 11/13/16/19)")
    add("--gpus", type=str, help="GPU to use, e.g. 0 (empty: CPU)")
    add("--kvstore", "--kv-store", dest="kvstore", type=str, default="local",
        help="local, device, dist_sync, dist_async, dist_ssp or dist_device_sync")
    add("--num-epochs", type=int, default=10, help="max number of epochs")
    add("--lr", type=float, default=0.1, help="initial learning rate")
    add("--lr-factor", type=float, default=0.1, help="the ratio to reduce lr on each step")
    add("--lr-step-epochs", type=str, default="", help="epochs to reduce the lr, e.g. 30,60")
    add("--optimizer", type=str, default="sgd", help=f"one of {', '.join(kvopt.registered())}")
    add("--mom", type=float, default=0.9, help="momentum for sgd, nag, lars and lbsgd")
    add("--opt-param", action="append", default=[], metavar="NAME=VALUE",
        help="another hyper-parameter of --optimizer, e.g. eta=0.02 for lars (repeatable)")
    add("--wd", type=float, default=0.0001, help="weight decay")
    add("--batch-size", type=int, default=128, help="batch size of each worker")
    add("--disp-batches", type=int, default=20, help="show progress every n batches")
    add("--model-prefix", type=str, help="save the model and optimizer states every epoch here")
    add("--load-epoch", type=int, help="resume from the checkpoint of this epoch (needs --model-prefix)")
    add("--seed", type=int, default=0, help="random seed (data order, augmentation, initial weights)")
    add("--async-lr-scale", type=float, default=None,
        help="dist_async and dist_ssp: multiply --lr by this (default 1/workers: each worker's "
             "gradient is applied as its own step, on weights up to a round stale)")
    return parser


def make_optimizer(args, batches_per_epoch: int, kv=None) -> kvopt.Optimizer:
    """The optimizer of --optimizer, --lr, --wd, --mom and the lr schedule. With a
    ``kv`` whose servers apply each worker's push on its own (dist_async, dist_ssp),
    the schedule counts W updates per batch, and the learning rate is scaled by
    --async-lr-scale (default 1/W; logged)."""
    updates_per_batch, lr = 1, args.lr
    one_by_one = kv is not None and (kv.type.startswith("dist_async") or
                                     (kv.type.startswith("dist_ssp") and kv.staleness != 0))
    if one_by_one and kv.num_workers > 1:
        updates_per_batch = kv.num_workers
        scale = 1.0 / kv.num_workers if args.async_lr_scale is None else args.async_lr_scale
        lr = args.lr * scale
        log.info("%s: learning rate %g x %g = %g (each worker's gradient is its own update; "
                 "--async-lr-scale to change)", kv.type, args.lr, scale, lr)
    steps = [int(e) for e in args.lr_step_epochs.split(",") if e.strip()]
    sched = None
    if steps and args.lr_factor < 1:
        # the schedule counts the servers' updates since the start of training
        sched = kvopt.MultiFactorScheduler(step=[e * batches_per_epoch * updates_per_batch for e in steps],
                                           factor=args.lr_factor)
    name = args.optimizer.lower()
    extra = {"momentum": args.mom} if name in ("sgd", "nag", "lars", "lbsgd") else {}
    extra.update(opt_params(args.opt_param))
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


def _atomic_save(obj, path: str) -> None:
    with atomic_write(path) as f:
        torch.save(obj, f)


def checkpoint_paths(prefix: str, epoch: int) -> tuple[str, str]:
    return f"{prefix}-{epoch:04d}.params", f"{prefix}-{epoch:04d}.states"


class Speedometer:
    """MXNet's Speedometer: samples/sec and running accuracy every `frequent` batches."""

    def __init__(self, batch_size: int, frequent: int):
        self.batch_size, self.frequent = batch_size, frequent
        self.tic = time.time()

    def __call__(self, epoch: int, nbatch: int, correct: int, seen: int) -> None:
        if self.frequent > 0 and nbatch % self.frequent == 0:
            speed = self.frequent * self.batch_size / (time.time() - self.tic)
            log.info("Epoch[%d] Batch [%d]\tSpeed: %.2f samples/sec\taccuracy=%f",
                     epoch, nbatch, speed, correct / max(seen, 1))
            self.tic = time.time()


def fit(args, model: torch.nn.Module, train_batches, val_batches, num_train_samples: int):
    """Train ``model``. ``train_batches(epoch, rank, num_workers)`` yields (x, y) of
    this worker's shard, the same number on every worker; ``val_batches()`` yields
    the validation set. Returns the last validation accuracy."""
    device = get_device(args)
    kv = kvstore.create(args.kvstore)
    assert isinstance(kv, kvstore.KVStore)   # a built-in store type
    model.to(device)
    begin = 0
    if args.load_epoch is not None:
        if not args.model_prefix:
            raise SystemExit("--load-epoch needs --model-prefix")
        params_path, _ = checkpoint_paths(args.model_prefix, args.load_epoch)
        model.load_state_dict(torch.load(params_path, map_location=device, weights_only=True))
        begin = args.load_epoch
        log.info("resumed from %s", params_path)
    steps_per_epoch = batches_per_epoch(num_train_samples, args.batch_size, kv.num_workers)
    trainer = kvtorch.Trainer(model.parameters(), kv, make_optimizer(args, steps_per_epoch, kv))
    if args.load_epoch is not None:
        if kv.rank == 0:  # the servers' optimizer state, as saved at the end of that epoch
            trainer.load_states(checkpoint_paths(args.model_prefix, args.load_epoch)[1])
        kv.barrier()
    val_acc = train_epochs(args, kv, model, trainer, train_batches, val_batches, device, begin)
    trainer.close()
    kv.close()
    return val_acc


def train_epochs(args, kv, model: torch.nn.Module, trainer, train_batches, val_batches, device,
                 begin: int = 0, after_step=None) -> float:
    """The epoch loop of :func:`fit` (epochs ``begin`` .. ``args.num_epochs - 1``, its
    log lines and checkpoints), for a script that builds its own store and Trainer.
    ``after_step()`` runs after every ``trainer.step()``: a ShardedEmbedding's
    ``step``, which pushes the rows of the step's gradient. Returns the last
    validation accuracy."""
    val_acc = float("nan")
    epoch, starting = begin, True
    while epoch < args.num_epochs:
        if kv.elastic:
            epoch = elastic_epoch(kv, trainer, epoch, starting, args.batch_size)
            if epoch >= args.num_epochs:
                break
        starting = False
        tic, stats0 = time.time(), kv.comm_stats()
        speedometer = Speedometer(args.batch_size, args.disp_batches)
        model.train()
        correct = seen = 0
        place = kv.members.index(kv.rank)    # = kv.rank, unless an elastic job lost a worker
        for nbatch, (x, y) in enumerate(train_batches(epoch, place, kv.num_workers), start=1):
            x, y = torch.as_tensor(x, device=device), torch.as_tensor(y, device=device)
            trainer.zero_grad()
            out = model(x)
            F.cross_entropy(out, y).backward()
            trainer.step()
            if after_step is not None:
                after_step()
            correct += int((out.argmax(1) == y).sum())
            seen += len(y)
            speedometer(epoch, nbatch, correct, seen)
        stats = kv.comm_stats()
        log.info("Epoch[%d] Train-accuracy=%f", epoch, correct / max(seen, 1))
        log.info("Epoch[%d] Time cost=%.3f", epoch, time.time() - tic)
        log.info("Epoch[%d] Comm-sent-bytes=%d", epoch, stats["bytes_sent"] - stats0["bytes_sent"])
        log.info("Epoch[%d] Comm-received-bytes=%d", epoch, stats["bytes_received"] - stats0["bytes_received"])
        val_acc = evaluate(model, val_batches(), device)
        log.info("Epoch[%d] Validation-accuracy=%f", epoch, val_acc)
        if args.model_prefix:
            kv.barrier()          # every worker's pushes of this epoch are applied
            if kv.rank == kv.members[0]:
                params_path, states_path = checkpoint_paths(args.model_prefix, epoch + 1)
                _atomic_save(model.state_dict(), params_path)
                trainer.save_states(states_path)
                log.info("Saved checkpoint to %s", params_path)
            kv.barrier()
        epoch += 1
    if kv.elastic and not starting:
        kv.save_progress({"epoch": args.num_epochs})   # a worker joining now has nothing to do
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


def get_device(args) -> torch.device:
    """The device of ``--gpus`` (its first GPU), or the CPU."""
    device = torch.device(f"cuda:{args.gpus.split(',')[0]}") if args.gpus else torch.device("cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--gpus {args.gpus}: no CUDA device is available")
    return device


def evaluate(model: torch.nn.Module, batches, device) -> float:
    model.eval()
    correct = seen = 0
    with torch.no_grad():
        for x, y in batches:
            out = model(torch.as_tensor(x, device=device))
            correct += int((out.argmax(1).cpu() == torch.as_tensor(y)).sum())
            seen += len(y)
    return correct / max(seen, 1)


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)-15s %(message)s")


def batches_per_epoch(num_samples: int, batch_size: int, num_workers: int) -> int:
    return (num_samples // num_workers) // batch_size
