"""Summing on the host before pushing (KVSTORE_HOST_REDUCE=1, kvstore.hostgroup.group):
the server's rounds for a push that speaks for several workers, the scheduler's
address book of workers, and whole jobs on emulated hosts (tracker.local
--emulate-hosts: one machine split into K hosts by KVSTORE_HOST_LABEL)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from kvstore.protocol import ops
from state_driver import A, Server, by_id, expect_error, expect_ok, only, peer, sgd, vec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- the server: a push for a group -------------------------------------------------------------
def test_a_group_push_counts_every_worker_it_speaks_for():
    s = Server(num_workers=3, init={A: vec(0, 0)})
    r0, rep = s.send(0, ops.PUSHPULL, [A], [vec(1, 2)], group=[0, 2])     # host 0: workers 0 and 2
    assert rep == []                                                      # worker 1 is still due
    r1, rep = s.send(1, ops.PUSHPULL, [A], [vec(10, 20)])
    replies = by_id(rep)
    np.testing.assert_array_equal(expect_ok(replies[r0], peer(0), nvalues=1).arrays[0], vec(11, 22))
    np.testing.assert_array_equal(expect_ok(replies[r1], peer(1), nvalues=1).arrays[0], vec(11, 22))


def test_a_group_push_takes_the_next_round_when_one_of_its_workers_is_in_the_open_one():
    s = Server(num_workers=3, opt=sgd(), init={A: vec(0)})
    s.push(2, {A: vec(1)})                           # worker 2 alone, round 1
    rid, rep = s.send(0, ops.PUSHPULL, [A], [vec(5)], group=[0, 2])       # round 2 (2 is in round 1)
    assert rep == []
    _, rep = s.push(1, {A: vec(100)})                # completes round 1 (1 + 100 ... but 0 is missing)
    assert rep == [] or all(r.header["id"] != rid for r in rep)
    _, rep = s.push(0, {A: vec(1000)})               # round 1 complete: 1 + 100 + 1000
    _, rep2 = s.push(1, {A: vec(7)})                 # round 2 complete: 5 + 7
    replies = by_id(rep + rep2)
    np.testing.assert_allclose(expect_ok(replies[rid], peer(0), nvalues=1).arrays[0], vec(-1101 - 12))


@pytest.mark.parametrize("group, fragment", [
    ([2, 0], "sorted, distinct"), ([0, 0, 2], "sorted, distinct"), ([1, 2], "including its sender 0"),
    ([0, 3], "(0..2)"), ("0,2", "sorted, distinct"), ([0, True], "sorted, distinct"), ([], "sorted"),
])
def test_a_malformed_group_is_refused_and_changes_nothing(group, fragment):
    s = Server(num_workers=3, init={A: vec(0)})
    rid, rep = s.send(0, ops.PUSHPULL, [A], [vec(9)], group=group)
    expect_error(only(rep), peer(0), rid, "ProtocolError", fragment)
    for w in range(3):                                # the round is untouched
        _, rep = s.push(w, {A: vec(1)})
    assert s.value(A)[0] == 3


def test_a_group_push_is_refused_outside_dist_sync():
    s = Server(mode="async", num_workers=2, opt=sgd(), init={A: vec(0)})
    rid, rep = s.send(0, ops.PUSHPULL, [A], [vec(9)], group=[0, 1])
    expect_error(only(rep), peer(0), rid, "InvalidArgumentError", "dist_sync only")
    assert s.value(A)[0] == 0


# -- whole jobs on emulated hosts ---------------------------------------------------------------
SUMS = textwrap.dedent("""
    import os, sys, numpy as np, kvstore
    kv = kvstore.create(sys.argv[1])
    n = 300_000                                    # 64 KiB chunks: every server holds some
    kv.init(1, np.zeros(n, np.float32)); kv.init(2, np.zeros((3, 4), np.float64))
    out, small = np.empty(n, np.float32), np.empty((3, 4))
    for it in range(6):                            # overlapping calls, waited out of order
        h = kv.pushpull_async(1, np.full(n, kv.rank + 1 + it, np.float32), out=out)
        h2 = kv.pushpull_async(2, np.full((3, 4), float(kv.rank * it)))
        kv.pushpull(2, np.full((3, 4), 1.0), out=small)
        h2.wait(); h.wait()
    W = kv.num_workers
    kv.barrier()
    print("RANK", kv.rank, "GROUP", ",".join(map(str, kv.host_group)) or "-",
          "SUM", bool((out == sum(r + 6 for r in range(W))).all()), bool((small == W).all()),
          "SENT", kv.comm_stats()["bytes_sent"], "HOST", kv.comm_stats().get("host_bytes_sent", 0), flush=True)
    kv.close()
""")


def run_job(tmp_path, script, *args, workers=4, hosts=2, env=(), timeout=120, args_after=()):
    path = tmp_path / "job.py"
    path.write_text(script)
    environ = {**os.environ, "PYTHONPATH": ROOT, "KVSTORE_TIMEOUT": "30", "KVSTORE_CHUNK_BYTES": "65536",
               "KVSTORE_HOST_REDUCE": "1", **dict(env)}
    start = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "tracker.local", "-n", str(workers), "-s", "2",
                        "--emulate-hosts", str(hosts), *args, sys.executable, str(path), *args_after],
                       env=environ, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return p, time.monotonic() - start


def lines(p, tag="RANK"):
    return sorted(line.split(tag + " ", 1)[1].split() for line in p.stdout.splitlines() if tag + " " in line)


@pytest.mark.slow
@pytest.mark.parametrize("store", ["dist_sync", "dist_device_sync"])
def test_each_host_pushes_one_sum_and_every_worker_gets_the_total(tmp_path, store):
    p, _ = run_job(tmp_path, SUMS, args_after=(store,))
    assert p.returncode == 0, p.stdout + p.stderr
    got = lines(p)
    assert [g[:6] for g in got] == [["0", "GROUP", "0,2", "SUM", "True", "True"],
                                    ["1", "GROUP", "1,3", "SUM", "True", "True"],
                                    ["2", "GROUP", "0,2", "SUM", "True", "True"],
                                    ["3", "GROUP", "1,3", "SUM", "True", "True"]], p.stdout + p.stderr
    sent = {int(g[0]): int(g[7]) for g in got}
    to_leader = {int(g[0]): int(g[9]) for g in got}
    gradients = 6 * 300_000 * 4
    # the leaders push the host's sums; the members send the servers (almost) nothing:
    # their gradients go to their leader
    assert sent[0] > gradients and sent[1] > gradients, sent
    assert sent[2] < 10_000 and sent[3] < 10_000, sent
    assert to_leader[2] > gradients and to_leader[3] > gradients, to_leader


@pytest.mark.slow
def test_host_groups_work_with_curve_encryption(tmp_path):
    p, _ = run_job(tmp_path, SUMS, env={"KVSTORE_SECURE": "1"}, args_after=("dist_sync",))
    assert p.returncode == 0, p.stdout + p.stderr
    assert [g[2:6] for g in lines(p)] == [["0,2", "SUM", "True", "True"], ["1,3", "SUM", "True", "True"],
                                          ["0,2", "SUM", "True", "True"], ["1,3", "SUM", "True", "True"]]


@pytest.mark.slow
def test_a_worker_alone_on_its_host_pushes_directly_beside_a_group(tmp_path):
    p, _ = run_job(tmp_path, SUMS, workers=3, args_after=("dist_sync",))
    assert p.returncode == 0, p.stdout + p.stderr
    assert [g[:6] for g in lines(p)] == [["0", "GROUP", "0,2", "SUM", "True", "True"],
                                         ["1", "GROUP", "-", "SUM", "True", "True"],
                                         ["2", "GROUP", "0,2", "SUM", "True", "True"]], p.stdout + p.stderr


TRAIN = textwrap.dedent("""
    import numpy as np, kvstore
    from kvstore import optimizer
    kv = kvstore.create("dist_sync")
    kv.set_optimizer(optimizer.Adam(learning_rate=0.01))
    shapes = {0: (50, 40), 1: (40,), 2: (4000, 10)}
    for k, shape in shapes.items():
        kv.init(k, np.zeros(shape, np.float32))
    outs = {k: np.empty(shape, np.float32) for k, shape in shapes.items()}
    rng = np.random.default_rng(kv.rank)
    for step in range(5):
        grads = {k: rng.standard_normal(shape).astype(np.float32) for k, shape in shapes.items()}
        kv.pushpull(list(grads), list(grads.values()), out=[outs[k] for k in grads])
    kv.barrier()
    print("RANK", kv.rank, "DIGEST", " ".join(f"{float(np.abs(o).sum()):.6e}" for o in outs.values()), flush=True)
    kv.close()
""")


@pytest.mark.slow
def test_server_side_adam_gives_the_same_weights_with_and_without_summing_on_the_host(tmp_path):
    grouped, _ = run_job(tmp_path, TRAIN)
    direct, _ = run_job(tmp_path, TRAIN, env={"KVSTORE_HOST_REDUCE": "0"})
    assert grouped.returncode == 0 and direct.returncode == 0, grouped.stdout + grouped.stderr + direct.stderr
    a, b = lines(grouped, "DIGEST"), lines(direct, "DIGEST")
    assert len(a) == 4 and len({tuple(x) for x in a}) == 1, a    # every worker pulled the same
    # float32 sums in another order: equal to rounding
    np.testing.assert_allclose(np.array(a[0], float), np.array(b[0], float), rtol=1e-5)


MISMATCH = textwrap.dedent("""
    import numpy as np, kvstore
    kv = kvstore.create("dist_sync")
    kv.init(1, np.zeros(1000, np.float32)); kv.init(2, np.zeros(1000, np.float32))
    key = 2 if kv.rank == 1 else 1                 # worker 1 (the member) pushes another key
    try:
        kv.pushpull(key, np.ones(1000, np.float32), out=np.empty(1000, np.float32))
        print("RANK", kv.rank, "NO-ERROR", flush=True)
    except kvstore.InvalidArgumentError as e:
        print("RANK", kv.rank, "ERROR", str(e).replace(" ", "_"), flush=True)
    kv.barrier()
    out = np.empty(1000, np.float32)
    kv.pull(1, out=out)
    print("VALUE", kv.rank, float(out[0]), flush=True)
    kv.close()
""")


@pytest.mark.slow
def test_members_that_disagree_all_get_an_error_naming_the_member_and_nothing_changes(tmp_path):
    p, _ = run_job(tmp_path, MISMATCH, workers=2, hosts=1, env={"KVSTORE_TIMEOUT": "20"})
    assert p.returncode == 0, p.stdout + p.stderr
    got = lines(p)
    assert [g[:2] for g in got] == [["0", "ERROR"], ["1", "ERROR"]], got
    for g in got:
        assert "worker_1_(on_this_host)_made_a_different_call" in g[2] and "nothing_was_sent" in g[2], g
    assert lines(p, "VALUE") == [["0", "0.0"], ["1", "0.0"]]       # the key was not changed


DIES = textwrap.dedent("""
    import os, sys, numpy as np, kvstore
    kv = kvstore.create("dist_sync")
    kv.init(1, np.zeros(1000, np.float32))
    kv.barrier()
    if kv.rank == int(sys.argv[1]):
        os._exit(3)                                # before its part of the host's sum
    kv.pushpull(1, np.ones(1000, np.float32))
    print("FINISHED", kv.rank, flush=True)
""")


@pytest.mark.slow
@pytest.mark.parametrize("who", [0, 1], ids=["leader", "member"])
def test_a_dead_worker_of_a_host_group_ends_the_job_fast_naming_it(tmp_path, who):
    p, took = run_job(tmp_path, DIES, workers=2, hosts=1, env={"KVSTORE_TIMEOUT": "120"},
                      args_after=(str(who),))
    assert p.returncode != 0 and "FINISHED" not in p.stdout, p.stdout + p.stderr
    assert re.search(rf"worker {who} +\d+ +exited with status 3 +<- root cause", p.stderr), p.stderr
    assert took < 60, took          # not the 120 s deadline


TRAINER = textwrap.dedent("""
    import sys, torch, kvstore, kvstore.torch
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    def batches(rank):
        g = torch.Generator().manual_seed(100 + rank)
        return [(torch.randn(16, 20, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(4)]
    kv = kvstore.create("dist_sync")
    model, opt = build()
    trainer = kvstore.torch.Trainer(model.parameters(), kv, opt, update_on_kvstore=False,
                                    bucket_bytes=4096)           # several buckets, in flight together
    for x, y in batches(kv.rank):
        trainer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        trainer.step()
    # one process on the workers' batches together: what W workers must train like
    ref, ref_opt = build()
    for step in zip(*(batches(r) for r in range(kv.num_workers))):
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(torch.cat([x for x, _ in step])), torch.cat([y for _, y in step])).backward()
        ref_opt.step()
    diff = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
    print("RANK", kv.rank, "GROUP", ",".join(map(str, kv.host_group)) or "-", "DIFF", f"{diff:.2e}", flush=True)
    kv.close()
""")


@pytest.mark.slow
def test_the_torch_trainer_on_host_groups_trains_like_one_process_on_all_batches(tmp_path):
    pytest.importorskip("torch")
    p, _ = run_job(tmp_path, TRAINER)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    got = lines(p)
    assert [x[2] for x in got] == ["0,2", "1,3", "0,2", "1,3"], got
    assert all(float(x[4]) < 1e-5 for x in got), got


LAST = textwrap.dedent("""
    import numpy as np, kvstore
    kv = kvstore.create("dist_sync")
    n = 25_000_000                                 # 100 MB: the leader's last result is still queued...
    kv.init(1, np.zeros(n, np.float32))
    out = np.empty(n, np.float32)
    kv.pushpull(1, np.ones(n, np.float32), out=out)
    kv.close()                                     # ...when it closes, without a barrier
    print("RANK", kv.rank, "CLOSED", bool((out == kv.num_workers).all()), flush=True)
""")


@pytest.mark.slow
def test_the_leader_closes_only_once_its_members_have_their_last_results(tmp_path):
    p, _ = run_job(tmp_path, LAST, workers=3, hosts=1, env={"KVSTORE_CHUNK_BYTES": str(4 << 20)})
    assert p.returncode == 0, p.stdout + p.stderr
    assert lines(p) == [[str(r), "CLOSED", "True"] for r in range(3)], p.stdout + p.stderr


GPU_SUMS = textwrap.dedent("""
    import torch, kvstore
    kv = kvstore.create("dist_device_sync")
    n = 300_000
    kv.init(1, torch.zeros(n, device="cuda"))
    out = torch.empty(n, device="cuda")
    for it in range(4):
        h = kv.pushpull_async(1, torch.full((n,), float(kv.rank + 1 + it), device="cuda"), out=out)
        h.wait()
    W = kv.num_workers
    kv.barrier()
    ok = bool((out == sum(r + 4 for r in range(W))).all().item())
    print("RANK", kv.rank, "GROUP", ",".join(map(str, kv.host_group)) or "-", "SUM", ok,
          "SENT", kv.comm_stats()["bytes_sent"], "DEVICE", kv._exchange.host.on_device, flush=True)
    kv.close()
""")


@pytest.mark.gpu
@pytest.mark.slow
def test_host_groups_with_cuda_tensors_and_gpu_servers(tmp_path):
    """Processes sharing one GPU stand for one process per GPU (torchrun's layout)."""
    from kvstore.devices import gpu
    if not gpu.available():
        pytest.skip(f"needs a usable GPU with CuPy: {gpu.reason()}")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip(f"needs torch with CUDA; this torch is {torch.__version__}")
    p, _ = run_job(tmp_path, GPU_SUMS, "--server-device", "gpu", timeout=300,
                   env={"PYTHONPATH": os.pathsep.join(x for x in (ROOT, os.environ.get("PYTHONPATH")) if x)})
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    got = lines(p)
    assert [g[:5] for g in got] == [["0", "GROUP", "0,2", "SUM", "True"], ["1", "GROUP", "1,3", "SUM", "True"],
                                    ["2", "GROUP", "0,2", "SUM", "True"], ["3", "GROUP", "1,3", "SUM", "True"]], got
    assert int(got[2][6]) < 10_000 and int(got[3][6]) < 10_000, got     # the members pushed nothing
    # the groups summed on the GPU from the members' device memory (CUDA IPC), not the host
    assert [g[8] for g in got] == ["True"] * 4, got
