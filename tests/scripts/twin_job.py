"""A 2-worker job that trains one small model four ways in one store, each under its
own keys (named parameters with a prefix): SGD (momentum, nesterov, weight decay)
with OneCycleLR cycling the momentum, and AdamW with two param groups (no decay
and another rate for biases), each with the workers updating (a torch optimizer on
the averaged gradients, as DDP) and then with the servers updating (torch's twin on
the servers). The workers' runs come first: they need a store without an optimizer.
Rank 0 saves every run's weights and ``trainer.state_dict()``, and the servers' runs'
``state_dict()`` loaded back (``load_state_dict``) and read again, to OUT.

    python -m tracker.local -n 2 -s 2 python tests/scripts/twin_job.py OUT
"""

import sys

import torch
import torch.nn.functional as F

import kvstore
import kvstore.torch as kvtorch
from twin_job_recipes import BATCH, RECIPES, STEPS, model      # tests/scripts/, this script's folder


def train(kv, name, servers):
    m = model()
    opt, sched = RECIPES[name](m)
    prefix = f"{name}.{'servers' if servers else 'workers'}."
    trainer = kvtorch.Trainer([(prefix + n, p) for n, p in m.named_parameters()], kv, opt,
                              update_on_kvstore=servers)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x, y = torch.randn(BATCH, 10, generator=g), torch.randint(0, 4, (BATCH,), generator=g)
        mine = slice(kv.rank * BATCH // 2, (kv.rank + 1) * BATCH // 2)
        trainer.zero_grad()
        F.cross_entropy(m(x[mine]), y[mine]).backward()
        trainer.step()
        sched.step()
    out = {"weights": [p.detach().clone() for p in m.parameters()], "state": trainer.state_dict()}
    if servers:
        trainer.load_state_dict(out["state"])
        out["reloaded"] = trainer.state_dict()
    return out


kv = kvstore.create("dist_sync")
results = {}
for servers in (False, True):
    for name in RECIPES:
        results[f"{name}-{'servers' if servers else 'workers'}"] = train(kv, name, servers)
if kv.rank == 0:
    torch.save(results, sys.argv[1])
print(f"rank {kv.rank} done", flush=True)
kv.close()
