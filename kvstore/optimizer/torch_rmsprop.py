"""``torch_rmsprop``: the servers' twin of ``torch.optim.RMSprop``
(torch.optim.rmsprop.rmsprop, single-tensor): alpha, eps, weight_decay, momentum,
centered, maximize, per param group (kvstore.optimizer.torch_twin)."""

from __future__ import annotations

from .base import register
from .torch_twin import BOOL, NONNEG, TWIN_PARAMS, TorchTwin, step_tensor

__all__ = ["TorchRMSprop"]


@register
class TorchRMSprop(TorchTwin):
    """``torch.optim.RMSprop``'s update, bit for bit. State: ``square_avg``, then
    ``momentum_buffer`` when a group has momentum, then ``grad_avg`` when a group is
    centered (each kept for every key once any group needs it); ``step``."""

    name = "torch_rmsprop"
    torch_name = "RMSprop"
    fields = {"lr": (1e-2, NONNEG), "alpha": (0.99, NONNEG), "eps": (1e-8, NONNEG),
              "weight_decay": (0.0, NONNEG), "momentum": (0.0, NONNEG), "centered": (False, BOOL),
              "maximize": (False, BOOL)}
    hyper_params = tuple(fields) + TWIN_PARAMS
    state_names = ("square_avg", "momentum_buffer", "grad_avg")

    def state_layout(self) -> tuple[str, ...]:
        momentum = any(g["momentum"] > 0 for g in self.groups)
        centered = any(g["centered"] for g in self.groups)
        return ("square_avg",) + (("momentum_buffer",) if momentum else ()) + (("grad_avg",) if centered else ())

    @property
    def num_states(self):
        return len(self.state_layout())

    def used_states(self, group):
        return ("square_avg",) + (("momentum_buffer",) if group["momentum"] > 0 else ()) + \
            (("grad_avg",) if group["centered"] else ())

    def torch_step(self, torch, param, grad, states, t, group):
        from torch.optim.rmsprop import rmsprop
        at = dict(zip(self.state_layout(), states))
        rmsprop([param], [grad], [at["square_avg"]], [at["grad_avg"]] if group["centered"] else [],
                [at["momentum_buffer"]] if group["momentum"] > 0 else [], [step_tensor(torch, t)],
                foreach=False, maximize=group["maximize"], differentiable=False, capturable=False,
                lr=group["lr"], alpha=group["alpha"], eps=group["eps"], weight_decay=group["weight_decay"],
                momentum=group["momentum"], centered=group["centered"])
