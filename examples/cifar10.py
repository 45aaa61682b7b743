"""CIFAR-10 in its "python version" format, and the standard augmentation.

The format (https://www.cs.toronto.edu/~kriz/cifar.html): a directory
``cifar-10-batches-py/`` holding ``data_batch_1`` .. ``data_batch_5`` (10000 images
each), ``test_batch`` (10000) and ``batches.meta``. Each file is a pickle of a dict
with bytes keys: ``b"data"``, a uint8 array of shape (N, 3072), each row a 32x32 image
as three 1024-byte planes (red, green, blue), each plane row-major; ``b"labels"``, a
list of N ints in 0..9; plus ``b"batch_label"`` and ``b"filenames"``. ``batches.meta``
holds ``b"label_names"``, ``b"num_cases_per_batch"`` and ``b"num_vis"`` (3072).
``write_cifar10_batches`` writes exactly this, e.g. to make a tiny data set for tests.

    images, labels = load_cifar10("~/data/cifar10", "train")   # uint8 (N,3,32,32), int64 (N,)
    images, labels = load_path("data/test_batch", "test")      # a directory or one batch file
    x = augment(images[idx], rng)                              # float32, for training
    x = preprocess(images)                                     # float32, for evaluation
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
import shutil
import tarfile
import urllib.request

import numpy as np

from image_pipeline import ImageAug

URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
MD5 = "c58f30108f718f92721af3b95e74349a"
ARCHIVE = "cifar-10-python.tar.gz"
SUBDIR = "cifar-10-batches-py"
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
# per-channel mean and standard deviation of the 50000 training images, on the [0, 1] scale
MEAN = np.array([0.4914, 0.4822, 0.4465], np.float32)
STD = np.array([0.2470, 0.2435, 0.2616], np.float32)
PAD = 4
RECORDIO_MAGIC = 0xCED7230A     # the first 4 bytes (little-endian) of every MXNet RecordIO record


def load_cifar10(data_dir: str, split: str = "train", download: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Images as uint8 of shape (N, 3, 32, 32) and labels as int64 of shape (N,).

    Reads the batch files from ``data_dir`` itself or from ``data_dir/cifar-10-batches-py``.
    When neither holds them and ``download`` is true, extracts ``data_dir/cifar-10-python.tar.gz``,
    downloading it from the CIFAR site first if it is not there (md5 checked). Raises
    FileNotFoundError naming the directories it looked in and why the download failed.
    The train split is every ``data_batch_<k>`` present, k = 1, 2, ... without gaps.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    data_dir = os.path.expanduser(data_dir)
    candidates = [data_dir, os.path.join(data_dir, SUBDIR)]
    found = _find_batches(candidates, split)
    if found is None:
        if not download:
            raise FileNotFoundError(
                f"CIFAR-10 {split} batches ({_wanted(split)}) not found in {' or '.join(candidates)}, "
                f"and download=False. Put the python-version batch files there or allow the download")
        try:
            fetch_and_extract(data_dir)
        except (OSError, ValueError, tarfile.TarError) as e:
            raise FileNotFoundError(
                f"CIFAR-10 {split} batches ({_wanted(split)}) not found in {' or '.join(candidates)}, "
                f"and the download of {URL} failed (no network?): {e}. Download and extract it "
                f"by hand into {data_dir}") from e
        found = _find_batches(candidates, split)
        if found is None:
            raise FileNotFoundError(f"{ARCHIVE} was extracted into {data_dir}, but it holds no "
                                    f"{_wanted(split)}")
    parts = [read_batch(path) for path in found]
    images = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    return images, labels


def load_path(path: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """The images and labels of ``--data-train``/``--data-val`` ``path``: a directory (as
    :func:`load_cifar10` with ``download=False``: ``split``'s batches in it or in its
    cifar-10-batches-py/) or one batch file. Raises ValueError for an MXNet RecordIO
    file (.rec, .idx, .lst, or a file starting with RecordIO's magic number), which
    this reader does not read, and FileNotFoundError for a path that does not exist."""
    path = os.path.expanduser(path)
    recordio = path.endswith((".rec", ".idx", ".lst"))
    if os.path.isfile(path) and not recordio:
        with open(path, "rb") as f:
            recordio = int.from_bytes(f.read(4).ljust(4, b"\0"), "little") == RECORDIO_MAGIC
    if recordio:
        raise ValueError(f"{path}: an MXNet RecordIO file (im2rec's .rec/.idx/.lst); this script reads the "
                         f"CIFAR-10 python batches (a directory with data_batch_1.. and test_batch, or one "
                         f"batch file): give that directory with --data-dir, --data-train or --data-val")
    if os.path.isdir(path):
        return load_cifar10(path, split, download=False)
    if os.path.isfile(path):
        return read_batch(path)
    raise FileNotFoundError(f"{path}: no such file or directory (expected a directory of CIFAR-10 python "
                            f"batches or one batch file)")


def _wanted(split: str) -> str:
    return "data_batch_1 .. data_batch_5" if split == "train" else "test_batch"


def _find_batches(candidates: list[str], split: str) -> list[str] | None:
    """The batch files of ``split`` in the first candidate directory that holds them."""
    for directory in candidates:
        if not os.path.isdir(directory):
            continue
        if split == "test":
            path = os.path.join(directory, "test_batch")
            if os.path.isfile(path):
                return [path]
            continue
        numbers = sorted(int(m.group(1)) for name in os.listdir(directory)
                         if (m := re.fullmatch(r"data_batch_(\d+)", name)))
        if numbers:
            if numbers != list(range(1, len(numbers) + 1)):
                raise FileNotFoundError(f"{directory}: training batches {numbers} have gaps; "
                                        f"expected data_batch_1 .. data_batch_{numbers[-1]}")
            return [os.path.join(directory, f"data_batch_{k}") for k in numbers]
    return None


def read_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    """One batch file: uint8 images (N, 3, 32, 32) and int64 labels (N,)."""
    # pickle is the definition of this format (the data set ships as pickles); this reads
    # a local file from the directory the user chose, never bytes from the network
    # directly (a downloaded archive is md5-checked before it is extracted).
    with open(path, "rb") as f:
        batch = pickle.load(f, encoding="bytes")
    if not isinstance(batch, dict):
        raise ValueError(f"{path}: not a CIFAR-10 batch (a pickled dict), got {type(batch).__name__}")
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(b"labels", batch.get("labels"))
    if data is None or labels is None:
        raise ValueError(f"{path}: not a CIFAR-10 batch (no data/labels; keys {sorted(map(str, batch))})")
    data = np.asarray(data)
    labels = np.asarray(labels, dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
        raise ValueError(f"{path}: expected uint8 data of shape (N, 3072) and N labels, got "
                         f"{data.dtype} {data.shape} and {labels.shape[0]} labels")
    return data.reshape(-1, 3, 32, 32), labels


def write_cifar10_batches(directory: str, images: np.ndarray, labels: np.ndarray, per_batch: int = 10000,
                          test_images: np.ndarray | None = None,
                          test_labels: np.ndarray | None = None) -> list[str]:
    """Write ``images`` (uint8, (N, 3, 32, 32)) and ``labels`` as ``data_batch_1``, ... of
    ``per_batch`` images each (the last may be shorter), ``test_images``/``test_labels``
    (if given) as ``test_batch``, and ``batches.meta``, in the python-version format.
    Returns the paths written."""
    os.makedirs(directory, exist_ok=True)
    if per_batch < 1:
        raise ValueError(f"per_batch must be >= 1, got {per_batch}")
    written = []

    def dump(name, obj):
        path = os.path.join(directory, name)
        with open(path, "wb") as f:
            pickle.dump(obj, f, protocol=2)   # the original files are Python 2 pickles
        written.append(path)

    def batch(imgs, labs, label):
        imgs, labs = _check(imgs, labs)
        return {b"batch_label": label.encode(), b"labels": [int(v) for v in labs],
                b"data": np.ascontiguousarray(imgs.reshape(len(imgs), 3072)),
                b"filenames": [f"image_{i:05d}.png".encode() for i in range(len(imgs))]}

    images, labels = _check(images, labels)
    count = max(1, -(-len(images) // per_batch))
    for k in range(count):
        part = slice(k * per_batch, (k + 1) * per_batch)
        dump(f"data_batch_{k + 1}", batch(images[part], labels[part], f"training batch {k + 1} of {count}"))
    if test_images is not None:
        dump("test_batch", batch(test_images, test_labels, "testing batch 1 of 1"))
    dump("batches.meta", {b"num_cases_per_batch": per_batch, b"num_vis": 3072,
                          b"label_names": [name.encode() for name in CLASSES]})
    return written


def _check(images, labels) -> tuple[np.ndarray, np.ndarray]:
    images, labels = np.asarray(images), np.asarray(labels)
    if images.dtype != np.uint8 or images.shape[1:] != (3, 32, 32) or labels.shape != (len(images),):
        raise ValueError(f"expected uint8 images (N, 3, 32, 32) and N labels, got {images.dtype} "
                         f"{images.shape} and labels {labels.shape}")
    if len(labels) and (labels.min() < 0 or labels.max() > 255):
        raise ValueError("labels must be in 0..255")
    return images, labels


# ---------------------------------------------------------------- download and safe extraction

def fetch_and_extract(data_dir: str, url: str = URL) -> None:
    """Extract ``data_dir/cifar-10-python.tar.gz``, downloading it first if it is missing."""
    os.makedirs(data_dir, exist_ok=True)
    archive = os.path.join(data_dir, ARCHIVE)
    if not os.path.isfile(archive):
        partial = archive + ".part"
        try:
            with urllib.request.urlopen(url, timeout=60) as response, open(partial, "wb") as f:
                shutil.copyfileobj(response, f, 1 << 20)
            digest = md5sum(partial)
            if digest != MD5:
                raise ValueError(f"the download from {url} has md5 {digest}, expected {MD5}")
            os.replace(partial, archive)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
    digest = md5sum(archive)
    if digest != MD5:
        raise ValueError(f"{archive} has md5 {digest}, expected {MD5}: delete it and retry")
    safe_extract(archive, data_dir)


def md5sum(path: str) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def safe_extract(archive: str, destination: str) -> None:
    """Extract a tar archive into ``destination``, rejecting (ValueError, nothing extracted)
    any member with an absolute path or a '..' component, and anything that is not a
    regular file or a directory (links, devices)."""
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        for m in members:
            name = m.name.replace("\\", "/")
            if name.startswith("/") or os.path.isabs(m.name) or re.match(r"^[A-Za-z]:", name):
                raise ValueError(f"{archive}: refusing member with an absolute path: {m.name!r}")
            if ".." in name.split("/"):
                raise ValueError(f"{archive}: refusing member with '..' in its path: {m.name!r}")
            if not (m.isfile() or m.isdir()):
                raise ValueError(f"{archive}: refusing member that is not a file or directory: {m.name!r}")
        if hasattr(tarfile, "data_filter"):       # Python >= 3.11.4: a second line of defence
            tar.extractall(destination, members=members, filter="data")
        else:
            tar.extractall(destination, members=members)


# ---------------------------------------------------------------- augmentation

# the standard CIFAR recipe as an image_pipeline.ImageAug: pad 4 with zeros, random 32x32
# crops, flips, this data set's mean and standard deviation (MXNet's train_cifar10.py has
# it as set_cifar_aug, left out by default)
STANDARD = ImageAug(shape=(3, 32, 32), pad=PAD, fill_value=0, random_crop=True, random_mirror=True,
                    mean=tuple(float(m) * 255 for m in MEAN),  # type: ignore[arg-type]
                    std=tuple(float(s) * 255 for s in STD))    # type: ignore[arg-type]


def preprocess(images: np.ndarray) -> np.ndarray:
    """uint8 (N, 3, H, W) -> float32, scaled to [0, 1] then normalised per channel with
    the CIFAR-10 mean and standard deviation."""
    images = np.asarray(images)
    if images.dtype != np.uint8:
        raise ValueError(f"expected uint8 images, got {images.dtype}")
    return STANDARD.normalise(images)


def augment(images: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Standard CIFAR training augmentation of uint8 images (N, 3, 32, 32) -> float32:
    pad 4 pixels of zeros on each side, take a random 32x32 crop, flip horizontally with
    probability 1/2, then normalise as ``preprocess`` (``STANDARD.train``).

    Draws, in this order: ``rng.integers(0, 9, size=(N, 2))`` (row and column offsets of
    each crop in the 40x40 padded image), then ``rng.random(N) < 0.5`` (which to flip).
    """
    return STANDARD.train(images, rng)
