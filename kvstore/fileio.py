"""Writing files so that a crash never leaves a half-written one behind."""

from __future__ import annotations

import contextlib
import os
import tempfile


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
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
