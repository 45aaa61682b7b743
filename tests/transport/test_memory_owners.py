"""Issue 40, finding 8: a memory reference (``shm``, ``dev``) is accepted only for
memory of the worker whose connection sent it (kvstore.transport.endpoints.owners,
composed by the server's data plane).

The rules on their own (pure); the server's data plane decoding real shared-memory
references; and a job of real processes in which worker 1 pushes a reference to
worker 0's memory through its own connection (it used to be summed as worker 1's
gradient)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import zmq

from kvstore.config import Config
from kvstore.errors import ProtocolError
from kvstore.protocol import encode, ops
from kvstore.server.dataplane import DataPlane
from kvstore.transport import shm
from kvstore.transport.endpoints.owners import MemoryOwners

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_memfd = pytest.mark.skipif(not shm.available(), reason="no memfd_create on this platform")
pytestmark = pytest.mark.timeout(180)

HELLO, PUSH = {"op": ops.HELLO, "src": 1}, {"op": ops.PUSH, "src": 1}


def test_a_connection_references_only_the_memory_of_the_worker_of_its_handshake():
    owners = MemoryOwners()
    owners.joined(["h:100", "h:200", ""])                     # workers 0, 1; rank 2 vacant
    with pytest.raises(ProtocolError, match="made no handshake"):
        owners.check(b"c1", PUSH, "shm", [200, 5, 4096], 200)
    with pytest.raises(ProtocolError, match=r"memory of worker 0 \(process 100\), but worker 1 \(process 200\)"):
        owners.check(b"c1", HELLO, "shm", [100, 5, 4096], 100)     # a probe in worker 0's memory
    owners.check(b"c1", HELLO, "shm", [200, 5, 4096], 200)          # c1 is worker 1's now
    owners.check(b"c1", PUSH, "shm", [200, 9, 4096], 200)
    with pytest.raises(ProtocolError, match=r"memory of worker 0 \(process 100\), but worker 1 \(process 200\)"):
        owners.check(b"c1", PUSH, "shm", [100, 5, 4096], 100)
    with pytest.raises(ProtocolError, match="process 7, which is no worker"):
        owners.check(b"c1", PUSH, "shm", [7, 5, 4096], 7)
    with pytest.raises(ProtocolError, match="on the connection of worker 1"):
        owners.check(b"c1", {"op": ops.PUSH, "src": 0}, "shm", [100, 5, 4096], 100)
    with pytest.raises(ProtocolError, match="made its handshake|on the connection of worker 1"):
        owners.check(b"c1", {"op": ops.HELLO, "src": 0}, "shm", [100, 5, 4096], 100)
    for src in (2, 3, "1", None):                                   # vacant, unknown, not an int
        with pytest.raises(ProtocolError, match="has no process registered"):
            owners.check(b"c9", {"op": ops.HELLO, "src": src}, "shm", [200, 5, 4096], 200)


def test_an_opaque_segment_belongs_to_the_first_process_that_references_it():
    """CUDA IPC handles do not name their process: the first worker process whose
    connection references one holds it; another's reference is refused, naming both.
    Workers of one process share their memory anyway."""
    owners = MemoryOwners()
    owners.joined(["h:100", "h:200", "h:200"])
    handle = [11, 22, 33, 44, 55, 66, 77, 88, 4096]
    owners.check(b"w0", {"op": ops.DEVICE_HELLO, "src": 0}, "dev", [1] * 9, None)
    owners.check(b"w1", {"op": ops.DEVICE_HELLO, "src": 1}, "dev", [2] * 9, None)
    owners.check(b"w2", {"op": ops.DEVICE_HELLO, "src": 2}, "dev", [3] * 9, None)
    owners.check(b"w0", {"op": ops.PUSH, "src": 0}, "dev", handle, None)
    owners.check(b"w0", {"op": ops.PUSH, "src": 0}, "dev", handle, None)     # again: still its own
    with pytest.raises(ProtocolError, match=r"referenced first by worker 0 \(process 100\), but worker 1 "
                                            r"\(process 200\)"):
        owners.check(b"w1", {"op": ops.PUSH, "src": 1}, "dev", handle, None)
    owners.check(b"w1", {"op": ops.PUSH, "src": 1}, "dev", [2] * 9, None)
    owners.check(b"w2", {"op": ops.PUSH, "src": 2}, "dev", [2] * 9, None)   # worker 2 shares process 200
    owners.check(b"w1", {"op": ops.PUSH, "src": 1}, "shm", [200, 1, 64], 200)   # kinds are apart
    owners.joined(["h:300", "h:200", "h:200"])               # worker 0 left; a new process took its rank
    owners.check(b"w1", {"op": ops.PUSH, "src": 1}, "dev", handle, None)      # process 100's claim went
    with pytest.raises(ProtocolError, match="made no handshake"):
        owners.check(b"w0", {"op": ops.PUSH, "src": 0}, "dev", [9] * 9, None)   # the old connection too


@pytest.fixture
def data_plane():
    """A server's data plane serving shm, bound on loopback, whose job has worker 0
    in another process (our parent) and worker 1 in this one."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    data = DataPlane(Config(transport="shm", node_host="127.0.0.1", rank=0))
    data.bind(sock)
    data.joined([f"h:{os.getppid()}", f"h:{os.getpid()}"])
    arena = shm.Arena("owners-test", segment_bytes=1 << 16)
    yield data, arena
    arena.close()
    data.close()
    sock.close(linger=0)
    ctx.term()


def _referenced(op, src, arena, values: np.ndarray, segment=None, **fields) -> list:
    a = arena.alloc(values.size, values.dtype)
    a[:] = values
    desc, offset = arena.locate(a)
    return encode({"op": op, "id": 1, "src": src, **fields}, [a], [(segment or desc, offset)])


@needs_memfd
def test_the_server_decodes_references_only_into_the_senders_memory(data_plane):
    data, arena = data_plane
    nonce = np.frombuffer(os.urandom(16), np.uint8)
    with pytest.raises(ProtocolError, match="made no handshake"):
        data.decode(b"c1", _referenced(ops.PUSH, 1, arena, np.ones(4, np.float32), chunks=[[3, 0]]))
    header, arrays = data.decode(b"c1", _referenced(ops.HELLO, 1, arena, nonce, nonce=nonce.tobytes()))
    assert arrays[0].tobytes() == nonce.tobytes()             # our own probe: mapped, read back
    header, arrays = data.decode(b"c1", _referenced(ops.PUSH, 1, arena, np.arange(4, dtype=np.float32),
                                                    chunks=[[3, 0]]))
    np.testing.assert_array_equal(arrays[0], np.arange(4))
    foreign = [os.getppid(), 3, 1 << 16]                      # a segment of worker 0's process
    with pytest.raises(ProtocolError, match=rf"buffer 0: the 'shm' segment .* is memory of worker 0 \(process "
                                            rf"{os.getppid()}\), but worker 1 \(process {os.getpid()}\) sent it"):
        data.decode(b"c1", _referenced(ops.PUSH, 1, arena, np.ones(4, np.float32), foreign, chunks=[[3, 0]]))
    with pytest.raises(ProtocolError, match="the connection of worker 1"):
        data.decode(b"c1", _referenced(ops.PUSH, 0, arena, np.ones(4, np.float32), chunks=[[3, 0]]))
    plain = encode({"op": ops.PUSH, "id": 2, "src": 0, "chunks": [[3, 0]]}, [np.ones(4, np.float32)])
    assert data.decode(b"c2", plain)[0]["src"] == 0           # frames need no handshake


FOREIGN_PUSH = textwrap.dedent("""
    import json, os, sys, numpy as np, kvstore
    from kvstore.errors import KVStoreError
    from kvstore.protocol import ops
    from kvstore.transport import shm
    from kvstore.transport.links import RequestOptions
    kv = kvstore.create("dist_sync")
    n, where = 1024, sys.argv[1]
    kv.init(3, np.zeros(n, np.float32))
    if kv.rank == 0:                      # worker 0's own shared memory, as its staging slots are
        arena = shm.Arena("w0-own")
        mine = arena.alloc(n, np.float32)
        mine[:] = 100
        desc, offset = arena.locate(mine)
        with open(where + ".part", "w") as f:
            json.dump([list(desc), offset], f)
        os.rename(where + ".part", where)
    kv.barrier()
    if kv.rank == 1:                      # through its own connection, naming worker 0's memory
        desc, offset = json.load(open(where))
        client = kv._client
        rid, _ = client.request(0, ops.PUSH, "a push naming worker 0's memory", [np.zeros(n, np.float32)],
                                RequestOptions(shared=[(tuple(desc), offset)]), chunks=[[3, 0]])
        try:
            client.wait([rid], "a push naming worker 0's memory")
            print("RANK 1 FOREIGN accepted", flush=True)
        except KVStoreError as e:
            print("RANK 1 FOREIGN refused", json.dumps(str(e)), flush=True)
    kv.push(3, np.full(n, kv.rank + 1, np.float32))
    out = np.empty(n, np.float32)
    kv.pull(3, out=out)
    print("RANK", kv.rank, "SUM", float(out.min()), float(out.max()), ",".join(kv._client.transports), flush=True)
""")


@needs_memfd
def test_a_worker_pushing_a_reference_to_another_workers_memory_is_refused_naming_both(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(FOREIGN_PUSH)
    env = {**os.environ, "PYTHONPATH": ROOT, "KVSTORE_TIMEOUT": "20", "KVSTORE_TRANSPORT": "shm"}
    p = subprocess.run([sys.executable, "-m", "tracker.local", "-n", "2", "-s", "1", sys.executable, str(script),
                        str(tmp_path / "segment.json")],
                       env=env, capture_output=True, text=True, timeout=150, cwd=ROOT)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    refusal = [line for line in p.stdout.splitlines() if "FOREIGN" in line]
    assert len(refusal) == 1 and "FOREIGN refused" in refusal[0], out
    assert "memory of worker 0 (process" in refusal[0] and "but worker 1 (process" in refusal[0], refusal
    sums = sorted(line.split("RANK", 1)[1].split() for line in p.stdout.splitlines() if " SUM " in line)
    assert sums == [[str(rank), "SUM", "3.0", "3.0", "shm"] for rank in (0, 1)], out   # 1 + 2, not 100 + 1
