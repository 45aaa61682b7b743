"""``torch_adadelta``: the servers' twin of ``torch.optim.Adadelta``
(torch.optim.adadelta.adadelta, single-tensor): rho, eps, weight_decay, maximize,
per param group (kvstore.optimizer.torch_twin)."""

from __future__ import annotations

from .base import register
from .torch_twin import BOOL, CLOSED_UNIT, NONNEG, TWIN_PARAMS, TorchTwin, step_tensor

__all__ = ["TorchAdadelta"]


@register
class TorchAdadelta(TorchTwin):
    """``torch.optim.Adadelta``'s update, bit for bit. State: ``square_avg``,
    ``acc_delta``; ``step``."""

    name = "torch_adadelta"
    torch_name = "Adadelta"
    fields = {"lr": (1.0, NONNEG), "rho": (0.9, CLOSED_UNIT), "eps": (1e-6, NONNEG),
              "weight_decay": (0.0, NONNEG), "maximize": (False, BOOL)}
    hyper_params = tuple(fields) + TWIN_PARAMS
    state_names = ("square_avg", "acc_delta")

    @property
    def num_states(self):
        return 2

    def torch_step(self, torch, param, grad, states, t, group):
        from torch.optim.adadelta import adadelta
        adadelta([param], [grad], [states[0]], [states[1]], [step_tensor(torch, t)], capturable=False,
                 foreach=False, differentiable=False, lr=group["lr"], rho=group["rho"], eps=group["eps"],
                 weight_decay=group["weight_decay"], maximize=group["maximize"])
