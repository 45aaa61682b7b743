"""Train a network on CIFAR-10 (MXNet 1.9's example/image-classification/train_cifar10.py,
in PyTorch): every flag of its train_cifar10.py, common/fit.py and common/data.py, with
its defaults and meaning; docs/training.md has the table of flags and what differs.

    python -m tracker.local -n 2 -s 2 python examples/train_cifar10.py --kv-store dist_sync
    python -m tracker.ssh -n 2 -H hosts python examples/train_cifar10.py --network resnet \\
        --num-layers 110 --batch-size 128 --gpus 0,1 --kv-store dist_device_sync
    python examples/train_cifar10.py --benchmark 1 --network resnet --num-layers 20   # synthetic data

Data: the CIFAR-10 "python version" batches in --data-dir (or its cifar-10-batches-py/),
downloaded there when missing and a network exists; or --data-train and --data-val,
each a directory of batches or one batch file (MXNet's RecordIO .rec files are not
read: a clear error). An epoch is --num-examples images over all workers: each
worker runs ceil(int(num_examples / workers) / batch_size) batches of its part of the
data, starting it over when it runs out (MXNet's ResizeIter), so every worker runs
the same number of batches.

Images go through MXNet's augmenter as its flags set it (examples/image_pipeline.py):
by MXNet's defaults pad 4 with 127, a centre 28x28 crop, no flip, minus the ImageNet
mean (--rgb-mean), divided by 1 (--rgb-std). The standard CIFAR recipe (MXNet's
set_cifar_aug)::

    --image-shape 3,32,32 --random-crop 1 --random-mirror 1 --fill-value 0 \\
        --rgb-mean 125.307,122.961,113.8575 --rgb-std 51.5865,50.847,51.255
"""

import argparse
import logging
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cifar10 import load_cifar10, load_path  # noqa: E402
from common import (UsageError, add_fit_args, add_fit_job_args, check_fit_args, fit,  # noqa: E402
                    setup_logging, usage_errors)
from datasets import epoch_size, resized_batches  # noqa: E402
from image_pipeline import ImageAug, add_data_aug_args, add_data_args  # noqa: E402
from models import DEPTHS, get_network  # noqa: E402

log = logging.getLogger("train_cifar10")


def build_parser() -> argparse.ArgumentParser:
    """MXNet's parser of train_cifar10.py (fit, data and augmentation flags, its
    set_defaults), plus --data-dir, --opt-param, --seed and --async-lr-scale."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fit_args(parser)
    add_fit_job_args(parser)
    add_data_args(parser)
    add_data_aug_args(parser)
    parser.add_argument("--data-dir", default=os.path.expanduser("~/data/cifar10"),
                        help="directory with (or for) the CIFAR-10 python batches, used when --data-train "
                             "is not given (downloaded there when missing)")
    parser.set_defaults(network="resnet", num_layers=110, num_classes=10, num_examples=50000,
                        image_shape="3,28,28", pad_size=4, batch_size=128, num_epochs=300, lr=0.05,
                        lr_step_epochs="200,250")
    return parser


def load_data(args) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray] | None]:
    """(train images, labels) and (validation images, labels) or None, from --data-train
    and --data-val (defaults: --data-dir's batches, downloaded if missing; the
    test_batch beside the training data)."""
    if args.data_train is None:
        train = load_cifar10(args.data_dir, "train")
        val_source: str | None = args.data_dir
    else:
        train = load_path(args.data_train, "train")
        val_source = args.data_train if os.path.isdir(os.path.expanduser(args.data_train)) else None
    if args.data_val is not None:
        val_source = args.data_val or None          # '' : no validation
    elif val_source is None:
        raise UsageError(f"--data-train {args.data_train!r} is one file: give the validation data with "
                         f"--data-val (a batch file or directory; '' for none)")
    val = None if val_source is None else load_path(val_source, "test")
    for name, (_, labels) in (("training", train), ("validation", val or train)):
        if len(labels) and labels.max() >= args.num_classes:
            raise UsageError(f"the {name} data has label {labels.max()}, but --num-classes is {args.num_classes}")
    return train, val


def main(argv=None):
    args = build_parser().parse_args(argv)
    setup_logging()
    if "dist" in args.kvstore:
        torch.set_num_threads(1)   # workers and servers share the machine's cores
    torch.manual_seed(args.seed)
    with usage_errors():
        check_fit_args(args)
        aug = ImageAug.from_args(args)
        if args.num_classes is None or args.num_classes < 1:
            raise UsageError(f"--num-classes must be >= 1, got {args.num_classes}")
        if args.num_examples is None or args.num_examples < 1:
            raise UsageError(f"--num-examples must be >= 1, got {args.num_examples}")
        if args.network in DEPTHS and DEPTHS[args.network] is None:
            args.num_layers = None       # MXNet's mlp, lenet, inception-bn take no depth: ignore it
        model = get_network(args.network, args.num_classes, args.num_layers, image_shape=aug.shape,
                            data_bn=args.network == "resnet")
        data = None if args.benchmark else load_data(args)
        if data is not None:
            aug.check_fits(*data[0][0].shape[2:])

    def batches_per_worker(num_workers):
        return epoch_size(args.num_examples, args.batch_size, num_workers)

    if data is None:     # MXNet's SyntheticDataIter: one batch of uniform(-1, 1) data, repeated; no validation
        rng = np.random.default_rng(args.seed)
        fixed = (rng.uniform(-1, 1, (args.batch_size, *aug.shape)).astype(np.float32),
                 rng.integers(0, args.num_classes, args.batch_size))

        def synthetic_batches(epoch, rank, num_workers):
            for _ in range(batches_per_worker(num_workers)):
                yield fixed
        return fit(args, model, synthetic_batches, None, args.num_examples, batches_per_worker)

    (train_x, train_y), val = data

    def train_batches(epoch, rank, num_workers):
        rng = np.random.default_rng((args.seed, epoch, rank))    # augmentation: reproducible per epoch
        for idx in resized_batches(len(train_x), args.batch_size, rank, num_workers, epoch,
                                   batches_per_worker(num_workers), args.seed):
            yield aug.train(train_x[idx], rng), train_y[idx]

    return fit(args, model, train_batches, None if val is None else validation(aug, *val), args.num_examples,
               batches_per_worker)


def validation(aug: ImageAug, images: np.ndarray, labels: np.ndarray):
    """The validation batches (500 images each) as ``aug`` prepares them."""
    def val_batches():
        for start in range(0, len(images), 500):
            yield aug.val(images[start:start + 500]), labels[start:start + 500]
    return val_batches

if __name__ == "__main__":
    main()
