"""A minimal custom training loop on a kvstore: an MLP on Fashion-MNIST.

Every worker computes gradients on its shard; the servers sum them and run SGD
with momentum; workers pull the new weights. Run it with 2 workers and 2 servers:

    python -m tracker.local -n 2 -s 2 python examples/dist_sync_mlp.py --kvstore dist_sync

or on one process with ``--kvstore local``.
"""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import kvstore

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from datasets import FASHION_MNIST_DIR, load_mnist, shard_batches  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--kvstore", default="dist_sync")
parser.add_argument("--num-epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=64, help="per worker")
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--data-dir", default=FASHION_MNIST_DIR)
args = parser.parse_args()

torch.set_num_threads(1)            # workers and servers share the machine's cores
torch.manual_seed(0)
kv = kvstore.create(args.kvstore)
assert isinstance(kv, kvstore.KVStore)   # a built-in store type
rank, workers = kv.rank, kv.num_workers

model = nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
params = list(model.parameters())
keys = list(range(len(params)))
kv.init(keys, [p.detach() for p in params])            # rank 0's initial weights win
kv.pull(keys, out=[p.data for p in params])            # ... and every worker starts from them
kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=args.lr, momentum=0.9, wd=1e-4,
                                       rescale_grad=1.0 / (args.batch_size * workers)))

train_x, train_y = load_mnist(args.data_dir, "train")
test_images, test_y = load_mnist(args.data_dir, "test")
test_x = torch.from_numpy(test_images)
for epoch in range(args.num_epochs):
    tic, correct, seen = time.time(), 0, 0
    for idx in shard_batches(len(train_x), args.batch_size, rank, workers, epoch):
        x, y = torch.from_numpy(train_x[idx]), torch.from_numpy(train_y[idx])
        model.zero_grad()
        out = model(x)
        F.cross_entropy(out, y, reduction="sum").backward()
        kv.push(keys, [p.grad for p in params])          # servers: sum over workers, SGD
        kv.pull(keys, out=[p.data for p in params])      # the updated weights
        correct += int((out.argmax(1) == y).sum())
        seen += len(y)
    with torch.no_grad():
        val = float((model(test_x).argmax(1).numpy() == test_y).mean())
    print(f"Epoch[{epoch}] Train-accuracy={correct / seen:.4f}", flush=True)
    print(f"Epoch[{epoch}] Time cost={time.time() - tic:.1f}", flush=True)
    print(f"Epoch[{epoch}] Validation-accuracy={val:.4f}", flush=True)
kv.close()
