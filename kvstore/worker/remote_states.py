"""Optimizer states that live on the servers, chunk by chunk: gathered into one
array per key and state for ``save_optimizer_states``, cut into chunks again and
sent back for ``load_optimizer_states`` (the dist stores' ``_get_states`` and
``_set_states``; kvstore/worker/states_file.py writes and reads the file)."""

from __future__ import annotations

import numpy as np

from ..rows import dist as rows
from ..protocol import ops


def gather(client, keys: dict, optimizer, pull) -> dict:
    """``{key: {"t": updates, "state": [arrays shaped like the key]}}`` for every key
    of ``keys`` ({key: KeyInfo}) that has a state. A chunk not updated yet (async)
    gets a fresh state, made from ``pull(info)`` (the key's current value) when the
    optimizer keeps a float32 master copy of a float16 weight, else from zeros.
    The caller first completes every call of its own in flight (its exchange's flush)."""
    found: dict[tuple, tuple[int, list]] = {}

    def collect(header, values):
        pos = 0
        for key, index, t, count in header["states"]:
            found[(key, index)] = (t, values[pos:pos + count])
            pos += count
    client.request_all(ops.GET_STATES, "save_optimizer_states", on_reply=collect)
    states = {}
    for key, info in keys.items():
        if info.sparse:                       # one shard per server, rows interleaved
            whole = rows.gather_states(info, found, len(client.servers),
                                       lambda s: _fresh_rows(info, s, len(client.servers), optimizer, pull))
            if whole is not None:
                states[key] = whole
            continue
        per_chunk = [found.get((key, c.index)) for c in info.chunks]
        if all(p is None for p in per_chunk):
            continue  # never updated: no state yet
        parts, ts = [], []
        for chunk, entry in zip(info.chunks, per_chunk):
            if entry is None:  # async: this chunk not updated yet
                if optimizer.keeps_master(info.dtype):
                    base = pull(info)[chunk.start:chunk.stop]
                else:
                    base = np.zeros(chunk.size, info.dtype)
                entry = (0, list(optimizer.create_state(base)))
            ts.append(entry[0])
            parts.append(entry[1])
        joined = [np.concatenate([p[i].reshape(-1) for p in parts]).reshape(info.shape)
                  for i in range(len(parts[0]))]
        states[key] = {"t": max(ts), "state": joined}
    return states


def scatter(client, keys: dict, optimizer, states: dict) -> None:
    """Send ``states`` (as :func:`gather` returns them) to the servers that hold
    each chunk; waits for every server."""
    groups: dict[int, tuple[list, list]] = {}
    for key, entry in states.items():
        info = keys[key]
        dtype = optimizer.state_spec(info.dtype)[1]   # float32 with a master copy
        flats = [np.ascontiguousarray(s, dtype=dtype).reshape(-1) for s in entry["state"]]
        if info.sparse:
            for server, (m, p) in rows.split_states(info, entry["t"], flats, len(client.servers)).items():
                meta, parts = groups.setdefault(server, ([], []))
                meta.append(m)
                parts += p
            continue
        for chunk in info.chunks:
            meta, parts = groups.setdefault(chunk.server, ([], []))
            meta.append([key, chunk.index, entry["t"], len(flats)])
            parts += [f[chunk.start:chunk.stop] for f in flats]
    ids = [client.request(server, ops.SET_STATES, "load_optimizer_states", parts, states=meta)[0]
           for server, (meta, parts) in groups.items()]
    client.wait(ids, "load_optimizer_states")


def _fresh_rows(info, server: int, servers: int, optimizer, pull) -> list:
    """The state of a row-sparse shard no push reached yet: zeros, or (a float32
    master copy of float16 rows) made from the shard's current rows."""
    mine = np.arange(server, info.shape[0], servers)
    width = info.size // info.shape[0]
    if optimizer.keeps_master(info.dtype):
        base = pull(info, mine).reshape(-1)
    else:
        base = np.zeros(len(mine) * width, info.dtype)
    return list(optimizer.create_state(base))
