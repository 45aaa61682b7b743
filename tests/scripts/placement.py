"""A worker script for the dedicated-server-host tests (--server-hosts): checks
the sums of a few rounds, then worker 0 reports where every process of the job
was started.

    python placement.py
Prints ``sums ok rank R`` on every worker, then on worker 0 one line per process
of the job (same KVSTORE_TEST_TAG): ``placed ROLE RANK ADDRESS``, ADDRESS being
the local end of the ssh connection that started the process (SSH_CONNECTION,
inherited through the node wrapper or Open MPI's daemon). The test hosts are
loopback addresses, so every process of the job is visible in /proc here; the
final barrier keeps them alive until worker 0 has looked.
"""

import os

import numpy as np

import kvstore

kv = kvstore.create("dist_sync")
W, r, n = kv.num_workers, kv.rank, 1 << 20    # 4 MB: chunks on every server
kv.init([0, 1], [np.zeros(n, np.float32), np.zeros(7, np.float32)])
for step in range(3):
    outs = [np.empty(n, np.float32), np.empty(7, np.float32)]
    kv.pushpull([0, 1], [np.full(n, (r + 1) * (step + 1), np.float32),
                         np.full(7, r + step, np.float32)], out=outs)
    assert (outs[0] == W * (W + 1) // 2 * (step + 1)).all(), outs[0][:4]
    assert (outs[1] == W * (W - 1) // 2 + W * step).all(), outs[1]
print("sums ok rank", r, flush=True)
if r == 0:
    tag = os.environ["KVSTORE_TEST_TAG"].encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.partition(b"=")[::2] for item in f.read().split(b"\0") if item)
        except OSError:
            continue
        if env.get(b"KVSTORE_TEST_TAG") == tag and env.get(b"KVSTORE_ROLE") in (b"server", b"worker"):
            where = env.get(b"SSH_CONNECTION", b"- - local").split()[2].decode()
            print("placed", env[b"KVSTORE_ROLE"].decode(), env[b"KVSTORE_RANK"].decode(), where,
                  flush=True)
kv.barrier()
kv.close()
