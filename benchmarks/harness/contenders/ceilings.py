"""The ceilings: what this machine allows for the same bytes.

- ZeroMQ one-way throughput: one process streams the parameter set's bytes
  (102.2 MB for ResNet-50) as pipelined frames of ``frame_bytes`` over a PUSH
  socket to a PULL socket in another process, which acknowledges the last frame;
  over tcp and ipc. Time from the first send to the acknowledgement.
- numpy memory bandwidth on the same number of fp32 values: copy (``np.copyto``)
  and add (``np.add(a, b, out=a)``), preallocated buffers.
- our server's own sum and update, in process: ``kvstore.server.state.ServerState``
  fed W pushes of the whole parameter set (chunked as the store chunks it), timed
  per round without an optimizer (sum, assign) and with SGD (sum, update);
  compared with numpy doing the same passes (1 copy + (W-1) adds [+ 1 update]).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import numpy as np  # noqa: E402
import zmq  # noqa: E402

from benchmarks.harness import common  # noqa: E402


def zmq_receiver(url: str, ack_url: str, frames: int, rounds: int) -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(url)
    ack = ctx.socket(zmq.PUSH)
    ack.connect(ack_url)
    ack.send(b"ready")
    check = 0
    for r in range(rounds):
        for _ in range(frames):
            f = pull.recv(copy=False)
            check += len(f.buffer)
        ack.send(str(check).encode())
    ack.close(linger=1000)
    pull.close(linger=0)
    ctx.term()


def zmq_one_way(transport: str, nbytes: int, frame_bytes: int, iters: int, warmup: int) -> dict:
    """Seconds per one-way transfer of ``nbytes`` as frames of ``frame_bytes``."""
    ctx = zmq.Context()
    tmp = tempfile.mkdtemp(prefix="kvbench-")
    ack = ctx.socket(zmq.PULL)
    ack_port = ack.bind_to_random_port("tcp://127.0.0.1")
    if transport == "tcp":
        from benchmarks.harness.procs import free_port
        url = f"tcp://127.0.0.1:{free_port()}"
    else:
        url = f"ipc://{tmp}/data"
    sizes = [frame_bytes] * (nbytes // frame_bytes) + ([nbytes % frame_bytes] if nbytes % frame_bytes else [])
    rounds = warmup + iters
    recv = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--zmq-receiver", url,
                             f"tcp://127.0.0.1:{ack_port}", str(len(sizes)), str(rounds)])
    try:
        if not ack.poll(30000):
            raise RuntimeError("zmq receiver did not start")
        ack.recv()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(url)
        buf = np.ones(nbytes, np.uint8)
        views, pos = [], 0
        for s in sizes:
            views.append(buf[pos:pos + s].data)   # a memoryview of the slice
            pos += s
        times, sent = [], 0
        for r in range(rounds):
            t0 = time.perf_counter()
            for v in views:
                push.send(v, copy=False)
            if not ack.poll(60000):
                raise RuntimeError("zmq receiver did not acknowledge")
            got = int(ack.recv())
            t1 = time.perf_counter()
            sent += nbytes
            if got != sent:
                raise common.WrongResult(f"zmq {transport}: receiver got {got} bytes, sent {sent}")
            if r >= warmup:
                times.append(t1 - t0)
        push.close()
        if recv.wait(30) != 0:
            raise RuntimeError(f"zmq receiver exited with {recv.returncode}")
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
        ack.close(linger=0)
        ctx.term()
    return {"times": times, "frame_bytes": frame_bytes, "frames": len(sizes)}


def numpy_bandwidth(values: int, iters: int, warmup: int) -> dict:
    a = np.ones(values, np.float32)
    b = np.ones(values, np.float32)
    c = np.empty(values, np.float32)
    out = {}
    d = np.empty(values, np.float32)
    for name, fn in (("copy", lambda: np.copyto(c, a)), ("add", lambda: np.add(a, b, out=a)),
                     ("add3", lambda: np.add(b, c, out=d))):
        times = []
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            if i >= warmup:
                times.append(t1 - t0)
        out[name] = times
    if not (c[0] == 1.0 and a[-1] == 1.0 + warmup + iters):
        raise common.WrongResult("numpy bandwidth: wrong result")
    return out


def server_sum(shapes, num_workers: int, iters: int, warmup: int, chunk_bytes: int) -> dict:
    """Time ServerState.handle for W pushes of the whole set (one round), as one
    push message per worker, without and with an SGD optimizer."""
    from kvstore.server.state import ServerState
    from kvstore.sharding import Placement
    from kvstore.optimizer import SGD

    placement = Placement(1, chunk_bytes)
    ids, sizes = [], []
    for k, s in enumerate(shapes):
        n = int(np.prod(s))
        for c in placement.place(k, n, 4):
            ids.append([k, c.index])
            sizes.append(c.size)
    out = {}
    for variant in ("sum_assign", "sum_sgd"):
        st = ServerState("bench")
        st.handle("p0", {"op": "configure", "id": 1, "src": 0, "mode": "sync",
                         "num_workers": num_workers}, [])
        r = st.handle("p0", {"op": "init", "id": 2, "src": 0, "chunks": ids},
                      [np.zeros(n, np.float32) for n in sizes])
        assert r[0].header["op"] == "ok", r
        if variant == "sum_sgd":
            cfg = SGD(learning_rate=1.0).to_config()
            r = st.handle("p0", {"op": "set_optimizer", "id": 3, "src": 0, "optimizer": cfg}, [])
            assert r[0].header["op"] == "ok", r
        grads = [[np.full(n, float(w + 1), np.float32) for n in sizes] for w in range(num_workers)]
        times, rid = [], 10
        weight = 0.0
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            replies = []
            for w in range(num_workers):
                rid += 1
                replies += st.handle(f"p{w}", {"op": "push", "id": rid, "src": w, "chunks": ids},
                                     grads[w])
            t1 = time.perf_counter()
            if len(replies) != num_workers or any(x.header["op"] != "ok" for x in replies):
                raise common.WrongResult(f"server {variant}: replies {replies[:1]}")
            total = num_workers * (num_workers + 1) / 2
            weight = total if variant == "sum_assign" else weight - total
            for cid in (tuple(ids[0]), tuple(ids[-1])):
                v = st.chunks[cid].value
                if v[0] != weight or v[-1] != weight:
                    raise common.WrongResult(f"server {variant}: {v[0]} != {weight}")
            if i >= warmup:
                times.append(t1 - t0)
        out[variant] = times
    return out


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--zmq-receiver":
    zmq_receiver(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))


ZMQ_FRAME_BYTES = 2 << 20   # the store's default chunk size; 1-4 MB frames measure alike here


def version() -> str:
    return f"pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()}), numpy {np.__version__}"


def run(cfg, launch_no: int) -> list[dict]:
    from math import prod
    from ..resnet50_shapes import model_shapes
    shapes = model_shapes(cfg.model)
    values = sum(prod(s) for s in shapes)
    nbytes = 4 * values
    iters = max(cfg.iters, 10)
    rows = []

    def row(variant, samples, **extra):
        rows.append({"kind": "ceiling", "contender": "ceiling", "variant": variant,
                     "launch": launch_no, "samples": samples, "unit": "s", "bytes": nbytes, **extra})
    for transport in ("tcp", "ipc"):
        r = zmq_one_way(transport, nbytes, ZMQ_FRAME_BYTES, iters, cfg.warmup)
        row(f"ZeroMQ one-way {transport} ({r['frames']} x {ZMQ_FRAME_BYTES >> 20} MB frames)",
            r["times"])
    bw = numpy_bandwidth(values, iters, cfg.warmup)
    row("numpy copy (np.copyto)", bw["copy"])
    row("numpy add (np.add out=)", bw["add"])
    row("numpy add into a third array (np.add(a, b, out=c))", bw["add3"])
    srv = server_sum(shapes, cfg.workers, iters, cfg.warmup, chunk_bytes=2 << 20)
    # numpy's minimum for the same result: one add of two arrays into a third, then
    # W-2 in-place adds (one copy when W=1), plus one in-place pass for the SGD update
    passes = {"copy": 1 if cfg.workers == 1 else 0, "add3": 1 if cfg.workers > 1 else 0,
              "add": max(cfg.workers - 2, 0)}
    row(f"our server: sum of {cfg.workers} pushes + assign (ServerState, in process)",
        srv["sum_assign"], passes=passes)
    row(f"our server: sum of {cfg.workers} pushes + SGD update (ServerState, in process)",
        srv["sum_sgd"], passes={**passes, "add": passes["add"] + 1})
    return rows
