"""A server's checkpoint as data: what :meth:`ServerState.snapshot` writes and
:meth:`ServerState.restore` reads (the files around it: kvstore.server.checkpoint).

Everything acknowledged so far goes in: each chunk's value after its last applied
round, the optimizer and each chunk's state; pushes of an incomplete round (not yet
acknowledged to anyone) do not. Pure functions: no sockets, threads or clocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .. import optimizer as _optimizer
from ..errors import CheckpointError
from .server_optimizer import ServerOptimizer
from .rounds import StoredChunk


def take(name: str, mode, num_workers, chunks: dict, optimizer: ServerOptimizer,
         to_numpy: Callable, meta: dict, dyn_tables: list | None = None) -> dict:
    """The snapshot of a server ``name`` (its mode, ranks, chunks and optimizer, and
    its dynamic row tables: kvstore.server.dyntables' snapshot)."""
    states = optimizer.updater.get_states() if optimizer.updater is not None else {}
    entries = []
    for cid, chunk in chunks.items():
        entry = states.get(cid)
        entries.append([cid[0], cid[1], chunk.value.dtype.str, to_numpy(chunk.value).tobytes(),
                        None if entry is None else int(entry["t"]),
                        [] if entry is None else [to_numpy(x).tobytes() for x in entry["state"]]])
    return {"server": name, "mode": mode, "num_workers": num_workers, "optimizer": optimizer.config(),
            "state_version": _optimizer.STATE_VERSION,     # what the state arrays mean (NAG: MXNet's)
            "meta": dict(meta), "chunks": entries, "dyn_tables": list(dyn_tables or [])}


@dataclass
class Restored:
    """What a snapshot gives back: the server's mode and ranks, its chunks, the
    checkpoint's meta and (id, step), and its dynamic row tables (as taken)."""
    mode: str | None
    num_workers: int | None
    chunks: dict
    meta: dict
    checkpoint: tuple
    dyn_tables: list


def load(snap: dict, optimizer: ServerOptimizer, alloc: Callable, upload: Callable) -> Restored:
    """Chunks of ``snap`` in fresh memory (``alloc(size, dtype)``, filled by
    ``upload(host, out=...)``), and ``optimizer`` set to its optimizer and states."""
    chunks, states = {}, {}
    config = snap["optimizer"]
    opt = None if config is None else _optimizer.from_config(config)
    # checkpoints before the field kept state version 1 (NAG's momentum without the rate)
    version = snap.get("state_version", 1)
    convert = (lambda t, arrays: arrays) if opt is None or version == _optimizer.STATE_VERSION else \
        (lambda t, arrays: _converted(opt, version, t, arrays))
    # the states' dtype per chunk dtype (multi_precision: float32)
    spec = None if opt is None else opt.state_spec
    for key, index, dtype, data, t, state in snap["chunks"]:
        saved = np.frombuffer(data, dtype=np.dtype(dtype))
        value = alloc(saved.size, saved.dtype)     # shared memory, as init's
        upload(saved, out=value)
        chunks[(key, index)] = StoredChunk(value)
        if t is not None and spec is not None:
            dt = spec(value.dtype)[1]
            states[(key, index)] = {"t": t, "state": convert(t, [np.frombuffer(b, dtype=dt).copy() for b in state])}
    optimizer.restore(config, states)
    dyn_tables = []
    for key, server, dyn_spec, table in snap.get("dyn_tables") or []:
        if table.get("state") is not None:
            arrays = convert(int(table["t"]), [np.frombuffer(data, np.dtype(dt)) for dt, data in table["state"]])
            table = {**table, "state": [[a.dtype.str, a.tobytes()] for a in arrays]}
        dyn_tables.append([key, server, dyn_spec, table])
    return Restored(snap["mode"], snap["num_workers"], chunks, dict(snap.get("meta") or {}),
                    (snap.get("checkpoint"), snap.get("step", 0)), dyn_tables)


def _converted(opt, version, t: int, arrays: list) -> list:
    """``arrays``, a weight's state kept at state version ``version``, in today's meaning
    (:meth:`kvstore.optimizer.Optimizer.state_from`); CheckpointError for a version
    this kvstore cannot read."""
    try:
        return opt.state_from(version, t, arrays)
    except ValueError as e:
        raise CheckpointError(f"the checkpoint's optimizer state: {e}") from None
