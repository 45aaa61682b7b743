"""A dist_sync job started by torch's launcher (torchrun) instead of ours: every
worker pushes rank + 1 for 5 steps and prints what it pulled. With KILL_RANK=r,
worker r kills itself (SIGKILL) at step 2.

    torchrun --standalone --nproc-per-node 2 tests/scripts/torch_job.py
"""

import os
import signal

import numpy as np

import kvstore

kv = kvstore.create("dist_sync")
kv.init("w", np.zeros(1000, np.float32))
out = np.empty(1000, np.float32)
for step in range(5):
    if step == 2 and os.environ.get("KILL_RANK") == str(kv.rank):
        os.kill(os.getpid(), signal.SIGKILL)
    kv.push("w", np.full(1000, kv.rank + 1, np.float32))
    kv.pull("w", out=out)
print(f"rank {kv.rank} of {kv.num_workers}: pulled {out[0]:g} {out[-1]:g}", flush=True)
kv.close()
