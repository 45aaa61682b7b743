"""A tiny CIFAR-10 set in the real python-batches format, for the training tests
(tests/training/*): 96 random images, 2 training batches of 36 and a test batch of
24, written by the examples' own writer (examples/cifar10.py)."""

from __future__ import annotations

import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_tiny_cifar(directory):
    """Write the set into ``directory`` (made if needed); ``directory``, as given."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from cifar10 import write_cifar10_batches   # noqa: PLC0415 - the examples are scripts, not a package
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (96, 3, 32, 32), dtype=np.uint8)
    labels = rng.integers(0, 10, 96)
    write_cifar10_batches(str(directory), images[:72], labels[:72], per_batch=36, test_images=images[72:],
                          test_labels=labels[72:])
    return directory
