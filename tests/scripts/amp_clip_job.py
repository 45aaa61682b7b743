"""A 2-worker job that trains one small model with bfloat16 autocast, a
``torch.amp.GradScaler`` and global-norm clipping in several ways in one store, each
under its own keys:

- ``ddp``: DDP's loop with the workers updating (``scaler.unscale_(trainer)``,
  ``torch.nn.utils.clip_grad_norm_``, ``scaler.step(trainer)``);
- ``workers``: the Trainer's own options (``Trainer(..., clip_grad_norm=, grad_scaler=)``,
  ``trainer.step()``), workers updating;
- ``ddp-method``: DDP's loop with FSDP's ``trainer.clip_grad_norm_``, workers updating;
- ``ddp-noclip``: ``scaler.step(trainer)`` alone, workers updating;
- ``servers``: the Trainer's options with the servers updating (torch's AdamW twin
  there, which unscales, clips by the whole model's norm and skips an overflowed step);
- ``servers-ddp``: DDP's loop (``unscale_``, ``trainer.clip_grad_norm_``,
  ``scaler.step(trainer)``) with the servers updating (``Trainer(..., grad_scaler=)``);
- ``servers-noclip``: ``scaler.step(trainer)`` alone with the servers updating.

At step ``INF_STEP`` worker 1's loss is made inf: every run must skip that step on
every worker and back the scale off. Every rank saves its runs' weights, the scale
after every step and the norms ``clip_grad_norm_`` returned to ``OUT.<rank>``.

    python -m tracker.local -n 2 -s 2 python tests/scripts/amp_clip_job.py OUT
"""

import sys

import torch
import torch.nn.functional as F

import kvstore
import kvstore.torch as kvtorch
from amp_clip_job_settings import BATCH, INF_STEP, MAX_NORM, STEPS, model      # tests/scripts/, this script's folder


def train(kv, how):
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.05)
    scaler = torch.amp.GradScaler("cpu", growth_interval=3)
    servers = how.startswith("servers")
    options = {"clip_grad_norm": MAX_NORM, "grad_scaler": scaler} if how in ("workers", "servers") else \
        {"grad_scaler": scaler} if servers else {}
    trainer = kvtorch.Trainer([(f"{how}.{n}", p) for n, p in m.named_parameters()], kv, opt,
                              update_on_kvstore=servers, **options)
    g = torch.Generator().manual_seed(1)
    scales, norms = [], []
    for step in range(STEPS):
        x, y = torch.randn(BATCH, 10, generator=g), torch.randint(0, 4, (BATCH,), generator=g)
        mine = slice(kv.rank * BATCH // 2, (kv.rank + 1) * BATCH // 2)
        trainer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(m(x[mine]).float(), y[mine])
        if step == INF_STEP and kv.rank == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if how == "ddp":
            scaler.unscale_(trainer)
            norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM)))
            scaler.step(trainer)
        elif how in ("ddp-method", "servers-ddp"):
            scaler.unscale_(trainer)
            norms.append(float(trainer.clip_grad_norm_(MAX_NORM)))
            scaler.step(trainer)
        elif how.endswith("noclip"):
            scaler.step(trainer)
        else:
            trainer.step()
        scaler.update()
        scales.append(scaler.get_scale())
    return {"weights": [p.detach().clone() for p in m.parameters()], "scales": scales, "norms": norms}


kv = kvstore.create("dist_sync")
# the workers' runs first: no optimizer on the servers yet
results = {how: train(kv, how) for how in ("ddp", "workers", "ddp-method", "ddp-noclip",
                                           "servers", "servers-ddp", "servers-noclip")}
torch.save(results, f"{sys.argv[1]}.{kv.rank}")
print(f"rank {kv.rank} done", flush=True)
kv.close()
