"""Bounded soak: a thousand and more mixed push / pull / pushpull rounds on many keys of
many sizes, checking every value exactly and that nothing grows per round.

- dist_sync, no optimizer, 4 workers x 2 servers (in-process cluster): every
  worker pushes integer-valued gradients, so sums are exact; a pull or pushpull
  must return exactly the sum of the last round's pushes.
- dist_async, SGD with learning_rate=1 (w -= g, linear): after a barrier every key
  must equal its initial value minus the sum of every push of every worker.
- the same sync rounds through the real launcher (``python -m tracker.local``),
  2 workers x 1 server as separate processes.

Keys are ints; sizes go from 1 element to 400 KB; ``chunk_bytes`` is small so the
large keys split into several chunks (on both servers), some of them above the
zero-copy threshold. After a warm-up, memory (RSS and the number of objects the
garbage collector tracks), open file descriptors and threads are measured; at the
end they must not have grown beyond a small bound.
"""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import threading

import numpy as np
import pytest

from kvstore import optimizer

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))

CHUNK_BYTES = 96 << 10          # 24,576 float32: keys of 24,577+ elements split
SIZES = [1, 2, 3, 17, 100, 1000, 4096, 24576, 24577, 30000, 100000]
NUM_KEYS = 24
SEED = 20240607
RSS_SLACK = 16 << 20            # bytes RSS may grow between warm-up and the end (seen: < 4 MiB)
BLOCK_SLACK = 1000              # sys.getallocatedblocks(), every small object (seen: +150..+300)
OBJECT_SLACK = 1000             # gc-tracked objects likewise (seen: +-10; a per-round leak: thousands)
FRESH_KEY = 10_000              # keys initialised at the marks (above every key of the rounds)


def shape_of(k: int) -> tuple:
    size = SIZES[k % len(SIZES)]
    return {1000: (10, 100), 30000: (150, 200), 100000: (250, 400)}.get(size, (size,))


def dtype_of(k: int, floats_only: bool = False):
    if floats_only:
        return np.float64 if k % 6 == 2 else np.float32
    return {2: np.float64, 5: np.int32}.get(k % 6, np.float32)


def initial(k: int, floats_only: bool = False) -> np.ndarray:
    shape = shape_of(k)
    return ((np.arange(int(np.prod(shape))) % 13) + k).astype(dtype_of(k, floats_only)).reshape(shape)


def ramp(k: int, floats_only: bool = False) -> np.ndarray:
    shape = shape_of(k)
    return (np.arange(int(np.prod(shape))) % 7).astype(dtype_of(k, floats_only)).reshape(shape)


def grad(ramps: dict, k: int, rank: int, r: int) -> np.ndarray:
    """Worker ``rank``'s integer-valued gradient for key ``k`` in round ``r``."""
    return ramps[k] + ((3 * rank + r + k) % 5)


def plan(r: int, ops=("push", "pull", "pushpull"), p=(0.35, 0.25, 0.4), num_keys=NUM_KEYS):
    """Round ``r``'s op and keys: the same on every worker (sync rounds need that)."""
    rng = np.random.default_rng([SEED, r])
    op = ops[rng.choice(len(ops), p=p)]
    keys = sorted(rng.choice(num_keys, size=int(rng.integers(1, 6)), replace=False).tolist())
    return op, keys


def snapshot() -> dict:
    """This process's memory, descriptors and threads."""
    gc.collect()
    with open("/proc/self/status") as f:
        status = f.read()
    return {"rss": int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024,
            "os_threads": int(re.search(r"Threads:\s+(\d+)", status).group(1)),
            "threads": threading.active_count(),
            "fds": len(os.listdir("/proc/self/fd")),
            "objects": len(gc.get_objects()),
            "blocks": sys.getallocatedblocks()}


def mark(kv, pause, marks: list) -> None:
    """Append ``pause(kv)``'s measure, taken with the store's call plans forgotten.

    A store keeps up to ``PLAN_LIMIT`` call plans (kvstore/worker/plans.py; their bound
    is tested in tests/worker/test_plans.py), and the rounds here name new keys nearly
    every time, so a full set of plans holds a varying number of objects (+-200 per
    store between two moments); so do the layouts the links and the servers keep of
    repeated messages (kvstore/protocol/layouts.py, at most 256 per connection).
    Initialising a fresh key forgets them (as any init does: the store its plans and
    its links' layouts, each server that receives an init every connection's layouts;
    the key is cut into chunks on every server), so both measures see none and only
    growth per round remains."""
    kv.init(FRESH_KEY + len(marks), np.zeros(4 * CHUNK_BYTES // 4, np.float32))
    marks.append(pause(kv))


def check_no_growth(warm: dict, end: dict, what: str) -> None:
    assert end["fds"] == warm["fds"], f"{what}: open fds {warm['fds']} -> {end['fds']}"
    assert end["threads"] == warm["threads"], f"{what}: threads {warm['threads']} -> {end['threads']}"
    assert end["os_threads"] == warm["os_threads"], \
        f"{what}: OS threads {warm['os_threads']} -> {end['os_threads']}"
    assert end["rss"] - warm["rss"] <= RSS_SLACK, \
        f"{what}: RSS grew by {(end['rss'] - warm['rss']) / 2 ** 20:.1f} MiB after warm-up"
    assert end["objects"] - warm["objects"] <= OBJECT_SLACK, \
        f"{what}: gc-tracked objects {warm['objects']} -> {end['objects']}"
    assert end["blocks"] - warm["blocks"] <= BLOCK_SLACK, \
        f"{what}: Python memory blocks {warm['blocks']} -> {end['blocks']}"


# -- worker bodies (also run by the launcher variant's processes) ----------------------------
def sync_rounds(kv, rounds: int, warmup: int, pause) -> list:
    """Mixed sync rounds on every key, each pull/pushpull checked exactly. ``pause(kv)``
    is called after the warm-up and at the end; returns what it returned."""
    keys = list(range(NUM_KEYS))
    kv.init(keys, [initial(k) for k in keys])
    ramps = {k: ramp(k) for k in keys}
    expected = {k: initial(k) for k in keys}
    outs = {k: np.empty(shape_of(k), dtype_of(k)) for k in keys}
    marks = []
    for r in range(rounds):
        if r == warmup:
            mark(kv, pause, marks)
        op, ks = plan(r)
        if op in ("push", "pushpull"):
            grads = [grad(ramps, k, kv.rank, r) for k in ks]
            for k in ks:  # the round's value: the sum of every worker's push
                expected[k] = sum(grad(ramps, k, w, r) for w in range(kv.num_workers))
        if op == "push":
            kv.push(ks, grads)
            continue
        if op == "pull":
            kv.pull(ks, out=[outs[k] for k in ks])
        else:
            kv.pushpull(ks, grads, out=[outs[k] for k in ks])
        for k in ks:
            if not np.array_equal(outs[k], expected[k]):
                bad = np.flatnonzero(outs[k].reshape(-1) != expected[k].reshape(-1))
                raise AssertionError(f"worker {kv.rank} round {r} ({op}): key {k} differs at "
                                     f"{bad.size} of {outs[k].size} elements, e.g. [{bad[0]}] "
                                     f"{outs[k].reshape(-1)[bad[0]]} != {expected[k].reshape(-1)[bad[0]]}")
    kv.pull(keys, out=[outs[k] for k in keys])
    for k in keys:
        assert np.array_equal(outs[k], expected[k]), f"worker {kv.rank}: final value of key {k}"
    mark(kv, pause, marks)
    return marks


def async_rounds(kv, rounds: int, warmup: int, pause, totals: dict) -> list:
    """Async pushes with SGD(learning_rate=1); ``totals[rank]`` collects this
    worker's pushed sums; after a barrier every key is checked exactly."""
    keys = list(range(NUM_KEYS))
    kv.init(keys, [initial(k, True) for k in keys])
    kv.set_optimizer(optimizer.create("sgd", learning_rate=1.0))
    ramps = {k: ramp(k, True) for k in keys}
    mine = totals[kv.rank] = {k: np.zeros(shape_of(k), dtype_of(k, True)) for k in keys}
    outs = {k: np.empty(shape_of(k), dtype_of(k, True)) for k in keys}
    marks = []
    for r in range(rounds):
        if r == warmup:
            mark(kv, pause, marks)
        # workers run different plans: nothing lines them up in async mode
        op, ks = plan(r * 7 + kv.rank, p=(0.55, 0.15, 0.3))
        grads = [grad(ramps, k, kv.rank, r) for k in ks]
        if op == "pull":
            kv.pull(ks, out=[outs[k] for k in ks])
        elif op == "push":
            kv.push(ks, grads)
        else:
            kv.pushpull(ks, grads, out=[outs[k] for k in ks])
        if op != "push":   # values seen mid-run are others' progress: integral, at least
            for k in ks:
                assert np.array_equal(outs[k], np.round(outs[k])), f"round {r}: key {k} not integral"
        if op != "pull":
            for k, g in zip(ks, grads):
                mine[k] += g
    kv.barrier()    # every push of every worker has been applied
    kv.pull(keys, out=[outs[k] for k in keys])
    for k in keys:
        want = initial(k, True) - sum(totals[w][k] for w in range(kv.num_workers))
        assert np.array_equal(outs[k], want), f"worker {kv.rank}: key {k} after the barrier"
    mark(kv, pause, marks)
    return marks


def thread_pause(num_workers: int):
    """A pause for worker threads of one process: rank 0 measures while all wait."""
    gate = threading.Barrier(num_workers, timeout=60)

    def pause(kv):
        kv.barrier()
        gate.wait()
        mark = snapshot() if kv.rank == 0 else None
        gate.wait()
        return mark
    return pause


# -- in-process cluster -----------------------------------------------------------------------
SETTINGS = dict(chunk_bytes=CHUNK_BYTES, timeout=60.0)


def test_soak_dist_sync(make_cluster):
    cluster = make_cluster(4, 2, **SETTINGS)
    pause = thread_pause(4)
    marks = cluster.run(lambda kv: sync_rounds(kv, rounds=1200, warmup=200, pause=pause),
                        timeout=120)[0]
    check_no_growth(*marks, "dist_sync")


def test_soak_dist_async(make_cluster):
    cluster = make_cluster(4, 2, **SETTINGS)
    pause, totals = thread_pause(4), {}
    marks = cluster.run(lambda kv: async_rounds(kv, rounds=1000, warmup=200, pause=pause,
                                                totals=totals),
                        store_type="dist_async", timeout=120)[0]
    check_no_growth(*marks, "dist_async")


# -- through the real launcher -------------------------------------------------------------------
WORKER = """
import sys
sys.path.insert(0, {here!r})
import kvstore, test_soak
kv = kvstore.create("dist_sync")
def pause(kv):
    kv.barrier()
    return test_soak.snapshot()
warm, end = test_soak.sync_rounds(kv, rounds={rounds}, warmup={warmup}, pause=pause)
test_soak.check_no_growth(warm, end, "worker %d" % kv.rank)
print("SOAK-OK rank=%d rss=%d->%d fds=%d->%d" % (kv.rank, warm["rss"], end["rss"], warm["fds"],
                                                 end["fds"]), flush=True)
kv.close()
"""


def test_soak_through_launcher(tmp_path):
    code = WORKER.format(here=HERE, rounds=800, warmup=150)
    env = dict(os.environ, KVSTORE_CHUNK_BYTES=str(CHUNK_BYTES), KVSTORE_TIMEOUT="60",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "tracker.local", "-n", "2", "-s", "1",
                           sys.executable, "-c", code],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert sorted(re.findall(r"SOAK-OK rank=(\d)", out)) == ["0", "1"], out[-5000:]
