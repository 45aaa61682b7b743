"""A worker script for the GPU test of the cuda_ipc transport (tests/server/test_gpu_server.py):
dist_device_sync with cupy arrays, run by tracker.local with GPU servers, so that
workers and servers are separate processes sharing one GPU through CUDA IPC.

    python -m tracker.local -n 2 -s 2 --server-device gpu python tests/scripts/cuda_ipc_job.py

Also pushpulls from ``kv.empty(..., device=0)`` memory and trains a small model with
``Trainer(flat_buckets=True)``, both of which the servers read in place (no slot).
Prints ``[worker:R] weights=...`` (the same on every worker) and ``[worker:R]
transports=... ok`` once every check held (an AssertionError, exit status 1,
otherwise)."""

import cupy as cp
import numpy as np

import kvstore
from kvstore import optimizer as opt


def grad(rank, step, shape):
    """Small multiples of 1/4: float32 sums are exact in any order."""
    n = int(np.prod(shape))
    return ((np.arange(n) % 13 - 6 + rank * 3 + step) / 4.0).astype(np.float32).reshape(shape)


kv = kvstore.create("dist_device_sync")
W, r = kv.num_workers, kv.rank
shapes = {"w": (512, 1000), "b": (10,), "big": (3_000_000,)}
keys = list(shapes)
total = lambda step, shape: sum(grad(w, step, shape) for w in range(W))   # noqa: E731

kv.init(keys, [cp.zeros(s, cp.float32) for s in shapes.values()])
for step in range(3):
    outs = [cp.empty(s, cp.float32) for s in shapes.values()]
    # two "devices" per worker (the same GPU twice): summed on the GPU first
    kv.pushpull(keys, [[cp.asarray(grad(r, step, s)), cp.asarray(grad(r, step, s))] for s in shapes.values()],
                out=outs)
    for out, s in zip(outs, shapes.values()):
        np.testing.assert_array_equal(cp.asnumpy(out), 2 * total(step, s))

kv.init("sgd", cp.ones(shapes["big"], cp.float32))
kv.set_optimizer(opt.SGD(learning_rate=0.5))
for step in range(3):
    kv.push("sgd", cp.asarray(grad(r, step, shapes["big"])))
out = cp.empty(shapes["big"], cp.float32)
kv.pull("sgd", out=out)
want = 1 - 0.5 * sum(total(step, shapes["big"]).astype(np.float64) for step in range(3))
np.testing.assert_allclose(cp.asnumpy(out), want.astype(np.float32), rtol=1e-6)

def slotted():
    """The chunk keys this worker's cuda_ipc links copied values into slots for."""
    return {key for link in kv._client.links if hasattr(link, "_device_slots") for key in link._device_slots._slots}


# kv.empty(..., device=0): read by the servers in place (kvstore/devices/arena.py), no slot
kv.init("lent", cp.zeros(shapes["big"], cp.float32))
lent = kv.empty(shapes["big"], np.float32, device=0)
before = slotted()
for step in range(3):
    lent[...] = cp.asarray(grad(r, step, shapes["big"]))
    out = cp.empty(shapes["big"], cp.float32)
    kv.pushpull("lent", lent, out=out)
    np.testing.assert_array_equal(cp.asnumpy(out), total(step, shapes["big"]))
assert not {key for key in slotted() - before if "lent" in str(key)}, slotted() - before

# the Trainer's flat buckets: gradient buffers from kv.empty(..., device=0), no slot either
import torch  # noqa: E402
import kvstore.torch as kvtorch  # noqa: E402

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).cuda()
trainer = kvtorch.Trainer(model.parameters(), kv, opt.SGD(learning_rate=0.1), flat_buckets=True,
                          bucket_bytes=4096)
before = slotted()
gen = torch.Generator(device="cuda").manual_seed(r)
for step in range(3):
    x = torch.randn(16, 64, device="cuda", generator=gen)
    trainer.zero_grad()
    model(x).square().mean().backward()
    trainer.step()
assert slotted() == before, slotted() - before
checksum = float(sum(p.double().sum() for p in model.parameters()))
print(f"[worker:{r}] weights={checksum:.9e}", flush=True)

transports = sorted(kv.comm_stats()["by_transport"])
print(f"[worker:{r}] transports={','.join(transports)} ok", flush=True)
kv.close()
