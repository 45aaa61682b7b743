"""A worker script for multi-process tests: checks pulled values against formulas.

    python formulas.py --keys int|str [--store dist_sync|dist_async]
Exit status 0 when every check holds; an AssertionError (status 1) otherwise.
"""

import argparse

import numpy as np

import kvstore
from kvstore import optimizer as opt

parser = argparse.ArgumentParser()
parser.add_argument("--keys", choices=["int", "str"], default="int")
parser.add_argument("--store", default="dist_sync")
args = parser.parse_args()


def grad(rank, step, shape):
    base = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) % 5
    return (base + (rank + 1) * (step + 1)).astype(np.float32)


kv = kvstore.create(args.store)
W, r = kv.num_workers, kv.rank
keys = [7, (1 << 40) + 3, -2] if args.keys == "int" else ["fc.weight", "fc.bias", "big"]
shapes = [(5, 6), (3,), (1200, 1200)]
total = lambda step, shape: sum(grad(w, step, shape).astype(np.float64) for w in range(W))

if args.store == "dist_sync":
    kv.init(keys, [np.zeros(s, np.float32) for s in shapes])
    for step in range(2):                       # no optimizer: the round's sum is assigned
        kv.push(keys, [[grad(r, step, s) / 2, grad(r, step, s) / 2] for s in shapes])
        outs = [np.empty(s, np.float32) for s in shapes]
        kv.pull(keys, out=outs)
        for out, s in zip(outs, shapes):
            np.testing.assert_array_equal(out, total(step, s).astype(np.float32))
    g = grad(r, 5, (5, 6))
    kv.pushpull(keys[0], g)                     # out=None: written back into g
    np.testing.assert_array_equal(g, total(5, (5, 6)).astype(np.float32))

sgd_key = 100 if args.keys == "int" else "sgd"
kv.init(sgd_key, np.ones((1200, 1200), np.float32))
kv.set_optimizer(opt.SGD(learning_rate=1.0))
for step in range(3):
    kv.push(sgd_key, grad(r, step, (1200, 1200)))
kv.barrier()
out = np.empty((1200, 1200), np.float32)
kv.pull(sgd_key, out=out)
expected = 1 - sum(total(step, (1200, 1200)) for step in range(3))
np.testing.assert_allclose(out, expected.astype(np.float32), rtol=1e-6)

b = np.empty(4, np.float32)
kv.broadcast("bcast" if args.keys == "str" else 555, np.full(4, r + 10, np.float32), out=b)
np.testing.assert_array_equal(b, 10)
print(f"OK rank {r} of {W}", flush=True)
kv.close()
