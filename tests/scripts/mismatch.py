"""Workers whose models differ in one parameter (tests/launchers/test_launcher.py).

    python mismatch.py init      worker 0's key 6 is (11, 64), the others' (11, 32): kv.init of 10 keys
    python mismatch.py trainer   worker 1's model is narrower from its third layer on: kvstore.torch.Trainer
                                 over named_parameters()
    python mismatch.py trainer-flat   the same with flat_buckets=True
Each worker prints 'error: ' and the InvalidArgumentError it got, then exits 1.
"""

import sys

import numpy as np

import kvstore
from kvstore.errors import InvalidArgumentError

mode = sys.argv[1]
if mode.startswith("trainer"):   # imported before the job starts: a long import would delay heartbeats
    import torch

    from kvstore.torch import Trainer
kv = kvstore.create("dist_sync")
try:
    if mode == "init":
        shapes = [(16, 16), (16,)] * 3 + [(11, 64 if kv.rank == 0 else 32), (11,)] + [(5,)] * 2
        kv.init(list(range(10)), [np.zeros(s, np.float32) for s in shapes])
    else:
        width = 64 if kv.rank == 0 else 32
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, width),
                                    torch.nn.Linear(width, 11))
        Trainer(model.named_parameters(), kv, torch.optim.SGD(model.parameters(), lr=0.1),
                flat_buckets=mode == "trainer-flat")
except InvalidArgumentError as e:
    print(f"error: {e}", flush=True)
    raise
print("no error", flush=True)
