"""Train a network on MNIST or Fashion-MNIST (MXNet's train_mnist.py, in PyTorch).

    python -m tracker.local -n 2 -s 2 python examples/train_mnist.py --kvstore dist_sync

Data: the IDX files in --data-dir (default: where Debian's dataset-fashion-mnist
installs Fashion-MNIST; plain MNIST's files work the same way).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_fit_args, fit, setup_logging  # noqa: E402
from datasets import FASHION_MNIST_DIR, load_mnist, shard_batches  # noqa: E402
from models import get_network  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fit_args(parser)
    parser.add_argument("--data-dir", default=FASHION_MNIST_DIR, help="directory with the IDX files")
    parser.add_argument("--num-examples", type=int, default=None, help="use only the first N training images")
    parser.set_defaults(network="lenet", num_epochs=4, lr=0.05, batch_size=64, disp_batches=100,
                        lr_step_epochs="3", lr_factor=0.2, wd=1e-4)
    args = parser.parse_args(argv)
    setup_logging()
    if "dist" in args.kvstore:
        torch.set_num_threads(1)   # workers and servers share this machine's cores
    torch.manual_seed(args.seed)

    train_x, train_y = load_mnist(args.data_dir, "train")
    if args.num_examples:
        train_x, train_y = train_x[:args.num_examples], train_y[:args.num_examples]
    val_x, val_y = load_mnist(args.data_dir, "test")

    def train_batches(epoch, rank, num_workers):
        for idx in shard_batches(len(train_x), args.batch_size, rank, num_workers, epoch, args.seed):
            yield train_x[idx], train_y[idx]

    def val_batches():
        for start in range(0, len(val_x), 1000):
            yield val_x[start:start + 1000], val_y[start:start + 1000]

    model = get_network(args.network, 10, args.num_layers, image_shape=(1, 28, 28))
    return fit(args, model, train_batches, val_batches, len(train_x))


if __name__ == "__main__":
    main()
