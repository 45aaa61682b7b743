"""Where a ResNet-50 exchange with CUDA tensors spends its time: every copy and
sum that one ``dist_device_sync`` pushpull to a co-located GPU server makes, each
timed on its own on one device (``python -m benchmarks.gpu_check --only phases``).

The ``exchange`` section times the whole pushpull; this one splits it into the
steps the data takes (kvstore/worker/device.py on the worker, kvstore/server/backend.py
and state.py on the server), in the order they run, so that the next change goes
where the time is:

1. ``worker pack``: the 161 gradients copied device-to-device into one flat buffer;
2. ``worker d2h -> shm`` (what runs today: shared memory is pageable) and, for
   comparison, ``worker d2h -> pinned``;
3. ``server stage``: the pushed bytes copied from shared memory into pinned memory
   (host memcpy) and ``server h2d`` from there to the server's GPU (what ran until
   2026-11-27), against ``server h2d from shm``, the driver staging it (what runs);
4. ``server round``: the server's sum of W=2 pushes plus an SGD-momentum update over
   the exchange's chunks (ResNet-50's keys cut at the default chunk size);
5. ``server d2h -> shm``: a reply's values packed on the device and downloaded
   into one shared-memory block (``DeviceBackend.download``);
6. ``worker h2d``: the reply block, pinned, to the GPU, then spread to 161 outputs.

Runs on any :class:`kvstore.devices.Device`: CI runs it on the host device
(tests/benchmarks/test_gpu_check.py) so that it keeps working between GPU loans."""

from __future__ import annotations

import importlib
import statistics
import time

import numpy as np

from kvstore.sharding import split

try:
    from benchmarks.harness.resnet50_shapes import resnet50_shapes, size
except ImportError:             # run as a script: the module beside this file
    _shapes = importlib.import_module("resnet50_shapes")
    resnet50_shapes, size = _shapes.resnet50_shapes, _shapes.size


def phases(device, workers: int = 2, chunk_bytes: int = 2 << 20, reps: int = 10, shapes=None) -> dict:
    """Median milliseconds of each step of one exchange on ``device``, plus the
    bytes it moves. ``shapes`` defaults to ResNet-50's parameters."""
    from kvstore import optimizer as opt
    from kvstore.server.backend import DeviceBackend
    from kvstore.server.state import ServerState
    from kvstore.transport.shm import Arena

    xp = device.xp
    sizes = [size(s) for _, s in resnet50_shapes()] if shapes is None else [size(s) for s in shapes]
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

        def timed(fn) -> float:
            samples = []
            for i in range(reps + 2):              # two warm-ups: kernels compiled, pools filled
                t0 = time.perf_counter()
                with device.scope():
                    fn()
                device.synchronize()
                if i >= 2:
                    samples.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(samples)

        def pack():
            for g, a, b in zip(grads, offsets, offsets[1:]):
                xp.copyto(flat[a:b], g)

        def spread():
            for g, a, b in zip(grads, offsets, offsets[1:]):
                xp.copyto(g, flat[a:b])

        rows = [("worker pack", timed(pack), nbytes * 2),
                ("worker d2h -> shm", timed(lambda: device.download(flat, shm)), nbytes),
                ("worker d2h -> pinned", timed(lambda: device.download(flat, pinned)), nbytes),
                ("server stage (shm -> pinned)", timed(lambda: np.copyto(pinned, shm)), nbytes * 2),
                ("server h2d", timed(lambda: device.upload(flat, pinned)), nbytes),
                ("server h2d from shm (what runs: driver-staged)", timed(lambda: device.copy_in(flat, shm)),
                 nbytes)]

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

        rows.append((f"server round (sum of {workers} + sgd momentum, {len(chunks)} chunks)", timed(server_round),
                     nbytes * (workers + 4)))
        rows.append((f"server d2h -> shm ({len(chunks)} values packed, one download)",
                     timed(lambda: backend.download([c.value for _, c in chunks])), nbytes))
        rows.append(("worker h2d (pinned)", timed(lambda: device.upload(flat, pinned)), nbytes))
        rows.append(("worker spread", timed(spread), nbytes * 2))
        return {"tensors": len(sizes), "mb": round(nbytes / 1e6, 1), "chunks": len(chunks),
                "chunk_bytes": chunk_bytes, "workers": workers, "device": device.describe(),
                "rows": [{"phase": name, "ms": round(ms, 3), "gb_s": round(moved / ms / 1e6, 1)}
                         for name, ms, moved in rows]}
    finally:
        arena.close()


def report(result: dict) -> list[str]:
    lines = [f"{result['mb']} MB in {result['tensors']} tensors, {result['chunks']} server chunks of at most "
             f"{result['chunk_bytes'] >> 20} MB, W={result['workers']}, on {result['device']}; each step alone, "
             "median ms (GB/s of the bytes it reads and writes).", "",
             "| step | ms | GB/s |", "|---|---:|---:|"]
    lines += [f"| {r['phase']} | {r['ms']} | {r['gb_s']} |" for r in result["rows"]]
    return lines + [""]
