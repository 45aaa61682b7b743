"""dist_sync / dist_async semantics on an in-process cluster (real sockets,
threads for servers and workers). Expected values are functions of rank and
size; the 'local' store is the oracle."""

import re

import numpy as np
import pytest
import zmq

import kvstore
from kvstore import optimizer as opt
from kvstore.errors import InvalidArgumentError, RemoteError
from kvstore.protocol import decode, encode

SIZES = [(1, 1), (2, 1), (2, 3), (3, 2), (4, 3)]
SMALL_CHUNKS = 4096  # bytes: makes even small keys span several servers


def grad(rank, step, shape, dtype=np.float32):
    """What worker `rank` pushes at `step`: exact in float32, distinct per rank/step."""
    base = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) % 7
    return (base + (rank + 1) * (step + 1)).astype(dtype)


def round_sum(num_workers, step, shape, dtype=np.float32):
    return sum(grad(r, step, shape, np.float64) for r in range(num_workers)).astype(dtype)


@pytest.mark.parametrize("workers, servers", SIZES)
@pytest.mark.parametrize("keys", [[3, -5, (1 << 62)], ["w", "b", "emb"]], ids=["int", "str"])
def test_sync_push_assigns_the_sum_of_the_round(make_cluster, workers, servers, keys):
    shapes = [(2, 3), (3000,), (40, 50)]
    cluster = make_cluster(workers, servers, chunk_bytes=SMALL_CHUNKS)

    def job(kv):
        kv.init(keys, [np.zeros(s, np.float32) for s in shapes])
        seen = []
        for step in range(3):
            for key, shape in zip(keys, shapes):
                kv.push(key, grad(kv.rank, step, shape))
            outs = [np.empty(s, np.float32) for s in shapes]
            kv.pull(keys, out=outs)
            seen.append(outs)
        return seen

    for seen in cluster.run(job):
        for step, outs in enumerate(seen):
            for out, shape in zip(outs, shapes):
                np.testing.assert_array_equal(out, round_sum(workers, step, shape))


@pytest.mark.parametrize("workers, servers", [(2, 3), (3, 2)])
def test_big_key_is_split_over_servers_and_sgd_formula_holds(make_cluster, workers, servers):
    shape = (1200, 1200)
    cluster = make_cluster(workers, servers)   # default 2 MiB chunks: 3 chunks

    def job(kv):
        kv.init(9, np.ones(shape, np.float32))
        kv.set_optimizer(opt.SGD(learning_rate=1.0))
        for step in range(2):
            kv.push(9, grad(kv.rank, step, shape))
        out = np.empty(shape, np.float32)
        kv.pull(9, out=out)
        return out, {c.server for c in kv._keys[9].chunks}

    expected = 1 - round_sum(workers, 0, shape) - round_sum(workers, 1, shape)
    for out, used in cluster.run(job):
        np.testing.assert_array_equal(out, expected)
        assert used == set(range(min(servers, 3)))


@pytest.mark.parametrize("workers, servers", [(1, 1), (3, 2)])
def test_lists_of_keys_and_per_device_values(make_cluster, workers, servers):
    cluster = make_cluster(workers, servers, chunk_bytes=SMALL_CHUNKS)

    def job(kv):
        kv.init([0, 1], [np.zeros(10, np.float32), np.zeros(2000, np.float32)])
        devices = lambda shape: [grad(kv.rank, 0, shape), grad(kv.rank, 1, shape)]
        kv.push([0, 1], [devices((10,)), devices((2000,))])
        outs = [[np.empty(10, np.float32), np.empty(10, np.float32)], [np.empty(2000, np.float32)]]
        kv.pull([0, 1], out=outs)
        return outs

    for outs in cluster.run(job):
        for shape, per_key in (((10,), outs[0]), ((2000,), outs[1])):
            expected = round_sum(workers, 0, shape) + round_sum(workers, 1, shape)
            for out in per_key:
                np.testing.assert_array_equal(out, expected)


def test_pushpull_and_broadcast(make_cluster):
    cluster = make_cluster(3, 2, chunk_bytes=SMALL_CHUNKS)

    def job(kv):
        value = np.arange(5000, dtype=np.float32) * (kv.rank + 1)
        got = np.empty(5000, np.float32)
        kv.broadcast("w", value, out=got)        # rank 0's value everywhere
        g = grad(kv.rank, 0, (5000,))
        kv.pushpull("w", g)                      # out=None: written back into g
        out = np.empty(5000, np.float32)
        kv.pushpull("w", grad(kv.rank, 1, (5000,)), out=out)
        return got, g, out

    for got, g, out in cluster.run(job):
        np.testing.assert_array_equal(got, np.arange(5000))
        np.testing.assert_array_equal(g, round_sum(3, 0, (5000,)))
        np.testing.assert_array_equal(out, round_sum(3, 1, (5000,)))


def test_pushpulls_started_together_finish_in_any_order(make_cluster):
    """pushpull_async (what the Trainer uses during backward) sends at once and
    returns; results land by the matching handle.wait(), in any order."""
    cluster = make_cluster(2, 2, chunk_bytes=SMALL_CHUNKS)

    def job(kv):
        kv.init(["a", "b"], [np.zeros(4000, np.float32), np.zeros(10, np.float32)])
        ga, gb = np.full(4000, kv.rank + 1.0, np.float32), np.full(10, 10.0 * (kv.rank + 1), np.float32)
        oa, ob = np.empty(4000, np.float32), np.empty(10, np.float32)
        ha = kv.pushpull_async("a", ga, out=oa)
        hb = kv.pushpull_async("b", gb, out=ob)
        in_flight = len(kv._client._pending)
        hb.wait()
        ha.wait()
        with pytest.raises(InvalidArgumentError, match="dtype|int32"):
            kv.pushpull_async("b", np.ones(10, np.int32))     # checked before anything is sent
        return in_flight, oa, ob

    for in_flight, oa, ob in cluster.run(job):
        assert in_flight >= 2                   # both were on the wire before either finished
        np.testing.assert_array_equal(oa, 3.0)
        np.testing.assert_array_equal(ob, 30.0)


@pytest.mark.parametrize("then", ["pull", "push"])
def test_the_next_request_after_a_written_in_pushpull_sees_its_round(make_cluster, then):
    """pushpull_async writes large chunks into co-located servers' sums (write, then
    written once the grant came); a pull or push of the same key sent before
    _pushpull_finish counts that write as this worker's push: the pull reads its round,
    the push takes the next one."""
    cluster = make_cluster(2, 1, chunk_bytes=8192, zero_copy_bytes=4096, write_in=True,
                           write_in_bytes=8192)

    def job(kv):
        sent = []
        request = kv._client.request
        kv._client.request = lambda server, op, *a, **kw: (sent.append(op), request(server, op, *a, **kw))[1]
        kv.init("w", np.zeros(4000, np.float32))
        seen = []
        for step in range(4):
            out, after = np.empty(4000, np.float32), np.empty(4000, np.float32)
            handle = kv.pushpull_async("w", np.full(4000, (kv.rank + 1) * (step + 1), np.float32), out=out)
            if then == "pull":
                kv.pull("w", out=after)
            else:
                kv.push("w", np.full(4000, 100.0 * (kv.rank + 1), np.float32))
            handle.wait()
            if then == "push":
                kv.pull("w", out=after)
            seen.append((out[0], after[0], np.ptp(out) + np.ptp(after)))
        return seen, sent.count("write")

    for seen, writes in cluster.run(job):
        assert writes == 4, "the test needs the written-in path"
        for step, (out, after, spread) in enumerate(seen):
            assert out == 3 * (step + 1) and spread == 0
            assert after == (3 * (step + 1) if then == "pull" else 300.0)


def test_pull_right_after_push_sees_that_round(make_cluster):
    """No barrier between push and pull: the server holds the pull until the round completes."""
    cluster = make_cluster(3, 2, chunk_bytes=SMALL_CHUNKS)

    def job(kv):
        kv.init(0, np.zeros(3000, np.float32))
        outs = []
        for step in range(5):
            kv.push(0, np.full(3000, kv.rank + step, np.float32))
            out = np.empty(3000, np.float32)
            kv.pull(0, out=out)
            outs.append(out[0])
        return outs

    expected = [sum(r + step for r in range(3)) for step in range(5)]
    assert cluster.run(job) == [expected] * 3


def test_async_reaches_the_linear_sum_after_a_barrier(make_cluster):
    cluster = make_cluster(3, 2, chunk_bytes=SMALL_CHUNKS)
    shape = (3000,)

    def job(kv):
        kv.init(0, np.zeros(shape, np.float32))
        kv.set_optimizer(opt.SGD(learning_rate=1.0))
        for step in range(4):
            kv.push(0, grad(kv.rank, step, shape))
        kv.barrier()
        out = np.empty(shape, np.float32)
        kv.pull(0, out=out)
        return out

    expected = -sum(round_sum(3, s, shape, np.float64) for s in range(4)).astype(np.float32)
    for out in cluster.run(job, "dist_async"):
        np.testing.assert_array_equal(out, expected)


def test_async_without_optimizer_is_a_clear_error(make_cluster):
    cluster = make_cluster(1, 1)

    def job(kv):
        kv.init(0, np.zeros(3, np.float32))
        with pytest.raises(InvalidArgumentError, match="set_optimizer"):
            kv.push(0, np.ones(3, np.float32))
    cluster.run(job, "dist_async")


OPTIMIZERS = [
    opt.SGD(learning_rate=0.1),
    opt.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3, rescale_grad=0.5, clip_gradient=3.0),
    opt.SGD(learning_rate=0.05, momentum=0.9, nesterov=True,
            lr_scheduler=opt.FactorScheduler(step=2, factor=0.5)),
    opt.NAG(learning_rate=0.05, momentum=0.8, wd=1e-4),
    opt.Adam(learning_rate=0.01, wd=1e-4, lr_scheduler=opt.CosineScheduler(max_update=5)),
    opt.AdaGrad(learning_rate=0.1, lr_scheduler=opt.MultiFactorScheduler(step=[1, 3], factor=0.5)),
    opt.RMSProp(learning_rate=0.01),
    opt.RMSProp(learning_rate=0.01, centered=True),
]


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.to_config()["name"])
def test_dist_sync_equals_local_store_fed_all_pushes(make_cluster, optimizer, tmp_path):
    workers, steps = 3, 4
    keys, shapes = ["a", "b"], [(7, 5), (2500,)]
    init = [np.linspace(-1, 1, int(np.prod(s)), dtype=np.float32).reshape(s) for s in shapes]
    cluster = make_cluster(workers, 2, chunk_bytes=SMALL_CHUNKS)
    states_path = tmp_path / "dist.states"

    def job(kv):
        kv.init(keys, init)
        kv.set_optimizer(optimizer)
        for step in range(steps):
            kv.push(keys, [grad(kv.rank, step, s) / 4 for s in shapes])
        outs = [np.empty(s, np.float32) for s in shapes]
        kv.pull(keys, out=outs)
        kv.barrier()
        if kv.rank == 0:
            kv.save_optimizer_states(str(states_path))
        return outs

    results = cluster.run(job)
    with kvstore.create("local") as oracle:
        oracle.init(keys, init)
        oracle.set_optimizer(optimizer)
        for step in range(steps):
            oracle.push(keys, [[grad(r, step, s) / 4 for r in range(workers)] for s in shapes])
        expected = [np.empty(s, np.float32) for s in shapes]
        oracle.pull(keys, out=expected)
        oracle_states = tmp_path / "local.states"
        oracle.save_optimizer_states(str(oracle_states))
    for outs in results:
        for got, want in zip(outs, expected):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    from kvstore.worker import states_file
    _, dist_states = states_file.load(str(states_path))
    _, local_states = states_file.load(str(oracle_states))
    assert dist_states.keys() == local_states.keys()
    for key in keys:
        assert dist_states[key]["t"] == local_states[key]["t"] == steps
        for a, b in zip(dist_states[key]["state"], local_states[key]["state"]):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_optimizer_states_saved_in_dist_mode_resume_exactly(make_cluster, tmp_path):
    shape = (3000,)
    optimizer = opt.SGD(learning_rate=0.1, momentum=0.9)
    path = tmp_path / "states.bin"

    def first(kv):
        kv.init(0, np.ones(shape, np.float32))
        kv.set_optimizer(optimizer)
        for step in range(4):
            kv.push(0, grad(kv.rank, step, shape))
            if step == 1:
                kv.barrier()
                if kv.rank == 0:
                    kv.save_optimizer_states(str(path), dump_optimizer=True)
                w = np.empty(shape, np.float32)
                kv.pull(0, out=w)
                snapshot = w
        final = np.empty(shape, np.float32)
        kv.pull(0, out=final)
        return snapshot, final

    snapshot, final = make_cluster(2, 2, chunk_bytes=SMALL_CHUNKS).run(first)[0]

    def resumed(kv):
        kv.init(0, snapshot)
        kv.set_optimizer(optimizer)                # collective: fresh (empty) states
        if kv.rank == 0:
            kv.load_optimizer_states(str(path))   # one worker restores the saved states
        kv.barrier()
        for step in range(2, 4):
            kv.push(0, grad(kv.rank, step, shape))
        out = np.empty(shape, np.float32)
        kv.pull(0, out=out)
        return out

    cluster = make_cluster(2, 3, chunk_bytes=SMALL_CHUNKS)   # different server count: still exact
    for out in cluster.run(resumed):
        np.testing.assert_allclose(out, final, rtol=1e-6)


# ---- bad input in dist mode -------------------------------------------------------

def test_bad_inputs_fail_locally_and_change_nothing(make_cluster):
    cluster = make_cluster(2, 2)

    def job(kv):
        kv.init(1, np.ones(4, np.float32))
        with pytest.raises(InvalidArgumentError, match="not been initialised"):
            kv.push(2, np.ones(4, np.float32))
        with pytest.raises(InvalidArgumentError, match="already initialised"):
            kv.init(1, np.ones(4, np.float32))
        with pytest.raises(InvalidArgumentError, match="shape"):
            kv.push(1, np.ones(5, np.float32))
        with pytest.raises(InvalidArgumentError, match="dtype"):
            kv.pull(1, out=np.ones(4, np.float64))
        with pytest.raises(kvstore.ArgumentTypeError, match="mix"):
            kv.push("x", np.ones(4, np.float32))
        out = np.empty(4, np.float32)
        kv.pull(1, out=out)
        return out

    for out in cluster.run(job):
        np.testing.assert_array_equal(out, 1)


def test_a_push_that_fails_validation_sends_nothing_and_names_the_key(make_cluster):
    """Compression is checked for every key of a call before its first message goes
    out (keys on different servers: a message per server)."""
    cluster = make_cluster(1, 2)

    def job(kv):
        # placement: 'a' on server 0, 'c' and 'b' on server 1
        kv.init(["a", "c", "b"], [np.full(8, 5, np.float32), np.full(8, 6, np.float16),
                                  np.full(8, 7, np.int32)])
        sent = kv.comm_stats()["bytes_sent"]
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
        with pytest.raises(InvalidArgumentError, match="key 'b' holds int32.*nothing was sent"):
            kv.push(["a", "b"], [np.ones(8, np.float32), np.ones(8, np.int32)])
        with pytest.raises(InvalidArgumentError, match="key 'b' holds int32"):
            kv.pushpull(["a", "b"], [np.ones(8, np.float32), np.ones(8, np.int32)])
        kv.set_gradient_compression({"type": "2bit", "threshold": 1e5})
        with pytest.raises(InvalidArgumentError, match="key 'c': .*threshold 100000.* float16"):
            kv.push(["a", "c"], [np.ones(8, np.float32), np.ones(8, np.float16)])
        assert kv.comm_stats()["bytes_sent"] == sent                   # nothing went out
        kv.set_gradient_compression({"type": "none"})
        a = np.empty(8, np.float32)
        kv.pull("a", out=a)
        unchanged = a.copy()
        kv.push(["a", "b"], [np.full(8, 2, np.float32), np.full(8, 3, np.int32)])
        b = np.empty(8, np.int32)
        kv.pull(["a", "b"], out=[a, b])
        return unchanged, a, b

    (unchanged, a, b), = cluster.run(job)
    np.testing.assert_array_equal(unchanged, 5)        # no half-sent push was applied
    np.testing.assert_array_equal(a, 2)
    np.testing.assert_array_equal(b, 3)


def test_checkpoint_meta_takes_numpy_scalars_and_refuses_the_rest_on_every_worker(make_cluster, tmp_path):
    from kvstore.server import checkpoint
    cluster = make_cluster(2, 1, checkpoint_dir=str(tmp_path))

    def job(kv):
        kv.init("w", np.zeros(3, np.float32))
        with pytest.raises(InvalidArgumentError, match=r"meta\['bad'\] is a object"):
            kv.save_checkpoint({"epoch": 1, "bad": object()})
        kv.save_checkpoint({"epoch": np.int64(3), "loss": np.float32(0.5), "ok": np.bool_(True),
                            "steps": (np.int32(1), 2)})
        kv.push("w", np.ones(3, np.float32))      # the connection goes on
        out = np.empty(3, np.float32)
        kv.pull("w", out=out)
        return out

    for out in cluster.run(job):
        np.testing.assert_array_equal(out, 2)
    meta = checkpoint.load(checkpoint.path_for(str(tmp_path), 0))["meta"]
    assert meta == {"epoch": 3, "loss": 0.5, "ok": True, "steps": [1, 2]}


def test_workers_initialising_different_keys_get_an_error_not_a_hang(make_cluster):
    cluster = make_cluster(2, 1)

    def job(kv):
        with pytest.raises(InvalidArgumentError, match="disagree"):
            kv.init(kv.rank, np.zeros(3, np.float32))
    cluster.run(job)


def test_workers_with_different_shapes_get_an_error_naming_the_key_and_both_shapes(make_cluster):
    cluster = make_cluster(2, 1)

    def job(kv):
        with pytest.raises(InvalidArgumentError, match=re.escape(
                "workers disagree at a collective call (init): worker 1 differs from worker 0 at item 0 "
                "(of 1): worker 0 has key 0 (3,) float32, worker 1 has key 0 (4,) float32")):
            kv.init(0, np.zeros(3 + kv.rank, np.float32))
        kv.init(1, np.zeros(3, np.float32))      # the job goes on
    cluster.run(job)


def test_malformed_messages_get_error_replies_and_the_server_keeps_serving(make_cluster):
    cluster = make_cluster(1, 1)

    def job(kv):
        kv.init(0, np.full(3, 5, np.float32))
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(kv._client.servers[0])
        bad = [
            [b"\xc1garbage"],                                                     # not msgpack
            encode({"op": "push", "id": 7, "src": 0, "chunks": [[0, 0]]}, [])[:1],  # no buffer
            [encode({"op": "push", "id": 8, "src": 0, "chunks": [[0, 0]]},
                    [np.ones(3, np.float32)])[0], b"\x00" * 5],                  # truncated
            encode({"op": "pull", "id": 9, "src": 0, "chunks": [[0, 99]]}),      # unknown chunk
            encode({"op": "launch_missiles", "id": 10, "src": 0}),               # unknown op
            encode({"op": "push", "id": 11, "src": 0, "chunks": [[0, 0]]},
                   [np.ones(3, np.float64)]),                                   # wrong dtype
        ]
        replies = []
        for frames in bad:
            sock.send_multipart(frames)
            assert sock.poll(10_000), "no reply to a malformed message"
            replies.append(decode(sock.recv_multipart())[0])
        sock.close()
        ctx.term()
        out = np.empty(3, np.float32)
        kv.pull(0, out=out)            # the server still serves, value unchanged
        return replies, out

    replies, out = cluster.run(job)[0]
    assert all(r["op"] == "error" for r in replies)
    assert [r["id"] for r in replies[1:]] == [7, 8, 9, 10, 11]
    assert "key 0 (chunk 99)" in replies[3]["message"]
    np.testing.assert_array_equal(out, 5)


def test_server_side_rejection_surfaces_as_remote_error(make_cluster):
    """A request that passes local checks but the server refuses (here: forged)
    raises RemoteError naming the server at the next waiting call."""
    cluster = make_cluster(1, 1)

    def job(kv):
        kv.init(0, np.zeros(3, np.float32))
        kv._client.request(0, "pull", "forged pull", chunks=[[0, 5]])
        with pytest.raises(RemoteError, match="server 0.*chunk 5"):
            kv._client.flush("flush")
    cluster.run(job)


def test_messages_are_cut_per_server_limit_and_interleaved():
    from kvstore.sharding import pieces as _pieces
    parts = [np.zeros(n, np.uint8) for n in (4, 4, 4, 4, 4)]
    groups = {0: (list(range(5)), parts), 1: (list(range(5)), parts[:3])}
    # server 0 (say, tcp) cut at 8 bytes; server 1 (say, shared memory) uncut
    assert _pieces(groups, [8, 0]) == [(0, 0, 2), (1, 0, 3), (0, 2, 4), (0, 4, 5)]
    assert _pieces(groups, [100, 4]) == [(0, 0, 5), (1, 0, 1), (1, 1, 2), (1, 2, 3)]


def test_local_rank_and_size_group_the_workers_by_their_host(make_cluster):
    """kv.local_rank / kv.local_size: a worker's place among the workers registered
    from its host (KVSTORE_NODE_HOST), by rank, as torchrun's LOCAL_RANK."""
    import threading
    cluster = make_cluster(4, 1)
    seen = {}

    def work(rank):
        config = cluster.config("worker", rank).replace(node_host=f"127.0.0.{2 + rank % 2}")
        with kvstore.create("dist_sync", config=config) as kv:
            seen[rank] = (kv.local_rank, kv.local_size)
    threads = [threading.Thread(target=work, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert seen == {0: (0, 2), 1: (0, 2), 2: (1, 2), 3: (1, 2)}
    assert (kvstore.create("local").local_rank, kvstore.create("local").local_size) == (0, 1)
