"""``torch_adam``: the servers' twin of ``torch.optim.Adam`` (torch.optim.adam.adam,
single-tensor): betas, eps, weight_decay (added to the gradient), amsgrad,
maximize, per param group (kvstore.optimizer.torch_twin)."""

from __future__ import annotations

from typing import ClassVar

from .base import register
from .torch_twin import BETAS, BOOL, NONNEG, TWIN_PARAMS, TorchTwin, step_tensor

__all__ = ["TorchAdam"]


@register
class TorchAdam(TorchTwin):
    """``torch.optim.Adam``'s update, bit for bit. State: ``exp_avg``,
    ``exp_avg_sq`` and, when a group has amsgrad, ``max_exp_avg_sq``; ``step``."""

    name = "torch_adam"
    torch_name = "Adam"
    fields = {"lr": (1e-3, NONNEG), "betas": ([0.9, 0.999], BETAS), "eps": (1e-8, NONNEG),
              "weight_decay": (0.0, NONNEG), "amsgrad": (False, BOOL), "maximize": (False, BOOL)}
    hyper_params = tuple(fields) + TWIN_PARAMS
    state_names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    #: AdamW's decoupled weight decay (torch's Adam(decoupled_weight_decay=True))
    decoupled: ClassVar[bool] = False

    @property
    def num_states(self):
        return 3 if any(g["amsgrad"] for g in self.groups) else 2

    def used_states(self, group):
        return self.state_names if group["amsgrad"] else self.state_names[:2]

    def torch_step(self, torch, param, grad, states, t, group):
        from torch.optim.adam import adam
        beta1, beta2 = group["betas"]
        adam([param], [grad], [states[0]], [states[1]], [states[2]] if group["amsgrad"] else [],
             [step_tensor(torch, t)], foreach=False, fused=False, capturable=False, differentiable=False,
             decoupled_weight_decay=self.decoupled, amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2,
             lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])
