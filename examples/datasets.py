"""Dataset readers for the examples: MNIST / Fashion-MNIST in IDX format.

Debian's ``dataset-fashion-mnist`` package installs the full Fashion-MNIST under
/usr/share/datasets/fashion-mnist; that is the default, so examples run offline.
"""

from __future__ import annotations

import gzip
import os

import numpy as np

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
IDX_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
             "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str) -> np.ndarray:
    """Read one IDX file (optionally gzipped): magic 0x0000TTDD, DD dims, then data."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in IDX_DTYPES:
        raise ValueError(f"{path} is not an IDX file")
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(IDX_DTYPES[data[2]])
    body = np.frombuffer(data, dtype=dtype, offset=4 + 4 * ndim)
    if body.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says {shape}, file holds {body.size} values")
    return body.reshape(shape)


def _find(data_dir: str, stem: str) -> str:
    for name in (stem, stem + ".gz"):
        path = os.path.join(data_dir, name)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(
        f"{stem}[.gz] not found in {data_dir}. Install Debian's dataset-fashion-mnist "
        f"(apt-get install dataset-fashion-mnist) or pass --data-dir with the IDX files")


def load_mnist(data_dir: str = FASHION_MNIST_DIR, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """Images as float32 in [0, 1] of shape (N, 1, 28, 28) and int64 labels."""
    images_stem, labels_stem = IDX_FILES[split]
    images = read_idx(_find(data_dir, images_stem))
    labels = read_idx(_find(data_dir, labels_stem))
    if len(images) != len(labels):
        raise ValueError(f"{data_dir}: {len(images)} images but {len(labels)} labels")
    return (images.astype(np.float32) / 255.0)[:, None], labels.astype(np.int64)


def shard_batches(num_samples: int, batch_size: int, rank: int, num_workers: int, epoch: int,
                  seed: int = 0):
    """Index batches of this worker for one epoch: the same shuffled order on every
    worker, cut into equal shards, so every worker runs the same number of batches
    (a dist_sync job never waits on a worker that ran out of data)."""
    order = np.random.default_rng((seed, epoch)).permutation(num_samples)
    per_worker = num_samples // num_workers
    mine = order[rank * per_worker:(rank + 1) * per_worker]
    for start in range(0, per_worker - batch_size + 1, batch_size):
        yield mine[start:start + batch_size]
