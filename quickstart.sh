#!/usr/bin/env bash
# Set up this machine and run a real distributed training job: 2 workers and
# 2 servers on this machine train LeNet on Fashion-MNIST with dist_sync.
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends dataset-fashion-mnist
fi
python -m pip install -q torch==2.13.0        # the CPU wheel; any other spec pulls CUDA packages
python -m pip install -q -e .
exec python -m tracker.local -n 2 -s 2 python examples/train_mnist.py --kvstore dist_sync "$@"
