"""``torch_adagrad``: the servers' twin of ``torch.optim.Adagrad``
(torch.optim.adagrad.adagrad, single-tensor, dense): lr_decay, weight_decay,
initial_accumulator_value, eps, maximize, per param group
(kvstore.optimizer.torch_twin)."""

from __future__ import annotations

from .base import register
from .torch_twin import BOOL, NONNEG, TWIN_PARAMS, TorchTwin, step_tensor

__all__ = ["TorchAdagrad"]


@register
class TorchAdagrad(TorchTwin):
    """``torch.optim.Adagrad``'s update, bit for bit. State: ``sum``, filled before a
    weight's first update with the top-level ``initial_accumulator_value``: torch's
    constructor fills every parameter's with its own argument, whatever a param
    group says (a group's value is kept in the group and never read); ``step``."""

    name = "torch_adagrad"
    torch_name = "Adagrad"
    fields = {"lr": (1e-2, NONNEG), "lr_decay": (0.0, NONNEG), "weight_decay": (0.0, NONNEG),
              "initial_accumulator_value": (0.0, NONNEG), "eps": (1e-10, NONNEG), "maximize": (False, BOOL)}
    hyper_params = tuple(fields) + TWIN_PARAMS
    state_names = ("sum",)

    @property
    def num_states(self):
        return 1

    def torch_step(self, torch, param, grad, states, t, group):
        from torch.optim.adagrad import adagrad
        if t == 1:
            states[0].fill_(self.initial_accumulator_value)   # torch: the constructor's, not the group's
        adagrad([param], [grad], [states[0]], [step_tensor(torch, t)], fused=False, foreach=False,
                differentiable=False, has_sparse_grad=False, lr=group["lr"], weight_decay=group["weight_decay"],
                lr_decay=group["lr_decay"], eps=group["eps"], maximize=group["maximize"])
