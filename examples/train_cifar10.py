"""Train a network on CIFAR-10 (MXNet's train_cifar10.py, in PyTorch).

    python -m tracker.local -n 2 -s 2 python examples/train_cifar10.py --kvstore dist_sync
    python -m tracker.ssh -n 2 -s 2 -H hosts python examples/train_cifar10.py --kvstore dist_sync
    python examples/train_cifar10.py --benchmark 1 --network resnet --num-layers 20   # synthetic data

Data: the CIFAR-10 "python version" batches in --data-dir (or its
cifar-10-batches-py/), downloaded there when missing and a network exists.
Training images get pad-crop and flip augmentation; each worker reads its own
shard, and every worker runs the same number of batches per epoch.
"""

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cifar10 import augment, load_cifar10, preprocess, synthetic  # noqa: E402
from common import add_fit_args, fit, setup_logging  # noqa: E402
from datasets import shard_batches  # noqa: E402
from models import get_network  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fit_args(parser)
    parser.add_argument("--data-dir", default=os.path.expanduser("~/data/cifar10"),
                        help="directory with (or for) the CIFAR-10 python batches")
    parser.add_argument("--benchmark", type=int, default=0,
                        help="1: synthetic data of CIFAR-10's shape, for speed tests")
    parser.add_argument("--num-examples", type=int, default=None, help="use only the first N training images")
    parser.set_defaults(network="resnet", num_epochs=300, lr=0.05, batch_size=128,
                        lr_step_epochs="200,250", lr_factor=0.1, wd=1e-4)
    args = parser.parse_args(argv)
    if args.num_layers is None:
        args.num_layers = {"resnet": 20, "vgg": 11}.get(args.network)
    setup_logging()
    if "dist" in args.kvstore:
        torch.set_num_threads(1)   # workers and servers share the machine's cores
    torch.manual_seed(args.seed)

    if args.benchmark:
        rng = np.random.default_rng(args.seed)
        train_x, train_y = synthetic(args.num_examples or 50000, rng)
        val_x, val_y = synthetic(1000, rng)
    else:
        train_x, train_y = load_cifar10(args.data_dir, "train")
        val_x, val_y = load_cifar10(args.data_dir, "test")
    if args.num_examples:
        train_x, train_y = train_x[:args.num_examples], train_y[:args.num_examples]

    def train_batches(epoch, rank, num_workers):
        rng = np.random.default_rng((args.seed, epoch, rank))    # augmentation: reproducible per epoch
        for idx in shard_batches(len(train_x), args.batch_size, rank, num_workers, epoch, args.seed):
            yield augment(train_x[idx], rng), train_y[idx]

    def val_batches():
        for start in range(0, len(val_x), 500):
            yield preprocess(val_x[start:start + 500]), val_y[start:start + 500]

    model = get_network(args.network, 10, args.num_layers, image_shape=(3, 32, 32))
    return fit(args, model, train_batches, val_batches, len(train_x))


if __name__ == "__main__":
    main()
