"""kvstore.torch.Trainer with the servers updating (torch.optim.Adam's twin) on
replicated servers (KVSTORE_REPLICAS=1): every worker takes ``trainer.state_dict()``
after step 3 and loads it back (``load_state_dict``: a new optimizer on the servers
and the states sent to them) after step 6, so the servers' Adam moments and step
counts are no longer those their rounds made. With KILL=R:S worker 0 sends server R
SIGKILL right after its ``trainer.step()`` of step S. Prints a digest of the final
weights.

    python -m tracker.local -n 2 -s 3 python replicated_trainer.py     (KVSTORE_REPLICAS=1)
"""

import hashlib
import os
import signal

import torch
import torch.nn.functional as F

import kvstore
import kvstore.torch as kvtorch
from job_processes import server_pid
from replicated import kills_by_step      # tests/scripts/, this script's folder

STEPS = 10


def main() -> None:
    kills = kills_by_step()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 48), torch.nn.Tanh(), torch.nn.Linear(48, 5))
    kv = kvstore.create("dist_sync")
    trainer = kvtorch.Trainer(model.named_parameters(), kv, torch.optim.Adam(model.parameters(), lr=0.01),
                              update_on_kvstore=True)
    g = torch.Generator().manual_seed(1)
    saved = None
    for step in range(STEPS):
        x, y = torch.randn(8, 40, generator=g), torch.randint(0, 5, (8,), generator=g)
        mine = slice(kv.rank * 4, (kv.rank + 1) * 4)
        trainer.zero_grad()
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        trainer.step()
        if kv.rank == 0:
            for server in kills.get(step, ()):
                os.kill(server_pid(server), signal.SIGKILL)
                print(f"killed server {server} at step {step}", flush=True)
        if step == 3:
            saved = trainer.state_dict()
        if step == 6:
            assert saved is not None
            trainer.load_state_dict(saved)
    weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    print("digest", hashlib.sha256(weights).hexdigest(), flush=True)
    kv.close()


if __name__ == "__main__":
    main()
