"""kvstore: a parameter server with MXNet's KVStore API.

Example (inside a script started by ``python -m tracker.local -n 2 -s 1 ...``)::

    import numpy as np, kvstore
    kv = kvstore.create("dist_sync")
    kv.init(3, np.ones((2, 3), np.float32))
    kv.push(3, np.ones((2, 3), np.float32))
    w = np.empty((2, 3), np.float32)
    kv.pull(3, out=w)          # the sum over all workers' pushes
    kv.close()
"""

from __future__ import annotations

import os
import sys

from . import optimizer
from .store import KVStore
from .config import Config
from .errors import (ArgumentTypeError, ConfigError, DeadlineError, InvalidArgumentError,
                     KVStoreError, NodeFailedError, ProtocolError, RemoteError)

__version__ = "0.1.0"

STORE_TYPES = ("local", "dist_sync", "dist_async", "device", "dist_device_sync")


def create(name: str = "local", *, config: Config | None = None) -> KVStore:
    """Create a store: ``"local"``, ``"dist_sync"``, ``"dist_async"``, or the GPU-aggregating
    ``"device"`` and ``"dist_device_sync"`` (docs/gpu.md; CPU without a GPU).

    Distributed stores read their settings from the environment a launcher sets
    (``config`` overrides it, e.g. in tests). As in MXNet, a process whose role
    is ``server`` or ``scheduler`` (``DMLC_ROLE``) runs that role here and exits,
    so a job whose every process runs the training script also works.

    Raises ConfigError for an unknown type (listing the valid ones) or missing settings.
    """
    if not isinstance(name, str):
        raise ArgumentTypeError(f"create: the store type must be a str, got {type(name).__name__}")
    if name not in STORE_TYPES:
        raise ConfigError(f"unknown store type {name!r}; valid types: {', '.join(STORE_TYPES)}")
    if name == "local":
        from .local_store import LocalStore
        return LocalStore(name)
    if name == "device":
        from .device import DeviceStore
        return DeviceStore(name)
    config = config if config is not None else Config.from_env(os.environ)
    if config.role in ("server", "scheduler"):
        sys.exit(_run_role(config))
    if name == "dist_device_sync":
        from .device import DistDeviceStore
        return DistDeviceStore(name, config)
    from .dist import DistStore
    return DistStore(name, config)


def _run_role(config: Config) -> int:
    if config.role == "server":
        from . import server
        return server.run(config)
    from tracker import scheduler
    return scheduler.serve(os.environ)


__all__ = ["create", "KVStore", "Config", "optimizer", "STORE_TYPES", "KVStoreError",
           "ConfigError", "InvalidArgumentError", "ArgumentTypeError", "ProtocolError",
           "RemoteError", "DeadlineError", "NodeFailedError"]
