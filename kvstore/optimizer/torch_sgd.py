"""``torch_sgd``: the servers' twin of ``torch.optim.SGD`` (torch.optim.sgd.sgd,
single-tensor): momentum (a first step's buffer is the gradient, as torch's),
dampening, nesterov, weight_decay, maximize, per param group
(kvstore.optimizer.torch_twin)."""

from __future__ import annotations

from ..errors import ConfigError
from .base import register
from .torch_twin import BOOL, NONNEG, TWIN_PARAMS, TorchTwin

__all__ = ["TorchSGD"]


@register
class TorchSGD(TorchTwin):
    """``torch.optim.SGD``'s update, bit for bit. State: ``momentum_buffer`` when a
    group has momentum (torch makes it at a parameter's first step with momentum)."""

    name = "torch_sgd"
    torch_name = "SGD"
    fields = {"lr": (1e-3, NONNEG), "momentum": (0.0, NONNEG), "dampening": (0.0, NONNEG),
              "weight_decay": (0.0, NONNEG), "nesterov": (False, BOOL), "maximize": (False, BOOL)}
    hyper_params = tuple(fields) + TWIN_PARAMS
    state_names = ("momentum_buffer",)
    keeps_step = False

    def check_group(self, owner, group):
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ConfigError(f"{owner}: nesterov momentum requires a momentum and zero dampening (as torch)")

    @property
    def num_states(self):
        return 1 if any(g["momentum"] != 0 for g in self.groups) else 0

    def state_layout(self):
        return self.state_names[:self.num_states]

    def used_states(self, group):
        return self.state_names if group["momentum"] != 0 else ()

    def torch_step(self, torch, param, grad, states, t, group):
        from torch.optim.sgd import sgd
        first = group["momentum"] != 0 and t == 1
        buffers = [None if first or not states else states[0]]
        sgd([param], [grad], buffers, foreach=False, fused=False, weight_decay=group["weight_decay"],
            momentum=group["momentum"], lr=group["lr"], dampening=group["dampening"],
            nesterov=group["nesterov"], maximize=group["maximize"])
        if first:
            states[0].copy_(buffers[0])
