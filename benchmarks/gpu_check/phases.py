"""Where a ResNet-50 exchange with CUDA tensors spends its time: every copy and
sum that one ``dist_device_sync`` pushpull to a co-located GPU server makes, each
timed on its own on one device (``python -m benchmarks.gpu_check --only phases``).

The ``exchange`` section times the whole pushpull; this one splits it into the
steps the data takes, in the order they run, so that the next change goes where
the time is. Two paths:

- ``cuda_ipc`` (what runs between a GPU worker and a co-located GPU server,
  kvstore/transport/links/cuda_ipc_link.py), for ResNet-50's 161 keys and for the
  19 flat buckets of ``Trainer(flat_buckets=True)``, Python included:
  ``worker stage`` (kvstore/devices/slots.py: the values into their exportable
  slots, one batched copy, the stream synchronised), ``server round`` (the sum of
  W=2 pushes plus an SGD-momentum update over the round's chunks, at the GPU
  servers' default 64 MiB chunks), ``worker reply copy`` (the servers' values into
  one block, one batched copy) and ``worker spread`` (the block into the outputs,
  ``write_many``);
- ``host`` (shared memory: a GPU server whose workers cannot export device memory;
  CPU servers use its worker half): ``worker pack`` (161 gradients into one flat
  buffer), ``worker d2h -> shm`` (shared memory is pageable) and, for comparison,
  ``-> pinned``, ``server stage`` (shm -> pinned host memcpy) and ``server h2d``,
  against ``server h2d from shm`` (driver-staged: what runs), ``worker h2d`` and
  ``worker spread`` (a server's reply to shared memory is one download, as ``worker
  d2h -> shm``).

Runs on any :class:`kvstore.devices.Device` and
:class:`kvstore.devices.base.Accelerators` with exportable memory: CI runs it on
the host implementations (tests/benchmarks/test_gpu_check.py) so that it keeps
working between GPU loans."""

from __future__ import annotations

import contextlib
import statistics
import time

import numpy as np

from kvstore.sharding import split

from benchmarks.harness.key_layouts import buckets
from benchmarks.harness.resnet50_shapes import resnet50_shapes, size


def phases(device, acc=None, workers: int = 2, chunk_bytes: int = 64 << 20, reps: int = 10, shapes=None,
           bucket_values: int = 1 << 20) -> dict:
    """Median milliseconds of each step of one exchange, plus the bytes it moves:
    the server's steps on ``device``, the worker's on ``device`` (host path) and on
    ``acc`` (cuda_ipc path, skipped when None). ``shapes`` defaults to ResNet-50's
    parameters; the buckets hold ``bucket_values`` float32 each (the Trainer's 4 MiB)."""
    sizes = [size(s) for _, s in resnet50_shapes()] if shapes is None else [size(s) for s in shapes]
    layouts = {f"{len(sizes)} keys": sizes}
    bucketed = buckets(sizes[::-1], bucket_values)
    layouts[f"{len(bucketed)} buckets"] = bucketed
    timer = Timer(reps)
    rows = host_rows(device, sizes, timer)
    for label, layout in layouts.items():
        rows.append(server_round_row(device, layout, chunk_bytes, workers, timer, label))
        if acc is not None:
            rows += ipc_rows(acc, layout, timer, label)
    nbytes = sum(sizes) * 4
    return {"tensors": len(sizes), "mb": round(nbytes / 1e6, 1), "layouts": list(layouts),
            "chunk_bytes": chunk_bytes, "workers": workers, "device": device.describe(),
            "rows": [{"path": path, "phase": name, "ms": round(ms, 3), "gb_s": round(moved / ms / 1e6, 1)}
                     for path, name, ms, moved in rows]}


class Timer:
    """The median of ``reps`` runs of a step after two warm-ups (kernels compiled,
    pools filled), each followed by ``sync()`` (the step's device work done)."""

    def __init__(self, reps: int):
        self.reps = reps

    def __call__(self, fn, sync, scope=contextlib.nullcontext) -> float:
        samples = []
        for i in range(self.reps + 2):
            t0 = time.perf_counter()
            with scope():
                fn()
            sync()
            if i >= 2:
                samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)


def host_rows(device, sizes: list[int], timed: Timer) -> list[tuple]:
    """The host path's copies (shared memory between the worker and the server)."""
    from kvstore.transport.shm import Arena
    xp = device.xp
    total = sum(sizes)
    nbytes = total * 4
    arena = Arena("phases")
    try:
        with device.scope():
            grads = [device.empty(n, np.float32) for n in sizes]
            for g in grads:
                g.fill(1.0)
            flat = device.empty(total, np.float32)
        pinned = device.pinned_empty(total, np.float32)
        shm = arena.alloc(total, np.float32)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()

        def pack():
            for g, a, b in zip(grads, offsets, offsets[1:]):
                xp.copyto(flat[a:b], g)

        def spread():
            for g, a, b in zip(grads, offsets, offsets[1:]):
                xp.copyto(g, flat[a:b])

        def on_device(name, fn, moved):
            return ("host", name, timed(fn, device.synchronize, device.scope), moved)
        return [on_device("worker pack", pack, nbytes * 2),
                on_device("worker d2h -> shm", lambda: device.download(flat, shm), nbytes),
                on_device("worker d2h -> pinned", lambda: device.download(flat, pinned), nbytes),
                on_device("server stage (shm -> pinned)", lambda: np.copyto(pinned, shm), nbytes * 2),
                on_device("server h2d", lambda: device.upload(flat, pinned), nbytes),
                on_device("server h2d from shm (what runs: driver-staged)", lambda: device.copy_in(flat, shm), nbytes),
                on_device("worker h2d (pinned)", lambda: device.upload(flat, pinned), nbytes),
                on_device("worker spread", spread, nbytes * 2)]
    finally:
        arena.close()


def server_round_row(device, sizes: list[int], chunk_bytes: int, workers: int, timed: Timer, label: str) -> tuple:
    """The server's round over ``sizes`` (one key each): W pushes summed, SGD momentum."""
    from kvstore import optimizer as opt
    from kvstore.server.backend import DeviceBackend
    from kvstore.server.state import ServerState
    from kvstore.transport.shm import Arena
    arena = Arena("phases-server")
    try:
        backend = DeviceBackend(device, host=arena)
        state = ServerState(name="phases", backend=backend)
        state.handle(b"w", {"op": "configure", "id": 1, "src": 0, "mode": "sync", "num_workers": workers}, [])
        pieces = [(k, i, b - a) for k, n in enumerate(sizes) for i, (a, b) in enumerate(split(n, 4, chunk_bytes))]
        cids = [(k, i) for k, i, _ in pieces]
        state.handle(b"w", {"op": "init", "id": 2, "src": 0, "chunks": [list(c) for c in cids]},
                     [np.zeros(n, np.float32) for _, _, n in pieces])
        sgd = opt.SGD(learning_rate=0.1, momentum=0.9)
        state.handle(b"w", {"op": "set_optimizer", "id": 3, "src": 0, "optimizer": sgd.to_config()}, [])
        with backend.scope():
            pushes = [[device.empty(n, np.float32) for _, _, n in pieces] for _ in range(workers)]
            for w, arrays in enumerate(pushes):
                for a in arrays:
                    a.fill(0.5 * (w + 1))
        chunks = [(cid, state.chunks[cid]) for cid in cids]

        def server_round():
            for j, (cid, chunk) in enumerate(chunks):
                for w in range(workers):
                    state.consistency.contribute(cid, chunk, frozenset({w}), pushes[w][j])
                state.consistency.apply_complete(cid, chunk)
        ms = timed(server_round, device.synchronize, device.scope)
        return ("both", f"server round, {label} (sum of {workers} + sgd momentum, {len(chunks)} chunks)", ms,
                sum(sizes) * 4 * (workers + 4))
    finally:
        arena.close()


def ipc_rows(acc, sizes: list[int], timed: Timer, label: str) -> list[tuple]:
    """The cuda_ipc path's worker steps on device 0 of ``acc``, Python included."""
    from kvstore.devices.slots import DeviceSlots
    nbytes = sum(sizes) * 4
    grads = [acc.to_device(np.ones(n, np.float32), 0) for n in sizes]
    outs = [acc.empty(0, n, np.float32) for n in sizes]
    replies = [acc.to_device(np.full(n, 2.0, np.float32), 0) for n in sizes]   # stand for a server's values
    block = acc.empty(0, sum(sizes), np.float32)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    views = [block[a:b] for a, b in zip(offsets, offsets[1:])]
    slots = DeviceSlots(acc)
    keys = list(range(len(sizes)))

    def stage():
        slots.stage("phases", keys, grads)
        slots.release("phases")

    def sync():
        acc.sharing.publish(0)

    def on(name, fn, moved):
        return ("cuda_ipc", f"{name}, {label}", timed(fn, sync, lambda: acc.on(0)), moved)
    return [on("worker stage (slots, one batched copy, sync)", stage, nbytes * 2),
            on("worker reply copy (one batched copy into a block)", lambda: acc.copy_many(views, replies), nbytes * 2),
            on("worker spread (write_many)", lambda: acc.write_many(outs, views), nbytes * 2)]


def report(result: dict) -> list[str]:
    lines = [f"{result['mb']} MB in {result['tensors']} tensors ({' or '.join(result['layouts'])}), server chunks "
             f"of at most {result['chunk_bytes'] >> 20} MiB, W={result['workers']}, on {result['device']}; each step "
             "alone, median ms (GB/s of the bytes it reads and writes).", "",
             "| path | step | ms | GB/s |", "|---|---|---:|---:|"]
    lines += [f"| {r['path']} | {r['phase']} | {r['ms']} | {r['gb_s']} |" for r in result["rows"]]
    return lines + [""]
