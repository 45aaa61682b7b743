"""The model, data sizes and optimizer recipes of tests/scripts/twin_job.py, shared
with its test (which runs them in one process as the reference)."""

import torch

STEPS, BATCH = 8, 16


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def sgd(m, cycle_momentum=True, lr_scale=1.0):
    """SGD (nesterov momentum, weight decay) with OneCycleLR, which cycles the momentum."""
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)
    return opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5 * lr_scale, total_steps=STEPS,
                                                    cycle_momentum=cycle_momentum)


def adamw(m, cycle_momentum=True, lr_scale=1.0):
    """AdamW (amsgrad) over two param groups: no weight decay and another rate for biases."""
    decay = [p for p in m.parameters() if p.ndim > 1]
    no_decay = [p for p in m.parameters() if p.ndim == 1]
    opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3 * lr_scale}],
                            lr=1e-2 * lr_scale, weight_decay=0.05, amsgrad=True)
    return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)


RECIPES = {"sgd": sgd, "adamw": adamw}
