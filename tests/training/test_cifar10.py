"""examples/cifar10.py: the python-version batch format (written, read back, both
directory layouts), the download and safe extraction (without the network),
augmentation against a hand-computed crop, and normalisation."""

import hashlib
import io
import os
import pickle
import sys
import tarfile
import urllib.error

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples"))
import cifar10  # noqa: E402
from cifar10 import (augment, load_cifar10, load_path, preprocess, safe_extract,  # noqa: E402
                     write_cifar10_batches)


@pytest.fixture
def tiny():
    """26 images: 2 train batches of 10, a test batch of 6."""
    rng = np.random.default_rng(7)
    images = rng.integers(0, 256, size=(26, 3, 32, 32), dtype=np.uint8)
    labels = rng.integers(0, 10, size=26).astype(np.int64)
    return images[:20], labels[:20], images[20:], labels[20:]


def write_tiny(directory, tiny):
    train_x, train_y, test_x, test_y = tiny
    return write_cifar10_batches(directory, train_x, train_y, 10, test_images=test_x, test_labels=test_y)


def test_written_files_are_the_python_version_format(tmp_path, tiny):
    paths = write_tiny(str(tmp_path), tiny)
    assert sorted(os.path.basename(p) for p in paths) == ["batches.meta", "data_batch_1", "data_batch_2",
                                                          "test_batch"]
    train_x, train_y, test_x, test_y = tiny
    with open(tmp_path / "data_batch_2", "rb") as f:
        batch = pickle.load(f, encoding="bytes")
    assert isinstance(batch[b"labels"], list) and batch[b"labels"] == train_y[10:].tolist()
    data = batch[b"data"]
    assert data.dtype == np.uint8 and data.shape == (10, 3072)
    image = train_x[13]                               # row 3 of batch 2
    assert np.array_equal(data[3, :1024], image[0].ravel())       # red plane, row-major
    assert np.array_equal(data[3, 1024:2048], image[1].ravel())   # green
    assert np.array_equal(data[3, 2048:], image[2].ravel())       # blue
    assert data[3, 32] == image[0, 1, 0]                          # row 1, column 0 of red
    assert batch[b"batch_label"] == b"training batch 2 of 2" and len(batch[b"filenames"]) == 10
    with open(tmp_path / "test_batch", "rb") as f:
        test = pickle.load(f, encoding="bytes")
    assert test[b"data"].shape == (6, 3072) and test[b"labels"] == test_y.tolist()
    with open(tmp_path / "batches.meta", "rb") as f:
        meta = pickle.load(f, encoding="bytes")
    assert meta[b"label_names"][0] == b"airplane" and len(meta[b"label_names"]) == 10
    assert meta[b"num_vis"] == 3072 and meta[b"num_cases_per_batch"] == 10


@pytest.mark.parametrize("layout", ["direct", "subdir"])
def test_load_back_exactly(tmp_path, tiny, layout):
    write_tiny(str(tmp_path if layout == "direct" else tmp_path / "cifar-10-batches-py"), tiny)
    train_x, train_y, test_x, test_y = tiny
    x, y = load_cifar10(str(tmp_path), "train", download=False)
    assert x.dtype == np.uint8 and x.shape == (20, 3, 32, 32)
    assert y.dtype == np.int64 and y.shape == (20,)
    assert np.array_equal(x, train_x) and np.array_equal(y, train_y)
    x, y = load_cifar10(str(tmp_path), "test", download=False)
    assert x.shape == (6, 3, 32, 32) and np.array_equal(x, test_x) and np.array_equal(y, test_y)


def test_uneven_last_batch_and_many_batches(tmp_path, tiny):
    train_x, train_y, _, _ = tiny
    paths = write_cifar10_batches(str(tmp_path / "uneven"), train_x, train_y, 3)
    assert len([p for p in paths if "data_batch_" in p]) == 7      # 20 = 6 batches of 3, then 2
    x, y = load_cifar10(str(tmp_path / "uneven"), download=False)
    assert np.array_equal(x, train_x) and np.array_equal(y, train_y)
    paths = write_cifar10_batches(str(tmp_path / "ten"), train_x, train_y, 2)
    assert os.path.basename(paths[9]) == "data_batch_10"
    x, y = load_cifar10(str(tmp_path / "ten"), download=False)
    assert np.array_equal(x, train_x) and np.array_equal(y, train_y)   # data_batch_10 after _9


def test_missing_files_without_download(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        load_cifar10(str(tmp_path), "test", download=False)
    message = str(info.value)
    assert str(tmp_path) in message and os.path.join(str(tmp_path), "cifar-10-batches-py") in message
    assert "test_batch" in message and "download=False" in message
    assert not os.listdir(tmp_path)


def test_gap_in_training_batches(tmp_path, tiny):
    write_tiny(str(tmp_path), tiny)
    os.rename(tmp_path / "data_batch_2", tmp_path / "data_batch_3")
    with pytest.raises(FileNotFoundError, match="gaps"):
        load_cifar10(str(tmp_path), download=False)


def test_no_network_gives_a_clear_error(tmp_path, monkeypatch):
    def offline(url, timeout=None):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")
    monkeypatch.setattr(cifar10.urllib.request, "urlopen", offline)
    with pytest.raises(FileNotFoundError) as info:
        load_cifar10(str(tmp_path / "data"), "train")
    message = str(info.value)
    assert str(tmp_path / "data") in message and "download" in message and "no network" in message
    assert "name resolution" in message
    assert os.listdir(tmp_path / "data") == []             # no partial archive left behind


def make_archive(tmp_path, tiny) -> bytes:
    source = tmp_path / "source"
    write_tiny(str(source / "cifar-10-batches-py"), tiny)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(source / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    return buffer.getvalue()


def test_download_checks_md5_then_extracts(tmp_path, tiny, monkeypatch):
    archive = make_archive(tmp_path, tiny)
    urls = []

    def fake_urlopen(url, timeout=None):
        urls.append(url)
        return io.BytesIO(archive)
    monkeypatch.setattr(cifar10.urllib.request, "urlopen", fake_urlopen)
    data = tmp_path / "data"
    with pytest.raises(FileNotFoundError, match="md5"):       # the real md5 cannot match
        load_cifar10(str(data), "test")
    assert not (data / "cifar-10-python.tar.gz").exists()      # a bad download is not kept
    monkeypatch.setattr(cifar10, "MD5", hashlib.md5(archive).hexdigest())
    x, y = load_cifar10(str(data), "test")
    assert urls == [cifar10.URL] * 2
    assert np.array_equal(x, tiny[2]) and np.array_equal(y, tiny[3])
    assert (data / "cifar-10-python.tar.gz").read_bytes() == archive
    x, _ = load_cifar10(str(data), "train")                    # already extracted: no download
    assert len(urls) == 2 and np.array_equal(x, tiny[0])


def test_local_archive_is_extracted_without_network(tmp_path, tiny, monkeypatch):
    archive = make_archive(tmp_path, tiny)
    data = tmp_path / "data"
    data.mkdir()
    (data / "cifar-10-python.tar.gz").write_bytes(archive)
    monkeypatch.setattr(cifar10.urllib.request, "urlopen", None)   # any use would fail
    with pytest.raises(FileNotFoundError, match="delete it and retry"):
        load_cifar10(str(data), "train")                          # md5 differs from the real one
    monkeypatch.setattr(cifar10, "MD5", hashlib.md5(archive).hexdigest())
    x, y = load_cifar10(str(data), "train")
    assert np.array_equal(x, tiny[0]) and np.array_equal(y, tiny[1])


@pytest.mark.parametrize("name,kind", [("../evil", "file"), ("cifar-10-batches-py/../../evil", "file"),
                                       ("/tmp/evil-absolute", "file"), ("cifar-10-batches-py/link", "symlink")])
def test_extraction_rejects_malicious_members(tmp_path, name, kind):
    archive = tmp_path / "bad.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        good = tarfile.TarInfo("cifar-10-batches-py/test_batch")
        good.size = 3
        tar.addfile(good, io.BytesIO(b"abc"))
        bad = tarfile.TarInfo(name)
        if kind == "symlink":
            bad.type, bad.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(bad)
        else:
            bad.size = 4
            tar.addfile(bad, io.BytesIO(b"evil"))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError, match="refusing member") as info:
        safe_extract(str(archive), str(out))
    assert repr(name) in str(info.value)
    assert os.listdir(out) == []                   # checked before anything is extracted
    assert not (tmp_path / "evil").exists()


def test_preprocess_normalises_per_channel():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(4, 3, 32, 32), dtype=np.uint8)
    out = preprocess(images)
    assert out.dtype == np.float32 and out.shape == images.shape
    mean = np.array([0.4914, 0.4822, 0.4465]).reshape(1, 3, 1, 1)
    std = np.array([0.2470, 0.2435, 0.2616]).reshape(1, 3, 1, 1)
    assert np.allclose(out, (images / 255.0 - mean) / std, atol=1e-5)
    assert np.allclose(preprocess(np.zeros((1, 3, 2, 2), np.uint8))[0, :, 0, 0], -mean.ravel() / std.ravel())
    with pytest.raises(ValueError, match="uint8"):
        preprocess(images.astype(np.float32))


def test_augment_matches_hand_computed_crops_and_flips():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(64, 3, 32, 32), dtype=np.uint8)
    out = augment(images, np.random.default_rng(42))
    assert out.dtype == np.float32 and out.shape == (64, 3, 32, 32)
    # the documented draws, done by hand, one image at a time
    draws = np.random.default_rng(42)
    offsets = draws.integers(0, 9, size=(64, 2))
    flips = draws.random(64) < 0.5
    padded = np.zeros((64, 3, 40, 40), np.uint8)
    padded[:, :, 4:36, 4:36] = images
    for i in range(64):
        r, c = offsets[i]
        crop = padded[i, :, r:r + 32, c:c + 32]
        if flips[i]:
            crop = crop[:, :, ::-1]
        assert np.array_equal(out[i], preprocess(crop[None])[0]), i
    # both kinds of flip and real (off-centre) crops happened; the output is not the input
    assert 0 < flips.sum() < 64 and (offsets != 4).any(axis=1).sum() > 40
    assert not np.allclose(out, preprocess(images))
    # an image shifted by the crop: offset (0, 0) puts 4 rows and columns of zero padding top-left
    zero = preprocess(np.zeros((1, 3, 1, 1), np.uint8))[0, :, 0, 0]
    i = next(k for k in range(64) if offsets[k, 0] == 0 and not flips[k])
    assert np.array_equal(out[i, :, :4, :], np.broadcast_to(zero[:, None, None], (3, 4, 32)))


def test_augment_is_deterministic_per_rng():
    images = np.random.default_rng(1).integers(0, 256, size=(8, 3, 32, 32), dtype=np.uint8)
    a = augment(images, np.random.default_rng(5))
    b = augment(images, np.random.default_rng(5))
    c = augment(images, np.random.default_rng(6))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert images.flags.writeable and np.array_equal(images, np.random.default_rng(1).integers(
        0, 256, size=(8, 3, 32, 32), dtype=np.uint8))          # the input is left alone


def test_flip_alone_on_a_known_image():
    # offsets (4, 4) is the centre crop; a flip then mirrors the columns exactly
    image = np.arange(3 * 32 * 32, dtype=np.int64).reshape(1, 3, 32, 32).__mod__(256).astype(np.uint8)

    class Fixed:
        def integers(self, low, high, size):
            return np.full(size, 4)

        def random(self, n):
            return np.zeros(n)             # < 0.5: flip
    out = augment(image, Fixed())
    assert np.array_equal(out, preprocess(image[:, :, :, ::-1]))


def test_load_path_reads_a_directory_or_one_batch_file(tmp_path, tiny):
    write_tiny(str(tmp_path / "cifar-10-batches-py"), tiny)
    x, y = load_path(str(tmp_path), "train")
    assert np.array_equal(x, tiny[0]) and np.array_equal(y, tiny[1])
    x, y = load_path(str(tmp_path / "cifar-10-batches-py" / "test_batch"), "train")   # a file: what it holds
    assert np.array_equal(x, tiny[2]) and np.array_equal(y, tiny[3])
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        load_path(str(tmp_path / "missing"), "train")


def test_load_path_refuses_recordio_with_a_clear_error(tmp_path):
    rec = tmp_path / "cifar10_train"              # no extension: found by RecordIO's magic number
    rec.write_bytes((0xCED7230A).to_bytes(4, "little") + b"\0" * 12)
    for path in (str(rec), str(tmp_path / "cifar10_val.rec"), str(tmp_path / "x.idx")):
        with pytest.raises(ValueError, match="an MXNet RecordIO file"):
            load_path(path, "train")


def test_write_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="uint8"):
        write_cifar10_batches(str(tmp_path), np.zeros((2, 3, 32, 32), np.float32), [0, 1], 10)
    with pytest.raises(ValueError, match="labels"):
        write_cifar10_batches(str(tmp_path), np.zeros((2, 3, 32, 32), np.uint8), [0], 10)
