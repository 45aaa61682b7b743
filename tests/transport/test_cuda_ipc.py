"""The cuda_ipc transport (issue 29 item 3) on the host devices of the device layer:
workers whose GPUs are emulated (kvstore.devices.HostAccelerators) and servers
whose values live on an emulated GPU (DeviceBackend over HostDevice), both with
exportable memory (kvstore.devices.host_sharing: shared-memory segments opened
through /proc, as CUDA IPC opens a peer's allocation). The protocol, the slots,
the ordering points and every copy run as on a GPU host; only the device calls
differ (kvstore/devices/cuda_sharing.py, run by `pytest -m gpu` on hardware)."""

from __future__ import annotations

import os
import pathlib
import threading

import msgpack
import numpy as np
import pytest
import zmq

import kvstore.devices as devices
from kvstore import optimizer as opt
from kvstore.devices import HostAccelerators, HostDevice
from kvstore.devices.host_sharing import HostSharing
from kvstore.errors import InvalidArgumentError
from kvstore.server import backend as server_backend
from kvstore.transport import shm

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs memfd_create (Linux)")

SMALL_CHUNKS = 4096


@pytest.fixture
def sharing_gpus(monkeypatch):
    """Two emulated GPUs per worker process and one per server, all exportable.
    Returns (the workers' accelerators, the servers' backends as they are made)."""
    acc = HostAccelerators(2, sharing=HostSharing("w"))
    monkeypatch.setattr(devices, "worker_accelerators", lambda: acc)
    backends: list = []
    plain = server_backend.for_config

    def for_config(config, rank, alloc=None, shared=None, host=None):
        if config.server_device != "gpu":
            return plain(config, rank, alloc, shared, host)
        backends.append(server_backend.DeviceBackend(HostDevice(HostSharing(f"s{rank}")), host))
        return backends[-1]
    monkeypatch.setattr(server_backend, "for_config", for_config)
    yield acc, backends
    acc.sharing.close()
    for b in backends:
        b.dev.sharing.close()


def on(acc, x, d=0):
    return acc.to_device(np.asarray(x, np.float32), d)


def grad(rank, step, shape, device=0):
    return np.full(shape, (rank + 1) * (step + 1) + 10 * device, np.float32)


def total(workers, step, shape):
    return sum(grad(r, step, shape, d) for r in range(workers) for d in range(2))


def count_server_opens(monkeypatch) -> list:
    """Every device buffer a server opened (the endpoint's resolver)."""
    from kvstore.transport.endpoints.cuda_ipc_endpoint import CudaIpcEndpoint
    opened: list = []
    original = CudaIpcEndpoint._open

    def spy(self, segment, offset, dtype, shape):
        opened.append(tuple(segment))
        return original(self, segment, offset, dtype, shape)
    monkeypatch.setattr(CudaIpcEndpoint, "_open", spy)
    return opened


@pytest.mark.parametrize("workers, servers", [(1, 1), (2, 2)])
def test_device_values_travel_by_reference(make_cluster, sharing_gpus, monkeypatch, workers, servers):
    """dist_device_sync between emulated GPUs over cuda_ipc: per-device lists summed on
    the first device, pushed as references into the link's device slots, summed by the
    servers straight from them, and answered with references to the servers' values,
    copied device to device into outputs on both devices and the host. A pushpull
    moves nothing through the host: no download, no upload."""
    acc, backends = sharing_gpus
    opened = count_server_opens(monkeypatch)
    shapes, keys = [(10,), (3000,), (40, 50)], [3, -5, 7]
    cluster = make_cluster(workers, servers, chunk_bytes=SMALL_CHUNKS, server_device="gpu")

    def job(kv):
        kv.init(keys, [on(acc, np.zeros(s)) for s in shapes])
        seen = []
        for step in range(2):
            outs = [[acc.empty(0, int(np.prod(s)), np.float32).reshape(s),
                     acc.empty(1, int(np.prod(s)), np.float32).reshape(s)] for s in shapes]
            values = [[on(acc, grad(kv.rank, step, s, d), d) for d in range(2)] for s in shapes]
            before = (acc.downloads, acc.uploads)
            kv.pushpull(keys, values, out=outs)
            untouched = (acc.downloads, acc.uploads) == before
            kv.barrier()                 # (the counters are the workers': count one pushpull at a time)
            for per_device, s in zip(outs, shapes):
                per_device.append(np.empty(s, np.float32))
            kv.pull(keys, out=outs)      # the same values, into outputs on both devices and the host
            seen.append((outs, untouched))
        kv.init(100, np.ones((40, 50), np.float32))
        kv.set_optimizer(opt.SGD(learning_rate=1.0))
        for step in range(3):
            kv.pushpull(100, [on(acc, grad(kv.rank, step, (40, 50), d), d) for d in range(2)])
        w = on(acc, np.empty((40, 50)), 1)
        kv.pull(100, out=w)
        return seen, w, kv._client.transports

    for seen, w, transports in cluster.run(job, "dist_device_sync"):
        assert transports == ["cuda_ipc"] * servers
        for step, (outs, untouched) in enumerate(seen):
            if workers == 1:      # (the workers share the emulation's counters)
                assert untouched, "a pushpull over cuda_ipc crossed to the host"
            for per_device, s in zip(outs, shapes):
                assert [acc.holds(o) for o in per_device] == [True, True, False]
                for o in per_device:
                    np.testing.assert_array_equal(o, total(workers, step, s))
        expected = 1 - sum(total(workers, step, (40, 50)).astype(np.float64) for step in range(3))
        np.testing.assert_allclose(w, expected.astype(np.float32), rtol=1e-6)
        assert acc.index_of(w) == 1
    assert len(backends) == servers and opened, "the servers never read a worker's device memory"


def test_a_pushpulls_chunk_copies_are_batched_whatever_the_number_of_keys(make_cluster, sharing_gpus):
    """The device copies of a pushpull (its values into the link's slots, the server's
    values into the outputs: cupy-like outputs are answered in place, with no reply
    block) are a few batches, one kernel each on a GPU (kvstore/devices/cuda_copies.py),
    not one copy per key: 3 keys and 60 keys make the same number (one message to the
    one server)."""
    acc, _ = sharing_gpus
    cluster = make_cluster(1, 1, server_device="gpu")

    def batches_of(kv, keys):
        kv.init(keys, [on(acc, np.zeros(7 + i)) for i in range(len(keys))])
        values = [on(acc, grad(0, 0, 7 + i)) for i in range(len(keys))]
        outs = [acc.empty(0, 7 + i, np.float32) for i in range(len(keys))]
        before = acc.batches
        kv.pushpull(keys, values, out=outs)
        for i, out in enumerate(outs):
            np.testing.assert_array_equal(out, grad(0, 0, 7 + i))
        return acc.batches - before
    [(few, many)] = cluster.run(lambda kv: (batches_of(kv, [f"a{i}" for i in range(3)]),
                                            batches_of(kv, [f"b{i}" for i in range(60)])), "dist_device_sync")
    assert few == many == 2


def _slotted(kv) -> set:
    """The chunk keys the worker's cuda_ipc links made device slots for."""
    return {key for link in kv._client.links for key in link._device_slots._slots}


def test_device_memory_from_empty_is_read_in_place_without_slots(make_cluster, sharing_gpus, monkeypatch):
    """kv.empty(shape, dtype, device=i) memory (kvstore/devices/arena.py) goes to the
    GPU servers by reference as it is: a pushpull makes no slot and no copy for it
    (the servers open the arena's own segment), beside a value that still goes
    through a slot; async pushpulls too; a push, which returns before the servers
    read, still copies. Sums are the formulas' at every step, the arrays reused."""
    acc, _ = sharing_gpus
    opened = count_server_opens(monkeypatch)
    cluster = make_cluster(2, 2, chunk_bytes=SMALL_CHUNKS, server_device="gpu")

    def job(kv):
        kv.init(["a", "b", "c"], [on(acc, np.zeros(s)) for s in ((3000,), (40, 50), (9,))])
        lent = [kv.empty(3000, np.float32, device=0), kv.empty((40, 50), np.float32, device=1)]
        segments = {kv._client.links[0]._arena.locate(a)[0] for a in lent}
        results = []
        for step in range(3):
            lent[0][...] = grad(kv.rank, step, (3000,))
            lent[1][...] = grad(kv.rank, step, (40, 50), 1)
            plain = on(acc, grad(kv.rank, step, (9,)))
            outs = [acc.empty(0, 3000, np.float32), acc.empty(1, 2000, np.float32).reshape(40, 50),
                    acc.empty(0, 9, np.float32)]
            if step < 2:
                kv.pushpull(["a", "b", "c"], lent + [plain], out=outs)
            else:
                kv.pushpull_async(["a", "b", "c"], lent + [plain], out=outs).wait()
            results.append([np.array(o) for o in outs])
        slotted = _slotted(kv)
        kv.push("a", lent[0])                   # returns before the servers read: copied
        kv.barrier()
        return results, slotted, _slotted(kv) - slotted, segments, [acc.holds(a) for a in lent]

    chunks_of_a = -(-3000 * 4 // SMALL_CHUNKS)
    for results, slotted, pushed, segments, on_devices in cluster.run(job, "dist_device_sync"):
        assert on_devices == [True, True]
        for step, outs in enumerate(results):
            np.testing.assert_array_equal(outs[0], sum(grad(r, step, (3000,)) for r in range(2)))
            np.testing.assert_array_equal(outs[1], sum(grad(r, step, (40, 50), 1) for r in range(2)))
            np.testing.assert_array_equal(outs[2], sum(grad(r, step, (9,)) for r in range(2)))
        assert {key[0] for key in slotted} == {"c"}        # only the plain value used a slot
        assert len(pushed) == chunks_of_a and {key[0] for key in pushed} == {"a"}
        assert segments <= set(opened)                      # the servers opened the arena itself


def test_device_empty_without_cuda_ipc_is_plain_device_memory(make_cluster, sharing_gpus):
    """With CPU servers (no cuda_ipc), kv.empty(..., device=i) is ordinary device
    memory and pushpulls as any device value; a bad ordinal is refused by name."""
    acc, _ = sharing_gpus
    cluster = make_cluster(1, 1)

    def job(kv):
        kv.init("w", on(acc, np.zeros(6)))
        g = kv.empty(6, np.float32, device=1)
        g[...] = 4.0
        out = acc.empty(1, 6, np.float32)
        kv.pushpull("w", g, out=out)
        with pytest.raises(InvalidArgumentError, match=r"empty\(device=2\): expected a device ordinal"):
            kv.empty(6, np.float32, device=2)
        return acc.index_of(g), np.array(out), kv._client.transports
    [(index, out, transports)] = cluster.run(job, "dist_device_sync")
    assert (index, transports) == (1, ["shm"])
    np.testing.assert_array_equal(out, np.full(6, 4.0))


def test_device_arena_locates_only_its_own_memory():
    """kvstore.devices.arena on its own: a view inside one allocation is located (its
    segment and offset), one that spills over its end, other memory and host arrays
    are not."""
    from kvstore.devices.arena import DeviceArena
    acc = HostAccelerators(2, sharing=HostSharing("arena"))
    try:
        arena = DeviceArena(acc)
        a, b = arena.alloc(0, 1024, np.float32), arena.alloc(1, 16, np.float32)
        segment, offset = arena.locate(a)
        assert arena.locate(a[256:512]) == (segment, offset + 1024)
        assert arena.locate(b)[0] is not None and arena.locate(b[::2]) is None     # strided: not exportable
        spill = a[1000:1024].view(np.ndarray)
        assert arena.locate(spill) is None                  # a host array (untagged)
        assert arena.locate(acc.empty(0, 8, np.float32)) is None
        assert arena.locate(acc.sharing.empty(0, 8, np.float32)) is None   # exportable, not the arena's
        arena.close()
        assert arena.locate(a) is None
    finally:
        acc.sharing.close()


def test_a_server_with_host_values_leaves_co_located_workers_on_shared_memory(make_cluster, sharing_gpus,
                                                                              monkeypatch):
    """CPU servers do not offer cuda_ipc: the GPU workers use shared memory (their
    sums staged to the host), with the same results."""
    acc, _ = sharing_gpus
    opened = count_server_opens(monkeypatch)
    cluster = make_cluster(1, 1)

    def job(kv):
        kv.init("w", on(acc, np.zeros(5)))
        out = acc.empty(1, 5, np.float32)
        kv.pushpull("w", [on(acc, grad(0, 0, 5, d), d) for d in range(2)], out=out)
        return np.array(out), kv._client.transports
    [(out, transports)] = cluster.run(job, "dist_device_sync")
    assert transports == ["shm"]
    np.testing.assert_array_equal(out, total(1, 0, 5))
    assert not opened


def test_a_push_while_the_slot_is_busy_takes_another_slot(make_cluster, sharing_gpus):
    """Worker 0 pushes a key twice before worker 1 pushes at all (push returns once its
    values are in the link's slots, not when answered): the server keeps both pushes,
    unsummed, by reference into worker 0's slots until worker 1's arrive. The second
    push must not overwrite the slot of the first."""
    acc, _ = sharing_gpus
    cluster = make_cluster(2, 1, server_device="gpu")
    both_sent = threading.Event()

    def job(kv):
        kv.init("w", on(acc, np.zeros(8)))
        kv.set_optimizer(opt.SGD(learning_rate=1.0))
        if kv.rank == 0:
            kv.push("w", on(acc, np.full(8, 1.0)))
            kv.push("w", on(acc, np.full(8, 2.0)))
            both_sent.set()
        else:
            assert both_sent.wait(30)
            kv.push("w", on(acc, np.full(8, 10.0)))
            kv.push("w", on(acc, np.full(8, 20.0)))
        kv.barrier()
        out = acc.empty(0, 8, np.float32)
        kv.pull("w", out=out)
        return np.array(out)
    for out in cluster.run(job, "dist_device_sync"):
        np.testing.assert_array_equal(out, -(1.0 + 10.0) - (2.0 + 20.0))


def _raw_request(cluster, header: dict, handshake: dict | None = None) -> dict:
    """Send one request straight to server 0 (a DEALER of our own), after
    ``handshake`` (a device_hello, whose reply must be dev_ok) if given; its reply header."""
    from kvstore.transport.endpoints import Advert
    address = Advert.parse(cluster.nodes[0].address).url("tcp")
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        sock.connect(address)
        for sent in ([handshake] if handshake is not None else []) + [header]:
            sock.send_multipart([msgpack.packb({"v": 1, "src": 0, **sent}, use_bin_type=True)])
            assert sock.poll(10_000), "no reply"
            reply = msgpack.unpackb(sock.recv_multipart()[0], raw=False)
            assert sent is header or reply.get("dev_ok") is True, reply
        return reply
    finally:
        sock.close()


def _device_hello(acc, req_id: int = 99) -> dict:
    """A device_hello whose probe is this process's exported device memory."""
    nonce = os.urandom(16)
    probe = acc.sharing.empty(0, 16, np.uint8)
    probe[...] = np.frombuffer(nonce, np.uint8)
    segment, offset = acc.sharing.export(probe)
    return {"op": "device_hello", "id": req_id, "nonce": nonce, "bufs": [["|u1", [16]]],
            "dev": {"segs": [list(segment)], "refs": [[0, offset]]}}


def _device_request(op: str, req_id: int, segment) -> dict:
    return {"op": op, "id": req_id, "chunks": [["k", 0]], "bufs": [["<f4", [2]]],
            "dev": {"segs": [list(segment)], "refs": [[0, 0]]}}


@pytest.mark.parametrize("make, match", [
    # device buffers only where the state uploads pushes (a real exported buffer)
    (lambda real: _device_request("init", 1, real), "may not carry device-memory buffers"),
    (lambda real: {**_device_request("push", 2, real), "compression": {"type": "2bit", "threshold": 0.5}},
     "may not carry device-memory buffers"),
    # a segment of a process that is not a worker of the job (nor the sender)
    (lambda real: _device_request("push", 3, [1, 5, 4096]), "memory of process 1, which is no worker"),
    # our own process, but no such descriptor
    (lambda real: _device_request("push", 4, [os.getpid(), 1 << 20, 4096]), "cannot open"),
    # past the end of a real segment
    (lambda real: {**_device_request("push", 5, real), "bufs": [["<f4", [1 << 28]]]}, "does not fit"),
])
def test_bad_device_references_are_refused_by_name(make_cluster, sharing_gpus, make, match):
    """A misplaced, foreign or malformed device reference is answered with a
    ProtocolError that says what is wrong, and changes nothing: the job goes on."""
    acc, _ = sharing_gpus
    cluster = make_cluster(1, 1, server_device="gpu")

    def job(kv):
        kv.init("k", on(acc, np.ones(2)))
        out = acc.empty(0, 2, np.float32)
        kv.pull("k", out=out)
        exported, _ = acc.sharing.export(acc.sharing.empty(0, 2, np.float32))
        header = make(exported)
        reply = _raw_request(cluster, header, _device_hello(acc))
        kv.pull("k", out=out)
        return header, reply, np.array(out), kv._client.transports
    [(header, reply, out, transports)] = cluster.run(job, "dist_device_sync")
    assert reply["op"] == "error" and reply["kind"] == "ProtocolError" and match in reply["message"], reply
    assert reply["id"] == header["id"]
    assert transports == ["cuda_ipc"]
    np.testing.assert_array_equal(out, 1.0)     # the value did not change


def test_a_worker_without_device_memory_to_share_uses_shared_memory(make_cluster, monkeypatch):
    """A GPU server offers cuda_ipc, but a worker whose accelerators cannot export
    (or a CPU worker) does not try it: it goes on to shm quietly."""
    acc = HostAccelerators(1)                       # no sharing
    monkeypatch.setattr(devices, "worker_accelerators", lambda: acc)
    made = []

    def for_config(config, rank, alloc=None, shared=None, host=None):
        made.append(server_backend.DeviceBackend(HostDevice(HostSharing(f"s{rank}")), host))
        return made[-1]
    monkeypatch.setattr(server_backend, "for_config", for_config)
    from kvstore.server import dataplane
    from kvstore.transport.endpoints import shm_endpoint
    frames_out = no_device_frames(monkeypatch, dataplane, shm_endpoint)
    cluster = make_cluster(1, 1, server_device="gpu")

    def job(kv):
        kv.init("w", np.zeros(3, np.float32))
        out = np.empty(3, np.float32)
        kv.pushpull("w", np.ones(3, np.float32), out=out)
        return out, kv._client.transports
    try:
        [(out, transports)] = cluster.run(job, "dist_device_sync")
    finally:
        for b in made:
            b.dev.sharing.close()
    assert transports == ["shm"]
    np.testing.assert_array_equal(out, 1.0)
    assert frames_out, "no reply went through the codec"


def no_device_frames(monkeypatch, *modules) -> list:
    """Wrap ``encode`` (the codec) where the server's data plane and endpoints call it:
    a device array may go by reference, never as a frame (on a GPU it has no host bytes)."""
    from kvstore.devices.host import _DeviceArray
    from kvstore.protocol import encode as original
    seen: list = []

    def encode(header, arrays=(), shared=None, layout=False, sent=None):
        places = list(shared) if shared else [None] * len(arrays)
        bad = [i for i, (a, place) in enumerate(zip(arrays, places)) if place is None and isinstance(a, _DeviceArray)]
        assert not bad, f"{header.get('op')} reply {header.get('id')}: device arrays {bad} as frames"
        seen.append(header.get("id"))
        return original(header, arrays, shared, layout, sent)
    for module in modules:
        monkeypatch.setattr(module, "encode", encode)
    return seen


def test_compressed_pushes_cross_to_the_host(make_cluster, sharing_gpus):
    """Gradient compression works on host arrays: a compressed pushpull stages its
    device sums to the host even over cuda_ipc, with MXNet's 2-bit results."""
    acc, _ = sharing_gpus
    cluster = make_cluster(1, 1, server_device="gpu")

    def job(kv):
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
        kv.init("w", on(acc, np.zeros(4)))
        out = acc.empty(0, 4, np.float32)
        downloads = acc.downloads
        kv.pushpull("w", on(acc, [1.0, -1.0, 0.2, 0.6]), out=out)
        return np.array(out), acc.downloads - downloads
    [(out, downloads)] = cluster.run(job, "dist_device_sync")
    np.testing.assert_array_equal(out, [0.5, -0.5, 0.0, 0.5])
    assert downloads >= 1


def test_remote_error_over_cuda_ipc_names_the_key(make_cluster, sharing_gpus):
    """A wrong shape pushed from a device value is refused before anything is sent."""
    acc, _ = sharing_gpus
    cluster = make_cluster(1, 1, server_device="gpu")

    def job(kv):
        kv.init("w", on(acc, np.zeros(4)))
        with pytest.raises(Exception, match="w"):
            kv.pushpull("w", on(acc, np.zeros(5)))
        out = acc.empty(0, 4, np.float32)
        kv.pull("w", out=out)
        return np.array(out)
    [out] = cluster.run(job, "dist_device_sync")
    np.testing.assert_array_equal(out, 0.0)


# -- a host's group on the devices (KVSTORE_HOST_REDUCE; issue 29 item 4) -------------------------
@pytest.mark.parametrize("server_device", ["gpu", "cpu"])
def test_a_host_group_sums_on_the_leaders_device_from_the_members_memory(make_cluster, sharing_gpus,
                                                                         server_device):
    """Two GPU workers on one host with KVSTORE_HOST_REDUCE: the member's device sums
    go to the leader by reference, the leader adds them on its device straight from
    the member's memory, pushes the host's sum once (by reference to GPU servers; to
    CPU servers staged to the host first) and hands the result back by reference,
    copied device to device. With GPU servers nothing crosses to the host."""
    acc, _ = sharing_gpus
    cluster = make_cluster(2, 1, host_reduce=True, server_device=server_device, chunk_bytes=SMALL_CHUNKS)

    def job(kv):
        kv.init(["w", "v"], [on(acc, np.zeros(3000)), on(acc, np.zeros(10))])
        results = []
        for step in range(3):
            values = [[on(acc, grad(kv.rank, step, n, d), d) for d in range(2)] for n in (3000, 10)]
            outs = [acc.empty(1, n, np.float32) for n in (3000, 10)]
            kv.barrier()
            before = (acc.downloads, acc.uploads)
            kv.pushpull_async(["w", "v"], values, out=outs).wait()
            kv.barrier()
            untouched = (acc.downloads, acc.uploads) == before
            kv.barrier()                # (the counters are both workers': none uploads meanwhile)
            results.append(([np.array(o) for o in outs], untouched))
        return kv.host_group, kv._exchange.host.on_device, results, kv.comm_stats()

    runs = cluster.run(job, "dist_device_sync")
    for group, on_device, results, _ in runs:
        assert group == (0, 1) and on_device
        for step, (outs, untouched) in enumerate(results):
            for out, n in zip(outs, (3000, 10)):
                np.testing.assert_array_equal(out, total(2, step, n))
            assert untouched == (server_device == "gpu")
    member_stats = runs[1][3]
    assert member_stats["host_bytes_sent"] > 0 and member_stats["bytes_sent"] < runs[0][3]["bytes_sent"]


def test_a_host_group_with_a_worker_that_cannot_share_stays_on_the_host(make_cluster, monkeypatch):
    """One worker's GPUs can export memory, the other's cannot: the group forms
    without device references (both sides agree at hello/welcome), staging through
    the host as before, with the same sums."""
    shared = HostAccelerators(2, sharing=HostSharing("w"))
    plain = HostAccelerators(2)
    handed = iter([shared, plain])
    monkeypatch.setattr(devices, "worker_accelerators", lambda: next(handed))
    cluster = make_cluster(2, 1, host_reduce=True)

    def job(kv):
        acc = kv._accelerators
        kv.init("w", acc.to_device(np.zeros(500, np.float32), 0))
        out = acc.empty(0, 500, np.float32)
        kv.pushpull("w", [acc.to_device(grad(kv.rank, 0, 500, d), d) for d in range(2)], out=out)
        return kv.host_group, kv._exchange.host.on_device, np.array(out)
    try:
        for group, on_device, out in cluster.run(job, "dist_device_sync"):
            assert group == (0, 1) and not on_device
            np.testing.assert_array_equal(out, total(2, 0, 500))
    finally:
        shared.sharing.close()


def test_a_members_results_stay_until_it_has_copied_them(make_cluster, sharing_gpus):
    """Two pushpulls in flight at once (pushpull_async, as the Trainer overlaps its
    buckets): the leader hands out the second call's result while the member has not
    copied the first's yet, so the first's result slot must not be reused for it."""
    acc, _ = sharing_gpus
    cluster = make_cluster(2, 1, host_reduce=True, server_device="gpu")

    def job(kv):
        kv.init("w", on(acc, np.zeros(2000)))
        outs = [acc.empty(0, 2000, np.float32) for _ in range(3)]
        calls = [kv.pushpull_async("w", on(acc, grad(kv.rank, step, 2000)), out=out)
                 for step, out in enumerate(outs)]
        for call in calls:
            call.wait()
        return kv._exchange.host.on_device, [np.array(o) for o in outs]
    for on_device, outs in cluster.run(job, "dist_device_sync"):
        assert on_device
        for step, out in enumerate(outs):
            np.testing.assert_array_equal(out, grad(0, step, 2000) + grad(1, step, 2000))


# -- the same between real processes -------------------------------------------------------
EMULATED_JOB = """
import os, sys
import numpy as np
import kvstore.devices as devices
from kvstore.devices import HostAccelerators, HostDevice
from kvstore.devices.host_sharing import HostSharing
from kvstore.errors import InvalidArgumentError
from kvstore.server import backend
# emulated GPUs whose memory other processes open (kvstore.devices.host_sharing): two
# per worker process, one per server process (servers run this script too)
acc = HostAccelerators(2, sharing=HostSharing(f"p{os.getpid()}"))
devices.worker_accelerators = lambda: acc
backend.for_config = lambda config, rank, alloc=None, shared=None, host=None: backend.DeviceBackend(
    HostDevice(HostSharing(f"s{rank}")), host)
import kvstore
kv = kvstore.create("dist_device_sync")        # a server runs its role here and exits
r, W = kv.rank, kv.num_workers
grad = lambda rank, step, d: np.full(20_000, (rank + 1) * (step + 1) + 10 * d, np.float32)
kv.init("w", acc.to_device(np.zeros(20_000, np.float32), 0))
ok, copies = True, 0
for step in range(3):
    values = [acc.to_device(grad(r, step, d), d) for d in range(2)]
    out = acc.empty(1, 20_000, np.float32)
    before = acc.downloads + acc.uploads
    kv.pushpull_async("w", values, out=out).wait()
    copies += acc.downloads + acc.uploads - before
    ok &= bool((np.asarray(out) == sum(grad(w, step, d) for w in range(W) for d in range(2))).all())
host = kv._exchange.host
print("RANK", r, "OK", ok, "TRANSPORTS", ",".join(kv._client.transports), "HOSTCOPIES", copies,
      "GROUP", ",".join(map(str, kv.host_group)) or "-", "ONDEVICE", host.on_device if host else "-", flush=True)
kv.close()
"""

EMULATED_LAUNCH = """
import sys
from tracker.launcher import JobSpec, run_cli
job = (sys.executable, sys.argv[1])
sys.exit(run_cli(JobSpec(num_workers=2, num_servers=2, command=job, server_command=job,
                         env={"KVSTORE_SERVER_DEVICE": "gpu", "KVSTORE_CHUNK_BYTES": "16384",
                              "KVSTORE_HOST_REDUCE": sys.argv[2], "KVSTORE_TIMEOUT": "60"})))
"""


@pytest.mark.slow
@pytest.mark.parametrize("host_reduce", ["0", "1"])
def test_cuda_ipc_between_processes_on_emulated_gpus(tmp_path, host_reduce):
    """Workers and GPU servers as separate processes (the job script emulates their
    GPUs with exportable memory; servers run it too): device sums by reference to
    the servers, answered by reference, summed within the host by reference with
    KVSTORE_HOST_REDUCE=1; no host copy on the way, and the formulas' sums."""
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[2]
    script = tmp_path / "job.py"
    script.write_text(EMULATED_JOB)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    p = subprocess.run([sys.executable, "-c", EMULATED_LAUNCH, str(script), host_reduce], env=env,
                       capture_output=True, text=True, timeout=180, cwd=root)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = sorted(line.split("RANK", 1)[1].split() for line in p.stdout.splitlines() if "RANK " in line)
    group, on_device = ("0,1", "True") if host_reduce == "1" else ("-", "-")
    assert lines == [[str(rank), "OK", "True", "TRANSPORTS", "cuda_ipc,cuda_ipc", "HOSTCOPIES", "0",
                      "GROUP", group, "ONDEVICE", on_device] for rank in (0, 1)], p.stdout + p.stderr


def test_device_slots_are_busy_until_released_and_then_reused():
    """kvstore.devices.slots on its own: a key's slot is held by its holder (a second
    holder gets another slot), freed by release and then reused; the references
    open to the staged values in a peer."""
    from kvstore.devices.slots import DeviceSlots
    acc = HostAccelerators(2, sharing=HostSharing("slots"))
    peer = HostSharing("peer")
    peer.allow([os.getpid()])
    try:
        slots = DeviceSlots(acc)
        a, b = on(acc, np.arange(8), 1), on(acc, np.arange(8) + 100, 1)
        [ra] = slots.stage("first", ["k"], [a])
        [rb] = slots.stage("second", ["k"], [b])
        assert ra[:2] != rb[:2]                        # a busy slot is not reused
        for ref, value in ((ra, a), (rb, b)):
            seen = peer.open(0, ref[0], ref[1], np.dtype(np.float32), (8,))
            np.testing.assert_array_equal(seen, value)
            assert not seen.flags.writeable           # the reader cannot write into them
        slots.release("first")
        [rc] = slots.stage("third", ["k"], [on(acc, np.zeros(8), 1)])
        assert rc[:2] == ra[:2]                        # released: reused
        assert sorted(map(str, slots.holders())) == ["second", "third"]
        with pytest.raises(ValueError, match="exported"):
            DeviceSlots(HostAccelerators(1))
    finally:
        peer.close()
        acc.sharing.close()


def test_a_reference_opened_or_exported_again_is_the_same_array_and_checks_stay():
    """kvstore.devices.references through the host devices' sharing: the same reference
    opens to the same (read-only) array and the same array exports to the same
    reference, without a second shared-memory view or segment search; another offset,
    dtype or shape is another array; a reference refused once (not a peer's, or out of
    the segment) is refused again; an array that died takes its entry with it, and
    the caches are bounded and cleared on close."""
    import gc
    from kvstore.devices import references
    from kvstore.errors import ProtocolError
    mine, peer = HostSharing("cache-w"), HostSharing("cache-s")
    try:
        a = mine.empty(0, 8, np.float32)
        a[:] = np.arange(8)
        segment, offset = mine.export(a)
        assert mine.export(a) == (segment, offset)
        f32 = np.dtype(np.float32)
        with pytest.raises(ProtocolError, match="not a peer"):
            peer.open(0, list(segment), offset, f32, [8])
        with pytest.raises(ProtocolError, match="not a peer"):       # refused: not kept
            peer.open(0, list(segment), offset, f32, [8])
        peer.allow([os.getpid()])
        first = peer.open(0, list(segment), offset, f32, [8])
        assert peer.open(0, tuple(segment), offset, f32, (8,)) is first
        np.testing.assert_array_equal(first, np.arange(8))
        assert not first.flags.writeable
        a[3] = 42                                                    # the same memory, not a copy
        assert first[3] == 42
        other = peer.open(0, list(segment), offset + 4, f32, [4])
        assert other is not first and other[0] == 1
        assert peer.open(0, list(segment), offset, np.dtype(np.int32), [8]) is not first
        with pytest.raises(ProtocolError, match="does not fit"):
            peer.open(0, list(segment), offset, f32, [1 << 40])
        # an entry is an array's only while that array lives: a new array at a dead
        # one's id (staged here by moving the entry) does not take its reference
        b, c = mine.empty(0, 4, np.float32), mine.empty(0, 4, np.float32)
        exported = references.Exported()
        exported.keep(b, mine.export(b))
        assert exported.get(b) == mine.export(b) and exported.get(c) is None
        exported._places[id(c)] = exported._places.pop(id(b))
        assert exported.get(c) is None
        ref = exported._places[id(c)][0]
        del b
        gc.collect()
        assert ref() is None
        # bounded: full, it starts again empty
        opened = references.Opened(limit=3)
        for i in range(3):
            opened.keep((i,), i)
        assert len(opened) == 3
        opened.keep((9,), 9)
        assert len(opened) == 1 and opened.get((9,)) == 9 and opened.get((0,)) is None
        peer.close()
        assert len(peer._opened) == 0
    finally:
        peer.close()
        mine.close()


def test_device_slots_take_a_key_lists_last_slots_again_only_when_all_are_free_and_fit():
    """kvstore.devices.slots' remembered choice (``Chosen``): the same keys staged again
    after their release go into the same slots (the same references, the new values
    copied in); while a holder still holds them, or when a value is of another size,
    dtype or device, the slots are chosen key by key as before."""
    from kvstore.devices.slots import DeviceSlots
    acc = HostAccelerators(2, sharing=HostSharing("chosen"))
    peer = HostSharing("chosen-peer")
    peer.allow([os.getpid()])
    try:
        slots = DeviceSlots(acc)
        keys = [("k", 0), ("k", 1)]
        first = slots.stage("a", keys, [on(acc, np.arange(4), 0), on(acc, np.arange(6), 0)])
        slots.release("a")
        again = slots.stage("b", keys, [on(acc, np.arange(4) + 10, 0), on(acc, np.arange(6) + 20, 0)])
        assert again == first
        seen = peer.open(0, again[1][0], again[1][1], np.dtype(np.float32), (6,))
        np.testing.assert_array_equal(seen, np.arange(6) + 20)
        busy = slots.stage("c", keys, [on(acc, np.arange(4), 0), on(acc, np.arange(6), 0)])   # "b" holds them
        assert not set(busy) & set(first)
        slots.release("b")
        slots.release("c")
        # the last choice was "c"'s: free again, taken again
        assert slots.stage("d", keys, [on(acc, np.arange(4), 0), on(acc, np.arange(6), 0)]) == busy
        slots.release("d")
        for values in ([on(acc, np.arange(4), 0), on(acc, np.arange(7), 0)],            # another size
                       [on(acc, np.arange(4), 0), on(acc, np.arange(6), 1)],            # another device
                       [on(acc, np.arange(4), 0), acc.to_device(np.arange(6, dtype=np.float64), 0)]):
            places = slots.stage("e", keys, values)
            assert places[1] not in busy + first
            seen = peer.open(0, places[1][0], places[1][1], values[1].dtype, (values[1].size,))
            np.testing.assert_array_equal(seen, values[1])
            slots.release("e")
    finally:
        peer.close()
        acc.sharing.close()
