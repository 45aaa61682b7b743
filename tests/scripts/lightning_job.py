"""A small LightningModule trained by a real ``lightning.Trainer``, with Lightning's
DDP strategy (gloo) or kvstore.lightning.KVStoreStrategy, started by torchrun or
tracker.local (tests/torch_integration/test_lightning.py).

    python tests/scripts/lightning_job.py OUT.pt --strategy ddp|kvstore [--update-on-kvstore]
        [--store dist_sync] [--by-name | --cli] [--amp | --precision P] [--clip MAX_NORM] [--inf-step N]
        [--accumulate K]

``--by-name``: the kvstore strategy by its registered name (``strategy="kvstore"``,
or ``"kvstore_update_on_kvstore"``: dist_sync); ``--cli``: the Lightning Trainer
built by LightningCLI from ``--trainer.strategy=NAME`` and the other settings as
command-line options. ``--amp``: float16 autocast and Lightning's GradScaler (on a CPU,
``plugins=[MixedPrecision("16-mixed", "cpu", scaler)]``: Lightning turns
``precision="16-mixed"`` into ``"bf16-mixed"`` there), its scale grown every 3 steps;
``--clip``: ``gradient_clip_val`` (by the norm); ``--inf-step``: worker 1's loss is
inf at that step, which every worker must skip (the scale backs off). ``--precision``:
``L.Trainer(precision=P)`` (``"16-mixed"`` on a CPU is Lightning's ``"bf16-mixed"``);
``--accumulate``: ``accumulate_grad_batches``.

Every worker starts from other weights (seeded by its rank: the strategy makes them
rank 0's), the data are fixed and Lightning shards them with a DistributedSampler;
SGD with momentum, weight decay and a step LR schedule runs 2 epochs of 4 steps.
Rank 0 writes the final weights, the epoch's loss logged with sync_dist=True and two
torchmetrics (samples seen, labels gathered unevenly) computed over the workers to
OUT.pt; every worker prints what the strategy's collectives returned and the TCP
addresses its process listens on.
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning as L
import torchmetrics
from listening import listening      # tests/scripts/, this script's folder
from shared_pipe import write_lines


class Net(L.LightningModule):
    def __init__(self, inf_step: int = -1):
        super().__init__()
        self.inf_step = inf_step
        self.scales: list[float] = []     # the GradScaler's scale after every step (--amp)
        self.norms: list[float] = []      # the gradient's norm before clipping, at every step (ddp)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        # torchmetrics sync their states at compute(): over torch.distributed under DDP,
        # through the store under KVStoreStrategy (a worker's own count without it)
        self.seen = torchmetrics.SumMetric()
        self.labels = torchmetrics.CatMetric()

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.update(torch.tensor(float(len(y))))
        self.labels.update(y[: 1 + self.global_rank])         # 1 label on rank 0, 2 on rank 1: uneven
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        if self.trainer.global_step == self.inf_step and self.global_rank == 1:
            loss = loss * float("inf")        # an overflow on one worker: every worker skips the step
        return loss

    def on_before_optimizer_step(self, optimizer):
        if isinstance(self.trainer.strategy, L.pytorch.strategies.DDPStrategy):   # the average, unscaled
            self.norms.append(float(torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(p.grad) for p in self.parameters() if p.grad is not None]))))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            self.scales.append(float(scaler.get_scale()))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data():
    g = torch.Generator().manual_seed(42)
    x = torch.randn(32, 6, generator=g)
    y = torch.randint(0, 3, (32,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)


def cli_trainer(strategy: str, options: dict) -> L.Trainer:
    """The Lightning Trainer LightningCLI builds from ``--trainer.strategy=NAME`` and
    ``options`` as command-line options (the module is made by the caller)."""
    from lightning.pytorch.cli import LightningCLI
    argv = [f"--trainer.strategy={strategy}"]
    argv += [f"--trainer.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in options.items()]
    return LightningCLI(Net, run=False, args=argv, save_config_callback=None, seed_everything_default=False).trainer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--strategy", choices=["ddp", "kvstore"], required=True)
    ap.add_argument("--update-on-kvstore", action="store_true")
    ap.add_argument("--store", default="dist_sync")
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--by-name", action="store_true", help="kvstore: the strategy's registered name")
    how.add_argument("--cli", action="store_true", help="kvstore: the Trainer from LightningCLI")
    amp = ap.add_mutually_exclusive_group()
    amp.add_argument("--amp", action="store_true", help="float16 autocast and a GradScaler")
    amp.add_argument("--precision", default=None, help="L.Trainer(precision=...)")
    ap.add_argument("--clip", type=float, default=None, help="gradient_clip_val (by the norm)")
    ap.add_argument("--inf-step", type=int, default=-1, help="worker 1's loss is inf at this step")
    ap.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    args = ap.parse_args()

    options = dict(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                   deterministic=True, accumulate_grad_batches=args.accumulate)
    if args.clip is not None:
        options["gradient_clip_val"] = args.clip
    if args.precision is not None:
        options["precision"] = args.precision
    if args.amp:
        from lightning.pytorch.plugins import MixedPrecision
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
        options["plugins"] = [MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    if args.strategy == "ddp":
        from lightning.pytorch.strategies import DDPStrategy
        trainer = L.Trainer(strategy=DDPStrategy(process_group_backend="gloo"), devices=int(os.environ["WORLD_SIZE"]),
                            **options)
    elif args.by_name or args.cli:
        import kvstore.lightning  # noqa: F401  (registers the names with Lightning)
        name = "kvstore_update_on_kvstore" if args.update_on_kvstore else "kvstore"
        trainer = cli_trainer(name, options) if args.cli else L.Trainer(strategy=name, **options)
    else:
        from kvstore.lightning import KVStoreStrategy
        trainer = L.Trainer(strategy=KVStoreStrategy(args.store, update_on_kvstore=args.update_on_kvstore),
                            **options)
    rank = trainer.global_rank
    L.seed_everything(rank, verbose=False)          # other weights on every worker
    model = Net(args.inf_step)
    L.seed_everything(0, verbose=False)             # the same data order everywhere
    trainer.fit(model, train_dataloaders=data())
    if args.strategy == "kvstore":
        s = trainer.strategy
        line = (f"rank {rank} of {trainer.world_size}: broadcast {s.broadcast({'from': rank, 'p': [rank]})} "
                f"max {s.reduce(torch.tensor([rank + 1.0, -rank]), reduce_op='max').tolist()} "
                f"gather {s.all_gather(torch.tensor(rank)).tolist()} "
                f"stop {s.reduce_boolean_decision(rank == 1, all=False)}/{s.reduce_boolean_decision(rank == 1)} "
                f"sampler {trainer.train_dataloader.sampler.num_replicas}:{trainer.train_dataloader.sampler.rank}")
        # what this worker listens on (tests/scripts/listening.py): the strategy opens nothing
        # one write(2) of both lines: under torchrun both workers share one pipe
        write_lines([line, f"rank {rank} listens on {listening()}"])
        s.barrier()
    seen, labels = float(model.seen.compute()), len(model.labels.compute())   # collective: every rank
    if rank == 0:
        torch.save({"seen": seen, "labels": labels,
                    "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
                    "loss": float(trainer.callback_metrics["loss"]), "steps": trainer.global_step,
                    "scales": model.scales, "norms": model.norms}, args.out)
    write_lines([f"rank {rank}: done after {trainer.global_step} steps"])
    if args.strategy == "ddp" and torch.distributed.is_initialized():
        # end gloo's process group before the interpreter does: left to exit, its
        # threads can meet a torn-down runtime ("terminate called without an active
        # exception", SIGABRT after the work was done: seen once in a full run)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
