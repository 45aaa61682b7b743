"""A training loop that checkpoints the servers after step 3; with CRASH=1 and not
resumed, rank 0 kills server 1 after step 5. Prints a digest of the final weights.

    python resumable.py      (KVSTORE_CHECKPOINT_DIR must be set)
"""

import hashlib
import os
import signal

import numpy as np

import kvstore
from kvstore import optimizer as opt
from job_processes import server_pid  # tests/scripts/, this script's folder

STEPS = 8


kv = kvstore.create("dist_sync")
start = kv.resume_meta.get("step", 0)
print(f"resumed={kv.resumed} start={start}", flush=True)
kv.init(["w", "b"], [np.zeros(5000, np.float32), np.zeros(7, np.float32)])   # ignored when resumed
kv.init("emb", kvstore.RowInit("normal", 0.1, (1000, 4), seed=3))           # a row-sparse table, too
kv.set_optimizer(opt.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3))
w = np.empty(5000, np.float32)
for step in range(start, STEPS):
    g = np.sin(np.arange(5000, dtype=np.float32) * (kv.rank + 1) + step).astype(np.float32)
    kv.push(["w", "b"], [g, np.full(7, step, np.float32)])
    rows = (np.arange(20) * 37 + step * 11 + kv.rank) % 1000                 # lazy updates of 20 rows
    kv.push("emb", kvstore.RowSparse(np.full((20, 4), step + 1, np.float32), rows, (1000, 4)))
    kv.pull("w", out=w)
    if step == 3:
        kv.save_checkpoint({"step": 4})
    print(f"step {step} done", flush=True)
    if step == 5 and kv.rank == 0 and os.environ.get("CRASH") and not kv.resumed:
        os.kill(server_pid(1), signal.SIGKILL)
kv.pull("w", out=w)
emb = np.empty((1000, 4), np.float32)
kv.row_sparse_pull("emb", out=emb, row_ids=np.arange(1000))
print("digest", hashlib.sha256(w.tobytes() + emb.tobytes()).hexdigest(), flush=True)
kv.close()
