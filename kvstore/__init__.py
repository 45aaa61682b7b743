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
from .worker.store import KVStore
from .worker.types import FROM_CONFIG, STORE_TYPES, KVStoreBase, resolve, staleness_bound
from .config import Config
from .rows.rowinit import RowInit
from .rows.dynamic import DynamicRows
from .rows.sparse import RowSparse
from .errors import (ArgumentTypeError, CheckpointError, ConfigError, DeadlineError,
                     InvalidArgumentError, KVStoreError, NodeFailedError, ProtocolError, RemoteError)

__version__ = "0.1.0"


def create(name: str = "local", *, config: Config | None = None, staleness=FROM_CONFIG,
           deterministic=FROM_CONFIG) -> KVStoreBase:
    """Create a store: ``"local"``, ``"dist_sync"``, ``"dist_async"``, ``"dist_ssp"``, or the
    GPU-aggregating ``"device"`` and ``"dist_device_sync"`` (docs/gpu.md; CPU without a GPU).

    ``"dist_ssp"`` (bounded staleness, docs/staleness.md) lets a worker run at most
    ``staleness`` steps ahead of the slowest one: an int >= 0 (0 is exactly
    dist_sync), or ``None``/``"inf"`` (dist_async); by default the job's
    ``KVSTORE_STALENESS`` (1). Only dist_ssp takes ``staleness``.

    ``deterministic=True`` (by default the job's ``KVSTORE_DETERMINISTIC``): the
    servers add a round's pushes in worker-rank order whatever their arrival, so
    the same job on the same data gives the same bits at any number of workers
    (dist_sync and dist_device_sync; dist_async and dist_ssp refuse it: they apply
    each push as it arrives). Every worker must pass the same. ``local`` and
    ``device`` always sum a list of values in list order.

    Names match in any case; MXNet's aliases ``"dist_sync_device"``,
    ``"local_update_cpu"``, ``"local_allreduce_cpu"`` and ``"local_allreduce_device"`` work, and
    ``kv.type`` is the name given, lower-cased. A class registered with
    :meth:`KVStoreBase.register` is built, with no arguments, under its class
    name (kvstore.worker.types).

    Distributed stores read their settings from the environment a launcher sets
    (``config`` overrides it, e.g. in tests). As in MXNet, a process whose role
    is ``server`` or ``scheduler`` (``DMLC_ROLE``) runs that role here and exits,
    so a job whose every process runs the training script also works.

    Raises ConfigError for an unknown type (listing the valid ones), for MXNet's
    ``nccl``, ``horovod`` and ``byteps`` (naming what to use instead) or missing
    settings; ArgumentTypeError for a name that is not a str; InvalidArgumentError (or
    ArgumentTypeError) for a ``staleness`` that is not a bound or not for dist_ssp.
    """
    kind = resolve(name)
    if staleness is not FROM_CONFIG and kind != "dist_ssp":
        raise InvalidArgumentError(f"create: staleness applies to 'dist_ssp' only, not {name!r}")
    if deterministic is not FROM_CONFIG and not isinstance(deterministic, bool):
        raise ArgumentTypeError(f"create: deterministic must be True or False, got {deterministic!r}")
    if not isinstance(kind, str):
        return kind()
    if deterministic is not FROM_CONFIG and kind not in ("local", "device"):
        config = (config if config is not None else _config_from_env()).replace(deterministic=deterministic)
    return _builtin(kind, name.lower(), config, staleness)


def _builtin(kind: str, name: str, config: Config | None, staleness) -> KVStore:
    """The built-in store of type ``kind``, built under the ``name`` given to create
    (an alias stays as given: MXNet's ``kv.type``)."""
    if kind == "local":
        from .worker.local import LocalStore
        return LocalStore(name)
    if kind == "device":
        from .worker.device import DeviceStore
        return DeviceStore(name)
    config = config if config is not None else _config_from_env()
    if config.role in ("server", "scheduler"):
        sys.exit(_run_role(config))
    if kind == "dist_device_sync":
        from .worker.device import DistDeviceStore
        return DistDeviceStore(name, config)
    from .worker.dist import DistStore
    if kind == "dist_ssp":
        return DistStore(name, config, staleness_bound(staleness, config.staleness))
    return DistStore(name, config)


def _config_from_env() -> Config:
    """The job's settings from the environment; under torch's launchers (torchrun,
    PyTorchJob), after forming the job from their variables (tracker/torch_job.py)."""
    from tracker import torch_job
    from tracker.control.env import EnvError
    try:
        job = torch_job.detect(os.environ)
    except EnvError as e:
        raise ConfigError(f"torch's launcher variables: {e}") from None
    if job is None:
        return Config.from_env(os.environ)
    return Config.from_env({**os.environ, **torch_job.join(job, os.environ)})


def _run_role(config: Config) -> int:
    if config.role == "server":
        from . import server
        return server.run(config)
    from tracker import scheduler
    return scheduler.serve(os.environ)


__all__ = ["create", "KVStore", "KVStoreBase", "Config", "RowSparse", "RowInit", "DynamicRows", "optimizer", "STORE_TYPES", "KVStoreError",
           "ConfigError", "InvalidArgumentError", "ArgumentTypeError", "ProtocolError",
           "RemoteError", "DeadlineError", "NodeFailedError", "CheckpointError"]
