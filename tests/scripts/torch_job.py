"""A dist_sync job started by torch's launcher (torchrun) instead of ours: every
worker pushes rank + 1 for 5 steps and prints what it pulled, a digest of the
secret its store authenticates with, and the TCP addresses its process listens on
(rank 0 hosts the scheduler). With KILL_RANK=r, worker r kills itself (SIGKILL) at
step 2. With PEEK_STORE=1, rank 0 then connects to torchrun's own store as any
peer could (no credentials) and prints the keys it can read, and how many values
hold the job's secret.

    torchrun --standalone --nproc-per-node 2 tests/scripts/torch_job.py
"""

import hashlib
import os
import signal

import numpy as np

import kvstore
from listening import listening      # tests/scripts/, this script's folder
from shared_pipe import write_lines

kv = kvstore.create("dist_sync")
kv.init("w", np.zeros(1000, np.float32))
out = np.empty(1000, np.float32)
for step in range(5):
    if step == 2 and os.environ.get("KILL_RANK") == str(kv.rank):
        os.kill(os.getpid(), signal.SIGKILL)
    kv.push("w", np.full(1000, kv.rank + 1, np.float32))
    kv.pull("w", out=out)
secret = kv._config.secret       # what this worker's connections authenticate with (a test's peek)
digest = hashlib.sha256(secret.encode()).hexdigest()[:16] if secret else "none"
lines = [f"rank {kv.rank} of {kv.num_workers}: pulled {out[0]:g} {out[-1]:g}",
         f"rank {kv.rank} secret {digest}", f"rank {kv.rank} listens on {listening()}"]
if os.environ.get("PEEK_STORE") and kv.rank == 0:
    import datetime

    from torch.distributed import TCPStore
    peer = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                    timeout=datetime.timedelta(seconds=10))
    keys = sorted(peer.list_keys())
    values = [peer.get(key) if peer.check([key]) else b"" for key in keys]
    holding = sum(1 for v in values if secret and secret.encode() in v)
    lines += [f"store keys {keys}", f"store values holding the secret: {holding}"]
write_lines(lines)       # one write(2): under torchrun the workers share one pipe
kv.close()
