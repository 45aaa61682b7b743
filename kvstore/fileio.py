"""Writing files so that a crash never leaves a half-written one behind, and the
versioned msgpack files (server checkpoints, optimizer states) built on it."""

from __future__ import annotations

import contextlib
import os
import tempfile

import msgpack

from .errors import InvalidArgumentError


@contextlib.contextmanager
def atomic_write(path: str):
    """Yield a binary file; on success it replaces ``path`` (temporary file in the
    same directory, fsync, rename). On an exception ``path`` is left untouched.

    Example::

        with atomic_write("model.params") as f:
            f.write(data)
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_directory(directory)     # the rename itself survives a power loss
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def fsync_directory(directory: str) -> None:
    """Make the directory's entries (a rename, a new file) durable; a no-op where
    directories cannot be opened (Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:     # some file systems refuse fsync on a directory
        pass
    finally:
        os.close(fd)


def write_versioned(path: str, fmt: str, version: int, body: dict) -> None:
    """Write ``{"format": fmt, "version": version, **body}`` as msgpack, atomically."""
    with atomic_write(path) as f:
        msgpack.pack({"format": fmt, "version": version, **body}, f, use_bin_type=True)


def read_versioned(path: str, fmt: str, version: int, what: str, missing: str | None = None) -> dict:
    """Read a file written by :func:`write_versioned`. Raises InvalidArgumentError
    naming ``path`` and ``what`` it should be when it cannot be read, is not one,
    or has another version (``missing``: the message for a file that does not exist)."""
    try:
        with open(path, "rb") as f:
            body = msgpack.unpack(f, raw=False, strict_map_key=False)
    except FileNotFoundError as e:
        if missing is not None:
            raise InvalidArgumentError(missing) from None
        raise InvalidArgumentError(f"cannot read {what} from {path}: {e}") from e
    except (OSError, ValueError, msgpack.UnpackException) as e:
        raise InvalidArgumentError(f"cannot read {what} from {path}: {e}") from e
    check_format(body, path, fmt, version, what)
    return body


def check_format(body, path: str, fmt: str, version: int, what: str, error: type = InvalidArgumentError) -> None:
    """Raise ``error`` naming ``path`` unless ``body`` is a map of format ``fmt``, version ``version``."""
    if not isinstance(body, dict) or body.get("format") != fmt:
        raise error(f"{path} is not a kvstore {what}")
    if body.get("version") != version:
        raise error(f"{path} has {what} version {body.get('version')!r}; this kvstore reads version {version}")
