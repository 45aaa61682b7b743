"""Dataset readers for the examples: MNIST / Fashion-MNIST in IDX format.

Debian's ``dataset-fashion-mnist`` package installs the full Fashion-MNIST under
/usr/share/datasets/fashion-mnist; that is the default, so examples run offline.
"""

from __future__ import annotations

import gzip
import os

import numpy as np
import numpy.typing as npt

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
IDX_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
             "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
IDX_DTYPES: dict[int, npt.DTypeLike] = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4",
                                        0x0E: ">f8"}


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


def epoch_size(num_examples: int, batch_size: int, num_workers: int) -> int:
    """Batches each worker runs per epoch, as MXNet's fit.py's ``get_epoch_size``:
    ``ceil(int(num_examples / num_workers) / batch_size)``."""
    return -(-(num_examples // num_workers) // batch_size)


def resized_batches(num_samples: int, batch_size: int, rank: int, num_workers: int, epoch: int,
                    batches: int, seed: int = 0):
    """Index batches of this worker for one epoch as MXNet's data path gives them: the
    worker's part (1/num_workers of one shuffled order of the ``num_samples``, shared by
    all workers and drawn per epoch) read as ``mx.io.ResizeIter`` reads it, exactly
    ``batches`` full batches, starting over from the part's start when it runs out
    (so also when the part holds fewer images than an epoch needs). Raises
    ValueError if a worker's part would be empty."""
    per_worker = num_samples // num_workers
    if per_worker < 1:
        raise ValueError(f"{num_samples} training images cannot be split among {num_workers} workers")
    order = np.random.default_rng((seed, epoch)).permutation(num_samples)
    mine = np.resize(order[rank * per_worker:(rank + 1) * per_worker], batches * batch_size)  # cyclic
    for start in range(0, batches * batch_size, batch_size):
        yield mine[start:start + batch_size]


def global_batches(num_samples: int, batch_size: int, rank: int, num_workers: int, epoch: int,
                   seed: int = 0):
    """Index batches of this worker for one epoch, cut from global batches: global
    batch ``b`` is samples ``b*G .. (b+1)*G - 1`` of the shuffled order (G =
    ``batch_size * num_workers``) and worker ``r`` takes its ``r``-th slice. So one
    process with ``batch_size * W`` sees exactly the union of what W workers see
    step by step (what makes a dist_sync run comparable with a local one)."""
    order = np.random.default_rng((seed, epoch)).permutation(num_samples)
    step = batch_size * num_workers
    for start in range(0, num_samples - step + 1, step):
        yield order[start + rank * batch_size:start + (rank + 1) * batch_size]


def mnist_batches(data_dir: str, batch_size: int, seed: int = 0, num_examples: int | None = None,
                  sampler=shard_batches):
    """The examples' data, for ``common.fit`` / ``common.train_epochs``:
    ``(train_batches, val_batches, num_train)``. ``train_batches(epoch, rank,
    num_workers)`` yields this worker's (x, y) batches of the first ``num_examples``
    training images (all when None), cut by ``sampler`` (:func:`shard_batches` or
    :func:`global_batches`); ``val_batches()`` yields the test set, 1000 at a time."""
    train_x, train_y = load_mnist(data_dir, "train")
    if num_examples:
        train_x, train_y = train_x[:num_examples], train_y[:num_examples]
    val_x, val_y = load_mnist(data_dir, "test")

    def train_batches(epoch, rank, num_workers):
        for idx in sampler(len(train_x), batch_size, rank, num_workers, epoch, seed):
            yield train_x[idx], train_y[idx]

    def val_batches():
        for start in range(0, len(val_x), 1000):
            yield val_x[start:start + 1000], val_y[start:start + 1000]
    return train_batches, val_batches, len(train_x)
