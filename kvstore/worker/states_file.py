"""The optimizer-state file: msgpack, no pickle, written atomically.

Layout (a msgpack map)::

    {"format": "kvstore.optimizer_states", "version": 2,
     "optimizer": null | {"name": ..., "params": {...}, "lr_scheduler": ...},
     "states": [[key, t, [[dtype, shape, bytes], ...]], ...]}

``t`` is the number of updates the key has received (it drives learning-rate
schedules and Adam's bias correction). Every store type reads and writes the same
format, so states saved by a ``dist_sync`` job load into a ``local`` store.

The version is that of what the state arrays mean
(:data:`kvstore.optimizer.STATE_VERSION`). Version 1 held NAG's momentum without
the learning rate; a version-1 file that names its optimizer is read with the
optimizer's conversion (:meth:`~kvstore.optimizer.Optimizer.state_from`, a
UserWarning says so), one that does not is refused, since nothing tells whether it
holds NAG's momentum: :func:`upgrade` converts it, given the optimizer that wrote it.
"""

from __future__ import annotations

import warnings

import numpy as np

from .. import optimizer as _optimizer
from ..errors import ConfigError, InvalidArgumentError
from ..fileio import read_versioned, write_versioned
from ..protocol.codec import ALLOWED_DTYPES

FORMAT = "kvstore.optimizer_states"
VERSION = _optimizer.STATE_VERSION
WHAT = "optimizer-state file"


def dump(path: str, optimizer: dict | None, states: dict) -> None:
    """Write ``states`` ({key: {"t": int, "state": [arrays]}}) to ``path`` atomically."""
    body = {
        "optimizer": optimizer,
        "states": [[key, int(entry["t"]),
                    [[a.dtype.str, list(a.shape), np.ascontiguousarray(a).tobytes()]
                     for a in entry["state"]]]
                   for key, entry in states.items()],
    }
    write_versioned(path, FORMAT, VERSION, body)


def load(path: str) -> tuple[dict | None, dict]:
    """Read a file written by :func:`dump` (or a version-1 file that names its optimizer,
    converted). Raises InvalidArgumentError if it is not one, or is a version-1 file
    without its optimizer (see :func:`upgrade`)."""
    body, version = _read(path)
    config, states = body.get("optimizer"), _states(path, body)
    if version == VERSION:
        return config, states
    if config is None:
        raise InvalidArgumentError(
            f"{path} is an {WHAT} of version {version}, which kept NAG's momentum without the learning rate "
            f"(momentum * mom + grad; since version {VERSION} it is MXNet's, momentum * mom - lr * grad), and it "
            "does not name the optimizer that wrote it, so its arrays cannot be read safely: convert it with "
            f"kvstore.worker.states_file.upgrade({path!r}, optimizer), giving that optimizer")
    converted = _converted(path, version, _optimizer.from_config(config), states)
    return config, converted


def upgrade(path: str, optimizer, out: str | None = None) -> None:
    """Rewrite the optimizer-state file ``path`` (of an older version) as the current
    version, into ``out`` (default: ``path`` itself, atomically), reading its arrays
    as ``optimizer`` (an Optimizer or its config: the one that wrote the file) kept
    them. Raises InvalidArgumentError if ``path`` is not an optimizer-state file, or
    ``optimizer`` differs from one the file names, and ConfigError for a bad config.

    Example: ``upgrade("states.bin", kvstore.optimizer.NAG(learning_rate=0.1, momentum=0.9))``
    """
    if isinstance(optimizer, dict):
        optimizer = _optimizer.from_config(optimizer)
    if not isinstance(optimizer, _optimizer.Optimizer):
        raise ConfigError(f"upgrade: optimizer must be an Optimizer or its config, got {type(optimizer).__name__}")
    body, version = _read(path)
    config, states = body.get("optimizer"), _states(path, body)
    if config is not None and _optimizer.from_config(config).to_config() != optimizer.to_config():
        raise InvalidArgumentError(f"upgrade: {path} was written by {config!r}, not {optimizer.to_config()!r}")
    if version != VERSION:
        states = _converted(path, version, optimizer, states)
    dump(out or path, config, states)


def _read(path: str) -> tuple[dict, int]:
    """The file's body and version (this one or 1)."""
    try:
        return read_versioned(path, FORMAT, VERSION, WHAT), VERSION
    except InvalidArgumentError as current:
        try:
            return read_versioned(path, FORMAT, 1, WHAT), 1
        except InvalidArgumentError:
            raise current from None


def _states(path: str, body: dict) -> dict:
    states = {}
    try:
        for key, t, arrays in body["states"]:
            parsed = []
            for dtype, shape, data in arrays:
                if dtype not in ALLOWED_DTYPES:
                    raise ValueError(f"dtype {dtype!r} not allowed")
                parsed.append(np.frombuffer(data, dtype=dtype).reshape(shape).copy())
            states[key] = {"t": int(t), "state": parsed}
    except (TypeError, ValueError, KeyError) as e:
        raise InvalidArgumentError(f"{path!r} is corrupt: {e}") from e
    return states


def _converted(path: str, version: int, optimizer, states: dict) -> dict:
    """``states`` of file version ``version`` read as ``optimizer`` kept them, in the
    current meaning (a UserWarning when that changed an array)."""
    out = {}
    for key, entry in states.items():
        try:
            arrays = optimizer.state_from(version, entry["t"], list(entry["state"]))
        except ValueError as e:
            raise InvalidArgumentError(f"{path}: {e}") from None
        out[key] = {"t": entry["t"], "state": arrays}
    if any(a is not b for key in states for a, b in zip(states[key]["state"], out[key]["state"])):
        warnings.warn(f"{path} is an {WHAT} of version {version}: the state of {optimizer!r} was converted to "
                      f"what it means since version {VERSION} (see {type(optimizer).__name__}.state_from)",
                      UserWarning, stacklevel=3)
    return out
