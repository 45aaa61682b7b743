"""Wide & deep on Fashion-MNIST: a row-sparse wide part on the servers, LeNet as the deep part.

    python -m tracker.local -n 2 -s 2 python examples/train_sparse.py --kvstore dist_sync
    python examples/train_sparse.py --kvstore local --batch-size 128   # the same steps in one process

The wide part is a logistic regression over hashed feature crosses (Cheng et al.,
"Wide & Deep Learning for Recommender Systems", 2016): each pixel is quantised to
--levels levels, each pair of horizontally or vertically adjacent pixels makes one
cross (pair, level, level), and each cross is hashed into one of --wide-rows rows
(2**22 by default: 168 MB of fp32 on the servers). A ShardedEmbedding
(mode="sum", an EmbeddingBag) adds up the rows of an image's crosses into its 10
logits; a step moves only the rows of its batch's crosses. The deep part is LeNet
(--network); the logits are the sum of both parts. The servers' optimizer updates
both: the dense parameters through kvstore.torch.Trainer, the table lazily (only
the rows in a step's gradient, and their momentum, change).

Crosses of two background pixels (level 0 both) are left out: with one weight row
per (pair, level, level), dropping one reference level per pair changes nothing
the bias cannot absorb, and it halves the bags (about 700 crosses an image, not
1512). Each cross counts --cross-value (its feature value): the deep and the wide
part share one learning rate, and the wide logit sums hundreds of rows, so its
effective step is the learning rate times the feature value squared times the
crosses an image has.

--dynamic makes the wide part a table of dynamic rows (kvstore.DynamicRows): a
cross's row id is the cross itself, exact (no hashing, no collisions: the id space
is 2**63), its row is created by the first push that names it and evicted when
not updated for --evict-after rounds or when a server passes --row-budget rows
(the least recently updated go first). The table's counters (rows, created,
evicted, hit rate) are logged after training.

--batch-size is per worker, and each worker's batch is its slice of a global batch
(datasets.global_batches), so `--kvstore local --batch-size 128` takes exactly the
steps of 2 workers with --batch-size 64. --save-params writes the deep parameters
and the table's nonzero rows after training (torch.save of tensors only).
"""

import argparse
import logging
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvstore  # noqa: E402
import kvstore.torch as kvtorch  # noqa: E402
from kvstore import RowSparse  # noqa: E402
from common import (add_fit_args, batches_per_epoch, get_device, make_optimizer,  # noqa: E402
                    setup_logging, train_epochs)
from datasets import FASHION_MNIST_DIR, global_batches, mnist_batches  # noqa: E402
from models import get_network  # noqa: E402

NUM_CLASSES = 10
WIDE_KEY = "wide"
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)   # 2**64 / golden ratio: Knuth's multiplicative hash


def hashed_crosses(images: np.ndarray, levels: int, num_rows: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The crosses of ``images`` (N, 1, H, W) in [0, 1] as EmbeddingBag input: table
    rows ``ids`` (int64) and ``offsets`` (image i's rows are ids[offsets[i]:offsets[i+1]]).
    A cross is (pair of adjacent pixels, level of each); the two-background crosses
    are left out; the rest are hashed into [0, num_rows), or with ``num_rows`` None
    (a table of dynamic rows) each is its own exact id."""
    q = np.minimum((images[:, 0] * levels).astype(np.int64), levels - 1)
    crosses = np.concatenate([(q[:, :, :-1] * levels + q[:, :, 1:]).reshape(len(q), -1),     # horizontal
                              (q[:, :-1, :] * levels + q[:, 1:, :]).reshape(len(q), -1)],    # vertical
                             axis=1)
    keep = crosses != 0
    features = (np.arange(crosses.shape[1]) * levels * levels + crosses)[keep].astype(np.uint64)
    offsets = np.concatenate(([0], np.cumsum(keep.sum(axis=1))[:-1]))
    if num_rows is None:
        return features.astype(np.int64), offsets.astype(np.int64)
    with np.errstate(over="ignore"):          # the hash multiplies modulo 2**64
        ids = ((features * _GOLDEN) >> np.uint64(16)) % np.uint64(num_rows)
    return ids.astype(np.int64), offsets.astype(np.int64)


class WideDeep(torch.nn.Module):
    """logits = wide(hashed crosses of x) + deep(x). The wide part is a
    ShardedEmbedding (no local weight), so ``parameters()`` are the deep part's."""

    def __init__(self, wide: kvtorch.ShardedEmbedding, deep: torch.nn.Module, levels: int,
                 cross_value: float):
        super().__init__()
        self.wide, self.deep, self.levels, self.cross_value = wide, deep, levels, cross_value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        num_rows = None if self.wide.dynamic else self.wide.num_rows
        crosses, starts = hashed_crosses(x.detach().cpu().numpy(), self.levels, num_rows)
        ids, offsets = torch.from_numpy(crosses).to(x.device), torch.from_numpy(starts).to(x.device)
        values = torch.full(ids.shape, self.cross_value, dtype=x.dtype, device=x.device)
        return self.wide(ids, offsets, per_sample_weights=values) + self.deep(x)


def nonzero_rows(kv, key, shape: tuple, block: int = 1 << 18) -> tuple[np.ndarray, np.ndarray]:
    """The rows of a row-sparse key that are not all zero, and their values, pulled
    ``block`` rows at a time (a worker never holds the whole table)."""
    rows, data = [], []
    for start in range(0, shape[0], block):
        out = RowSparse.zeros(shape)
        kv.row_sparse_pull(key, out=out, row_ids=np.arange(start, min(start + block, shape[0])))
        nonzero = out.data.reshape(len(out.indices), -1).any(axis=1)
        rows.append(out.indices[nonzero])
        data.append(out.data[nonzero])
    return np.concatenate(rows), np.concatenate(data)


def save_params(path: str, kv, model: WideDeep) -> None:
    """Rank 0 saves ``deep.<name>`` tensors, ``wide.rows`` and ``wide.data``."""
    if kv.rank != 0:
        return
    rows, data = nonzero_rows(kv, WIDE_KEY, (model.wide.num_rows, NUM_CLASSES))
    params = {f"deep.{name}": p.detach().cpu() for name, p in model.deep.state_dict().items()}
    params.update({"wide.rows": torch.from_numpy(rows), "wide.data": torch.from_numpy(data)})
    torch.save(params, path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fit_args(parser)
    add = parser.add_argument
    add("--data-dir", default=FASHION_MNIST_DIR, help="directory with the IDX files")
    add("--num-examples", type=int, default=None, help="use only the first N training images")
    add("--levels", type=int, default=4, help="quantisation levels of a pixel in the crosses")
    add("--wide-rows", type=int, default=1 << 22, help="rows of the hashed wide table")
    add("--cross-value", type=float, default=0.3, help="the feature value of each cross")
    add("--save-params", default=None, help="after training, save the parameters to this file")
    add("--dynamic", action="store_true", help="the wide part: dynamic rows keyed by the exact cross "
        "(created on first push, evicted), not a hashed table of --wide-rows")
    add("--row-budget", type=int, default=None, help="with --dynamic: the most rows a server holds")
    add("--evict-after", type=int, default=None, help="with --dynamic: evict rows not updated for this "
        "many rounds")
    parser.set_defaults(network="lenet", num_epochs=3, lr=0.05, batch_size=64, disp_batches=100,
                        lr_step_epochs="2", lr_factor=0.2, wd=1e-4)
    args = parser.parse_args(argv)
    if args.model_prefix or args.load_epoch is not None:
        parser.error("--model-prefix/--load-epoch save the dense parameters only, not the wide table "
                     "(it lives on the servers): checkpoint the servers instead (KVSTORE_CHECKPOINT_DIR, "
                     "docs/configuration.md), or save the table with ShardedEmbedding.save_table")
    if not args.dynamic and (args.row_budget is not None or args.evict_after is not None):
        parser.error("--row-budget and --evict-after are for --dynamic")
    if args.dynamic and args.save_params:
        parser.error("--save-params lists the table's nonzero rows by id: a table of dynamic rows (ids up to "
                     "2**63) cannot; checkpoint the servers instead (KVSTORE_CHECKPOINT_DIR)")
    if args.levels < 2 or args.wide_rows < 1:
        parser.error(f"--levels must be >= 2 and --wide-rows >= 1, got {args.levels} and {args.wide_rows}")
    setup_logging()
    if "dist" in args.kvstore:
        torch.set_num_threads(1)   # workers and servers share this machine's cores
    torch.manual_seed(args.seed)

    train_batches, val_batches, num_train = mnist_batches(args.data_dir, args.batch_size, args.seed,
                                                          args.num_examples, sampler=global_batches)
    device = get_device(args)
    kv = kvstore.create(args.kvstore)
    if args.dynamic:
        rows = kvstore.DynamicRows(NUM_CLASSES, init=("zeros", 0.0), seed=args.seed, budget=args.row_budget,
                                   evict_after=args.evict_after)
        wide = kvtorch.ShardedEmbedding(None, NUM_CLASSES, kv, key=WIDE_KEY, init=rows, mode="sum")
    else:
        wide = kvtorch.ShardedEmbedding(args.wide_rows, NUM_CLASSES, kv, key=WIDE_KEY, init=("zeros", 0.0),
                                        mode="sum", seed=args.seed)
    deep = get_network(args.network, NUM_CLASSES, args.num_layers, image_shape=(1, 28, 28))
    model = WideDeep(wide, deep, args.levels, args.cross_value).to(device)
    steps = batches_per_epoch(num_train, args.batch_size, kv.num_workers)
    trainer = kvtorch.Trainer(model.named_parameters(), kv, make_optimizer(args, steps, kv))   # str keys, as "wide"
    val_acc = train_epochs(args, kv, model, trainer, train_batches, val_batches, device, after_step=wide.step)
    if args.dynamic:
        s = kv.row_stats(WIDE_KEY)
        logging.info("Wide-rows=%d Max-rows-per-server=%d Created=%d Evicted=%d (age %d, budget %d) "
                     "Hit-rate=%s", s["rows"], s["max_rows"], s["created"], s["evicted"], s["evicted_by_age"],
                     s["evicted_by_budget"], "n/a" if s["hit_rate"] is None else f"{s['hit_rate']:.4f}")
    if args.save_params:
        save_params(args.save_params, kv, model)
    trainer.close()
    kv.close()
    return val_acc


if __name__ == "__main__":
    main()
