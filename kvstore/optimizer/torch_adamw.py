"""``torch_adamw``: the servers' twin of ``torch.optim.AdamW`` (torch's Adam with
decoupled weight decay, ``param *= 1 - lr * weight_decay`` before the step; default
weight_decay 0.01), per param group (kvstore.optimizer.torch_twin)."""

from __future__ import annotations

from .base import register
from .torch_adam import TorchAdam
from .torch_twin import BETAS, BOOL, NONNEG, TWIN_PARAMS

__all__ = ["TorchAdamW"]


@register
class TorchAdamW(TorchAdam):
    """``torch.optim.AdamW``'s update, bit for bit (state as :class:`TorchAdam`)."""

    name = "torch_adamw"
    torch_name = "AdamW"
    fields = {"lr": (1e-3, NONNEG), "betas": ([0.9, 0.999], BETAS), "eps": (1e-8, NONNEG),
              "weight_decay": (1e-2, NONNEG), "amsgrad": (False, BOOL), "maximize": (False, BOOL)}
    hyper_params = tuple(fields) + TWIN_PARAMS
    decoupled = True
