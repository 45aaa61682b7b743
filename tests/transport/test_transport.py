"""Transports: the advert and the automatic choice, shared-memory references in the
codec, the shared-memory pieces (arena, mapper, slots), whole jobs over every
transport against the local oracle, fall-backs, and that shared memory leaves
nothing behind after a normal exit or a killed process."""

import os
import subprocess
import sys
import textwrap
import threading

import msgpack
import numpy as np
import pytest

import kvstore
from kvstore.config import Config
from kvstore.errors import ProtocolError
from kvstore.protocol import decode, encode
from kvstore.transport import Advert, endpoints, shm
from kvstore.transport.links import opening

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOST = endpoints.host_identity()
needs_memfd = pytest.mark.skipif(not shm.available(), reason="no memfd_create on this platform")


# -- adverts and the choice of endpoint -------------------------------------------------------
def test_advert_round_trip_and_bare_urls():
    a = Advert({"tcp": {"url": "tcp://127.0.0.1:5000"}, "ipc": {"url": "ipc://@kvstore-ab"}, "shm": {}},
               "h1", 42)
    assert a.format() == "tcp://127.0.0.1:5000 ipc://@kvstore-ab shm host=h1 pid=42"
    assert Advert.parse(a.format()) == a
    assert Advert.parse("tcp://10.0.0.1:7") == Advert({"tcp": {"url": "tcp://10.0.0.1:7"}})
    assert Advert.parse("tcp://h:1 future=word pid=x host=h2").host == "h2"   # unknown words ignored


def choose(advert, mode, local):
    """(URL, transport) of the first link a worker on host ``local`` tries (the registry
    in kvstore.transport.links decides; it falls back after a failed handshake)."""
    cls, url = opening.candidates(advert, Config(transport=mode), advert.host is not None and advert.host == local)[0]
    return url, cls.kind


@pytest.mark.parametrize("mode, local, expected", [
    ("auto", "h1", ("tcp://a:1", "shm")), ("shm", "h1", ("tcp://a:1", "shm")),
    ("ipc", "h1", ("ipc://@x", "ipc")), ("tcp", "h1", ("tcp://a:1", "tcp")),
    ("auto", "h2", ("tcp://a:1", "tcp")), ("ipc", "h2", ("tcp://a:1", "tcp")),
])
def test_choice_follows_mode_and_host(mode, local, expected):
    assert choose(Advert.parse("tcp://a:1 ipc://@x shm host=h1 pid=1"), mode, local) == expected


def test_a_server_without_ipc_or_host_is_reached_over_tcp():
    assert choose(Advert.parse("tcp://a:1 shm host=h1"), "ipc", "h1") == ("tcp://a:1", "tcp")
    assert choose(Advert.parse("tcp://a:1"), "auto", HOST) == ("tcp://a:1", "tcp")
    with pytest.raises(ValueError):      # ConfigError, a ValueError
        choose(Advert.parse("tcp://a:1"), "udp", HOST)


# -- codec: buffers by reference ------------------------------------------------------------
def test_shared_buffers_travel_as_references():
    store = {(7, 3, 4096): np.arange(1024, dtype=np.uint8)}
    inline = np.ones(3, np.float32)
    frames = encode({"op": "push", "id": 1}, [np.zeros(4, np.float32), inline],
                    [((7, 3, 4096), 16), None])
    assert len(frames) == 2        # the header and the one inline buffer

    def resolve(seg, offset, dtype, shape):
        return np.frombuffer(store[tuple(seg)], dtype, int(np.prod(shape)), offset).reshape(shape)
    header, arrays = decode(frames, resolve={"shm": resolve})
    assert header["shm"] == {"segs": [[7, 3, 4096]], "refs": [[0, 16], None]}
    np.testing.assert_array_equal(arrays[0], np.frombuffer(store[(7, 3, 4096)], np.float32, 4, 16))
    np.testing.assert_array_equal(arrays[1], inline)
    with pytest.raises(ProtocolError, match="not accepted"):
        decode(frames)             # a connection that takes no shared memory


@pytest.mark.parametrize("shm_field", [
    "junk", {"segs": [[1, 2, 3]], "refs": []}, {"segs": [[1, 2, 3]], "refs": [[1, 0]]},
    {"segs": [["a", 2, 3]], "refs": [[0, 0]]}, {"segs": [[1, 2, 3]], "refs": [[0, -1]]},
    {"segs": [[1, 2, 3]], "refs": [[0, 0, 0]]},
])
def test_malformed_shared_references_are_protocol_errors(shm_field):
    import msgpack
    head = msgpack.packb({"v": 1, "op": "push", "id": 5, "bufs": [["<f4", [2]]], "shm": shm_field})
    with pytest.raises(ProtocolError) as e:
        decode([head], resolve={"shm": lambda *a: np.zeros(2, np.float32)})
    assert e.value.request_id == 5


def test_device_references_are_resolved_by_their_own_resolver():
    host = np.arange(8, dtype=np.float32)
    device = np.arange(8, 16, dtype=np.float32)
    handle = tuple(range(100, 108))            # e.g. a CUDA IPC handle's 8 words
    frames = encode({"op": "push", "id": 1}, [np.zeros(2, np.float32), np.zeros(2, np.float32), host[:1]],
                    [((7, 3, 4096), 0), (handle, 8, "dev"), None])
    seen = []

    def resolver(kind, memory):
        def resolve(seg, offset, dtype, shape):
            seen.append((kind, tuple(seg), offset))
            return memory[offset // 4:offset // 4 + 2]
        return resolve
    header, arrays = decode(frames, resolve={"shm": resolver("shm", host), "dev": resolver("dev", device)})
    assert header["shm"]["refs"] == [[0, 0], None, None] and header["dev"]["refs"] == [None, [0, 8], None]
    assert seen == [("shm", (7, 3, 4096), 0), ("dev", handle, 8)]
    np.testing.assert_array_equal(arrays[1], [10, 11])
    with pytest.raises(ProtocolError, match="device-memory buffers .* not accepted"):
        decode(frames, resolve={"shm": resolver("shm", host)})      # a peer that takes no device memory
    with pytest.raises(ValueError, match="unknown kind"):
        encode({"op": "push", "id": 1}, [host], [((1,), 0, "gpu")])


def test_a_buffer_referenced_by_two_kinds_is_a_protocol_error():
    import msgpack
    ref = {"segs": [[1, 2, 3]], "refs": [[0, 0]]}
    head = msgpack.packb({"v": 1, "op": "push", "id": 5, "bufs": [["<f4", [2]]], "shm": ref, "dev": ref})
    with pytest.raises(ProtocolError, match="more than one kind"):
        decode([head], resolve={kind: (lambda *a: np.zeros(2, np.float32)) for kind in ("shm", "dev")})


def test_a_reference_plus_a_frame_for_it_is_a_truncation_error():
    frames = encode({"op": "push", "id": 1}, [np.zeros(2, np.float32)], [((1, 2, 64), 0)])
    with pytest.raises(ProtocolError, match="followed"):
        decode(frames + [np.zeros(2, np.float32)], resolve={"shm": lambda *a: np.zeros(2, np.float32)})


# -- shared-memory pieces ---------------------------------------------------------------------
@needs_memfd
def test_arena_places_arrays_in_shared_memory_and_reuses_dropped_regions():
    arena = shm.Arena("t", segment_bytes=1 << 20)
    a = arena.alloc(1000, np.float32)
    desc, offset = arena.locate(a)
    assert desc[0] == os.getpid() and os.readlink(f"/proc/self/fd/{desc[1]}").startswith("/memfd:kvstore-")
    assert arena.locate(np.empty(10)) is None and arena.locate(a[::2]) is None
    assert arena.locate(a[10:20])[1] == offset + 40            # views are found too
    del a
    b = arena.alloc(1000, np.float32)                           # the same size: the same region
    assert arena.locate(b)[1] == offset
    big = arena.alloc(1 << 19, np.float32)                      # larger than a segment: its own
    assert arena.locate(big)[0] != desc
    assert arena.alloc(0, np.float32).size == 0
    arena.close()
    assert arena.locate(b) is None                              # no longer shareable


@needs_memfd
def test_mapper_reads_a_peers_memory_and_refuses_strangers(tmp_path):
    arena = shm.Arena("t", segment_bytes=1 << 16)
    a = arena.alloc(16, np.float64)
    a[:] = np.arange(16)
    desc, offset = arena.locate(a)
    mapper = shm.Mapper()
    with pytest.raises(ProtocolError, match="not a peer"):
        mapper.view(list(desc), offset, np.dtype(np.float64), [16])
    mapper.allow([os.getpid()])
    got = mapper.view(list(desc), offset, np.dtype(np.float64), [4, 4])
    np.testing.assert_array_equal(got.reshape(-1), np.arange(16))
    assert not got.flags.writeable                              # peers map read-only
    a[0] = 99
    assert got[0, 0] == 99                                      # the same memory
    for bad_offset in (offset + 4, -8, desc[2] - 8):
        with pytest.raises(ProtocolError):
            mapper.view(list(desc), bad_offset, np.dtype(np.float64), [16])
    with open(tmp_path / "f", "wb+") as f:                      # an fd that is not a kvstore segment
        f.write(b"x" * 4096)
        f.flush()
        with pytest.raises(ProtocolError, match="not a kvstore segment"):
            mapper.view([os.getpid(), f.fileno(), 4096], 0, np.dtype(np.uint8), [8])
    with pytest.raises(ProtocolError):
        mapper.view([os.getpid(), 10 ** 6, 4096], 0, np.dtype(np.uint8), [8])
    with pytest.raises(ProtocolError, match="pid, fd, size"):
        mapper.view(["x", 1, 2], 0, np.dtype(np.uint8), [1])
    mapper.close()
    arena.close()


@needs_memfd
def test_slots_stay_busy_until_their_request_is_answered():
    slots = shm.Slots(shm.Arena("t"))
    staged = slots.fill(["a", "b"], [np.ones(4, np.float32), np.arange(3)])
    np.testing.assert_array_equal(staged[1], np.arange(3))
    slots.hold(["a", "b"], 1)
    assert slots.fill(["b"], [np.zeros(3, np.int64)]) is None   # still read by the server
    assert slots.fill(["c"], [np.zeros(3, np.int64)]) is not None
    slots.release(1)
    again = slots.fill(["b"], [np.zeros(3, np.int64)])
    assert again[0] is staged[1] and again[0].sum() == 0        # the same slot, refilled


# -- whole jobs -------------------------------------------------------------------------------
KEYS = ["big", "small", "ints"]


def values(rank, step):
    return [np.full((300, 70), rank + step, np.float32) + np.arange(70, dtype=np.float32),
            np.full(5, (rank + 1) * (step + 2), np.float32),
            np.full(40, rank * 3 + step, np.int64)]


def oracle(num_workers, step):
    return [sum(values(r, step)[i] for r in range(num_workers)) for i in range(len(KEYS))]


def exchange(kv):
    kv.init(KEYS, [np.zeros((300, 70), np.float32), np.zeros(5, np.float32), np.zeros(40, np.int64)])
    seen = []
    for step in range(4):
        outs = [np.empty_like(v) for v in values(0, 0)]
        if step % 2:
            kv.pushpull(KEYS, values(kv.rank, step), out=outs)
        else:
            kv.push(KEYS, values(kv.rank, step))
            kv.pull(KEYS, out=outs)
        seen.append(outs)
    return seen, list(kv._client.transports), list(kv._client.servers), slots_filled(kv), \
        [c is not None and c.bytes_received > 0 for c in channels(kv)]


def slots_filled(kv) -> int:
    """Staging slots filled (by the shm links)."""
    return sum(len(link._slots._slots) for link in kv._client.links if link.kind == "shm")


def channels(kv) -> list:
    """Each server's data channel (None: none)."""
    return [getattr(link, "receiver", None) for link in kv._client.links]


@pytest.mark.parametrize("transport, kind, scheme", [
    ("auto", "shm", "tcp://"), ("shm", "shm", "tcp://"), ("ipc", "ipc", "ipc://"), ("tcp", "tcp", "tcp://")])
def test_every_transport_gives_the_oracles_sums(make_cluster, transport, kind, scheme):
    # chunks of 8 KiB go by reference over shm, the two small keys (under
    # zero_copy_bytes) inline: messages mix both
    # large replies over tcp come through the data channels (channel_bytes=16 KiB)
    cluster = make_cluster(3, 2, chunk_bytes=8192, transport=transport, zero_copy_bytes=4096,
                           write_in_bytes=8192, channel_bytes=16384)
    for seen, kinds, urls, slots, channelled in cluster.run(exchange):
        assert kinds == [kind, kind] and all(u.startswith(scheme) for u in urls)
        assert (slots > 0) == (kind == "shm")
        assert channelled == [kind == "tcp"] * 2
        for step, outs in enumerate(seen):
            for got, want in zip(outs, oracle(3, step)):
                np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("write_in", [True, False])
def test_pushpull_writes_large_gradients_into_the_servers_sums(make_cluster, write_in):
    """Over shared memory a sync pushpull's large chunks are written into the servers'
    sums (write/written), small ones and kv.empty() gradients go as before; the sums
    and an optimizer's updates are the same either way."""
    cluster = make_cluster(3, 2, chunk_bytes=8192, zero_copy_bytes=4096, write_in=write_in,
                           write_in_bytes=8192)

    def job(kv):
        ops_sent = []
        request = kv._client.request
        kv._client.request = lambda server, op, *a, **kw: (ops_sent.append(op),
                                                           request(server, op, *a, **kw))[1]
        kv.init(KEYS, [np.zeros((300, 70), np.float32), np.zeros(5, np.float32), np.zeros(40, np.int64)])
        seen = []
        for step in range(3):
            outs = [np.empty_like(v) for v in values(0, 0)]
            kv.pushpull(KEYS, values(kv.rank, step), out=outs)
            seen.append(outs)
        kv.init("w", np.ones(30_000, np.float32))
        kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.5))
        grad, w = kv.empty(30_000, np.float32), np.empty(30_000, np.float32)
        for step in range(2):
            grad[:] = kv.rank + 1
            kv.pushpull("w", grad, out=w)                          # read in place
            kv.pushpull("w", np.full(30_000, kv.rank + 1, np.float32), out=w)   # written in
        return seen, w, ops_sent.count("write"), ops_sent.count("written")
    for seen, w, writes, written in cluster.run(job):
        for step, outs in enumerate(seen):
            for got, want in zip(outs, oracle(3, step)):
                np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(w, 1 - 4 * 0.5 * 6)
        assert writes == written and (writes > 0) == write_in


def test_optimizer_and_async_over_shared_memory(make_cluster):
    cluster = make_cluster(2, 2, chunk_bytes=4096, zero_copy_bytes=4096)

    def job(kv):
        kv.init("w", np.ones(3000, np.float32))
        kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.5))
        out = np.empty(3000, np.float32)
        for _ in range(3):
            kv.pushpull("w", np.full(3000, kv.rank + 1, np.float32), out=out)
        return out, kv._client.transports
    for out, kinds in cluster.run(job):
        assert kinds == ["shm", "shm"]
        np.testing.assert_allclose(out, 1 - 3 * 0.5 * 3)
    cluster = make_cluster(2, 1, chunk_bytes=4096, zero_copy_bytes=4096)

    def async_job(kv):
        kv.init("w", np.zeros(5000, np.float32))
        kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=1.0))
        for _ in range(5):
            kv.push("w", np.ones(5000, np.float32))
        kv.barrier()
        out = np.empty(5000, np.float32)
        kv.pull("w", out=out)
        return out
    for out in cluster.run(async_job, "dist_async"):
        np.testing.assert_array_equal(out, -10)


def test_pushing_ahead_of_the_others_falls_back_to_inline_data(make_cluster):
    """A second push while the first one's round is still open finds its slot
    busy: it travels in the message instead, and both rounds come out right."""
    cluster = make_cluster(2, 1, chunk_bytes=1 << 20)
    pushed = threading.Event()

    def job(kv):
        kv.init("k", np.zeros(50_000, np.float32))
        if kv.rank == 1:
            assert pushed.wait(20)        # rank 0 pushed twice before rank 1 pushed at all
        kv.push("k", np.full(50_000, 1 + kv.rank, np.float32))
        kv.push("k", np.full(50_000, 10 * (1 + kv.rank), np.float32))
        if kv.rank == 0:
            busy = dict(kv._client.links[0]._slots._busy)
            pushed.set()
        out = np.empty(50_000, np.float32)
        kv.pull("k", out=out)
        return out, (busy if kv.rank == 0 else None)
    (out0, busy), (out1, _) = cluster.run(job)
    assert len(busy) == 1                  # only the first push used the slot
    np.testing.assert_array_equal(out0, 30)
    np.testing.assert_array_equal(out1, 30)


def test_compressed_pushes_travel_inline_over_shm(make_cluster):
    cluster = make_cluster(2, 1, chunk_bytes=4096)

    def job(kv):
        kv.set_gradient_compression({"type": "fp16"})
        kv.init("w", np.zeros(3000, np.float32))
        out = np.empty(3000, np.float32)
        kv.pushpull("w", np.full(3000, 0.5, np.float32), out=out)
        return out, kv._client.transports
    for out, kinds in cluster.run(job):
        assert kinds == ["shm"]
        np.testing.assert_array_equal(out, 1.0)


def test_workers_fall_back_to_ipc_when_shared_memory_fails(make_cluster, monkeypatch):
    from kvstore.server import dataplane
    # the servers accept no worker's memory: the handshake fails, the data still flows
    monkeypatch.setattr(dataplane.DataPlane, "joined", lambda self, registration: None)
    cluster = make_cluster(2, 2, chunk_bytes=8192)
    for seen, kinds, urls, _, _ in cluster.run(exchange):
        assert kinds == ["ipc", "ipc"] and all(u.startswith("ipc://@kvstore-") for u in urls)
        for step, outs in enumerate(seen):
            for got, want in zip(outs, oracle(2, step)):
                np.testing.assert_array_equal(got, want)


def test_a_tcp_only_server_and_an_auto_worker_agree_on_tcp(make_cluster):
    cluster = make_cluster(1, 1, transport="tcp")
    config = cluster.config("worker", 0).replace(transport="auto")
    with kvstore.create("dist_sync", config=config) as kv:
        kv.init(1, np.zeros(10_000, np.float32))
        out = np.empty(10_000, np.float32)
        kv.pushpull(1, np.ones(10_000, np.float32), out=out)
        assert kv._client.transports == ["tcp"] and out[0] == 1


# -- emulated hosts ---------------------------------------------------------------------------
def test_host_labels_split_one_machine_into_hosts():
    ids = {endpoints.host_identity(label) for label in ("", "host0", "host1")}
    assert len(ids) == 3 and endpoints.host_identity("host0") == endpoints.host_identity("host0")
    advert = Advert.parse(f"tcp://a:1 ipc://@x shm host={endpoints.host_identity('host0')} pid=1")
    assert choose(advert, "auto", endpoints.host_identity("host0")) == ("tcp://a:1", "shm")
    assert choose(advert, "ipc", endpoints.host_identity("host1")) == ("tcp://a:1", "tcp")


def test_the_launcher_places_server_and_worker_of_a_rank_on_one_emulated_host():
    from tracker.launcher import JobSpec
    spec = JobSpec(num_workers=3, num_servers=2, command=("w",), emulate_hosts=2)
    labels = [(p.role, p.rank, p.env["KVSTORE_HOST_LABEL"]) for p in spec.processes(1234)]
    assert labels == [("server", 0, "host0"), ("server", 1, "host1"), ("worker", 0, "host0"),
                      ("worker", 1, "host1"), ("worker", 2, "host0")]
    plain = JobSpec(num_workers=1, num_servers=1, command=("w",)).processes(1234)
    assert all("KVSTORE_HOST_LABEL" not in p.env for p in plain)


EMULATED = textwrap.dedent("""
    import numpy as np, kvstore
    kv = kvstore.create("dist_sync")
    kv.init(1, np.zeros(600_000, np.float32))      # 64 KiB chunks: both servers hold some
    out = np.empty(600_000, np.float32)
    kv.pushpull(1, np.full(600_000, kv.rank + 1, np.float32), out=out)
    print("RANK", kv.rank, "SUM-OK", bool((out == 3).all()), "TRANSPORTS",
          ",".join(kv._client.transports), "CHANNELS",
          ",".join(str(getattr(c, "receiver", None) is not None and c.receiver.bytes_received > 0)
                   for c in kv._client.links), flush=True)
    kv.close()
""")


@needs_memfd
@pytest.mark.slow
def test_emulated_hosts_use_tcp_between_them_and_shared_memory_within(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(EMULATED)
    env = {**os.environ, "PYTHONPATH": ROOT, "KVSTORE_TIMEOUT": "30", "KVSTORE_CHUNK_BYTES": "65536"}
    p = subprocess.run([sys.executable, "-m", "tracker.local", "-n", "2", "-s", "2",
                        "--emulate-hosts", "2", sys.executable, str(script)],
                       env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = sorted(line.split("RANK", 1)[1].split() for line in p.stdout.splitlines() if "RANK " in line)
    # ~1.2 MB per server and message: the tcp half's replies come through the data channel
    assert lines == [["0", "SUM-OK", "True", "TRANSPORTS", "shm,tcp", "CHANNELS", "False,True"],
                     ["1", "SUM-OK", "True", "TRANSPORTS", "tcp,shm", "CHANNELS", "True,False"]], \
        p.stdout + p.stderr


DIES_WRITING = textwrap.dedent("""
    import os, numpy as np, kvstore
    kv = kvstore.create("dist_sync")
    kv.init(1, np.zeros(600_000, np.float32))
    kv.barrier()
    if kv.rank == 1:             # dies after writing into a sum, before saying so
        request = kv._client.request
        def request_or_die(server, op, *args, **kw):
            if op == "written":
                os._exit(3)
            return request(server, op, *args, **kw)
        kv._client.request = request_or_die
    out = np.empty(600_000, np.float32)
    kv.pushpull(1, np.ones(600_000, np.float32), out=out)
    print("FINISHED", kv.rank, flush=True)
""")


@needs_memfd
@pytest.mark.slow
def test_a_worker_dying_inside_a_write_grant_fails_the_job_fast(tmp_path):
    """The round it was writing into can never complete: the others must not hang."""
    from services import FAST_FAILURE
    script = tmp_path / "job.py"
    script.write_text(DIES_WRITING)
    env = {**os.environ, "PYTHONPATH": ROOT, "KVSTORE_TIMEOUT": "60", **FAST_FAILURE}
    p = subprocess.run([sys.executable, "-m", "tracker.local", "-n", "2", "-s", "1", sys.executable,
                        str(script)], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 3, p.stdout + p.stderr
    assert "job failed: worker 1 exited with status 3" in p.stdout + p.stderr
    assert "FINISHED" not in p.stdout


# -- nothing left behind ----------------------------------------------------------------------
JOB = textwrap.dedent("""
    import os, signal, sys, numpy as np, kvstore
    from kvstore.transport import Advert
    kv = kvstore.create("dist_sync")
    kv.init(1, np.zeros(600_000, np.float32))
    out = np.empty(600_000, np.float32)
    kv.pushpull(1, np.ones(600_000, np.float32), out=out)
    maps = open("/proc/self/maps").read()
    server = Advert.parse(kv._membership.registration.servers[0]).pid
    print("RANK", kv.rank, "SUM", out[0], "TRANSPORTS", ",".join(kv._client.transports),
          "MAPS-SERVER", "memfd:kvstore-s0" in maps, "PIDS", os.getpid(), server, flush=True)
    kv.barrier()                     # both ranks printed before anyone is killed
    kill = os.environ.get("KILL")
    if kill == "server" and kv.rank == 0:
        os.kill(server, signal.SIGKILL)
    if kill == "worker" and kv.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    kv.pushpull(1, np.ones(600_000, np.float32), out=out)
    kv.close()
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@needs_memfd
@pytest.mark.slow
@pytest.mark.parametrize("kill", [None, "server", "worker"])
def test_shared_memory_is_released_after_exit_or_kill(tmp_path, kill):
    """Segments are anonymous memory files: nothing appears in /dev/shm, and once the
    job's processes are gone (however they ended) no process holds the memory."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    listing = lambda: set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()  # noqa: E731
    before = listing()
    env = {**os.environ, "PYTHONPATH": ROOT, "KVSTORE_HEARTBEAT_TIMEOUT": "5", "KVSTORE_TIMEOUT": "30"}
    env.pop("KILL", None)
    if kill:
        env["KILL"] = kill
    p = subprocess.run([sys.executable, "-m", "tracker.local", "-n", "2", "-s", "1", sys.executable,
                        str(script)], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = [line.split("RANK", 1)[1].split() for line in p.stdout.splitlines() if "RANK " in line]
    assert len(lines) == 2, p.stdout + p.stderr
    pids = set()
    for words in lines:        # rank SUM 2.0 TRANSPORTS shm MAPS-SERVER True PIDS worker server
        assert words[1:8] == ["SUM", "2.0", "TRANSPORTS", "shm", "MAPS-SERVER", "True", "PIDS"], words
        pids |= {int(words[8]), int(words[9])}
    assert (p.returncode == 0) == (kill is None), p.stdout + p.stderr
    assert not [pid for pid in pids if _alive(pid)]     # every process that mapped segments is gone
    assert not {f for f in listing() - before if "kvstore" in f}


@needs_memfd
def test_a_closed_arena_leaves_no_way_to_map_it():
    arena = shm.Arena("t", segment_bytes=1 << 16)
    a = arena.alloc(100, np.float32)
    fd = arena.locate(a)[0][1]
    arena.close()
    try:                        # the descriptor peers would map it by is closed
        assert not os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:kvstore-t")
    except OSError:
        pass
    assert arena.locate(a) is None
    a[:] = 1                    # still valid for whoever holds it; freed with the last user
    assert a.sum() == 100


def test_gradients_from_kv_empty_are_read_in_place_by_pushpull(make_cluster):
    cluster = make_cluster(2, 2, chunk_bytes=8192, zero_copy_bytes=4096)

    def job(kv):
        kv.init(KEYS, [np.zeros((300, 70), np.float32), np.zeros(5, np.float32), np.zeros(40, np.int64)])
        grads = [kv.empty(v.shape, v.dtype) for v in values(0, 0)]
        in_shm = all(kv._client.links[0].arena.locate(g) is not None for g in grads)
        seen = []
        for step in range(3):
            for g, v in zip(grads, values(kv.rank, step)):
                g[...] = v
            outs = [np.empty_like(g) for g in grads]
            kv.pushpull(KEYS, grads, out=outs)
            seen.append(outs)
        staged_by_pushpull = slots_filled(kv)
        kv.push(KEYS, grads)                 # push copies: the caller may reuse grads at once
        for g in grads:
            g[...] = -1
        kv.pull(KEYS, out=outs)
        kv.pushpull(KEYS, grads)             # no out: the sum is written into grads
        return in_shm, staged_by_pushpull, slots_filled(kv), seen, outs, grads
    for in_shm, staged_by_pushpull, staged, seen, pulled, grads in cluster.run(job):
        assert in_shm and staged_by_pushpull == 0 and staged > 0
        for step, outs in enumerate(seen):
            for got, want in zip(outs, oracle(2, step)):
                np.testing.assert_array_equal(got, want)
        for got, want in zip(pulled, oracle(2, 2)):
            np.testing.assert_array_equal(got, want)
        for got in grads:
            np.testing.assert_array_equal(got, -2)


@pytest.mark.parametrize("write_in", [True, False])
def test_small_buffers_travel_in_the_message_over_shm(make_cluster, write_in):
    """Under KVSTORE_ZERO_COPY_BYTES a buffer is cheaper inline than by reference
    (per-key latency): nothing is staged, replies carry no references. A big one is
    written into the server's sum (or, without write-in, staged in a slot)."""
    cluster = make_cluster(2, 1, zero_copy_bytes=4096, write_in=write_in, write_in_bytes=4096)

    def job(kv):
        kv.init(["tiny", "big"], [np.zeros(1000, np.float32), np.zeros(1024, np.float32)])
        client, seen = kv._client, []
        on_reply = client._on_reply

        def spy(server, frames):     # does the reply refer to shared memory?
            header = msgpack.unpackb(frames[0].bytes)
            if header.get("layout"):     # (its buffers' fields in the frame after the header)
                header.update(msgpack.unpackb(frames[1].bytes))
            seen.append("shm" in header)
            on_reply(server, frames)
        client._on_reply = spy
        out = np.empty(1000, np.float32)
        kv.pushpull("tiny", np.full(1000, kv.rank + 1.0, np.float32), out=out)
        tiny_staged, tiny_seen = slots_filled(kv), list(seen)
        big = np.empty(1024, np.float32)
        kv.pushpull("big", np.full(1024, kv.rank + 1.0, np.float32), out=big)
        return out, big, tiny_staged, slots_filled(kv), (tiny_seen, seen), client.transports
    for out, big, tiny_staged, staged, seen, kinds in cluster.run(job):
        assert kinds == ["shm"]
        np.testing.assert_array_equal(out, 3)
        np.testing.assert_array_equal(big, 3)
        assert tiny_staged == 0 and staged == (0 if write_in else 1)   # 4000 bytes inline
        tiny_seen, seen = seen
        assert tiny_seen == [False] and seen[-1] is True


def test_kv_empty_is_plain_memory_without_shared_memory(make_cluster):
    cluster = make_cluster(1, 1, transport="tcp")

    def job(kv):
        a = kv.empty((3, 4), np.float64)
        return a.shape, a.dtype, next((link.arena for link in kv._client.links if link.kind == "shm"), None)
    assert cluster.run(job)[0] == ((3, 4), np.float64, None)
