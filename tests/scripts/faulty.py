"""A worker script that misbehaves on request, for failure tests.

    python faulty.py exit|sigkill|loop
exit: rank 1 exits with status 3 after init; sigkill: rank 1 kills itself;
loop: every worker prints 'ready' and pushes/pulls until stopped.
"""

import os
import signal
import sys

import numpy as np

import kvstore

mode = sys.argv[1]
kv = kvstore.create("dist_sync")
kv.init(0, np.zeros(1000, np.float32))
print(f"ready rank {kv.rank}", flush=True)
if kv.rank == 1 and mode == "exit":
    sys.exit(3)
if kv.rank == 1 and mode == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
out = np.empty(1000, np.float32)
for _ in range(10_000_000):
    kv.push(0, np.ones(1000, np.float32))
    kv.pull(0, out=out)
