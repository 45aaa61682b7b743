"""kvstore.fileio: atomic writes and the versioned msgpack files built on them
(server checkpoints, optimizer states)."""

import msgpack
import pytest

from kvstore.errors import InvalidArgumentError
from kvstore.fileio import atomic_write, read_versioned, write_versioned


def test_round_trip(tmp_path):
    path = str(tmp_path / "f")
    write_versioned(path, "kvstore.test", 3, {"a": [1, b"x"]})
    assert read_versioned(path, "kvstore.test", 3, "test file") == \
        {"format": "kvstore.test", "version": 3, "a": [1, b"x"]}


def test_a_failed_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_write(str(path)) as f:
            f.write(b"half")
            raise RuntimeError("crash")
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["f"]


@pytest.mark.parametrize("content, match", [
    (None, "cannot read test file from .*No such file"),
    (b"\xc1garbage", "cannot read test file from"),
    (msgpack.packb([1, 2]), "is not a kvstore test file"),
    (msgpack.packb({"format": "other", "version": 3}), "is not a kvstore test file"),
    (msgpack.packb({"format": "kvstore.test", "version": 4}), "has test file version 4; .* reads version 3"),
])
def test_bad_files_are_named(tmp_path, content, match):
    path = tmp_path / "f"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(InvalidArgumentError, match=match):
        read_versioned(str(path), "kvstore.test", 3, "test file")


def test_a_missing_file_can_have_its_own_message(tmp_path):
    with pytest.raises(InvalidArgumentError, match="^no checkpoint here$"):
        read_versioned(str(tmp_path / "nope"), "kvstore.test", 3, "test file", missing="no checkpoint here")
