"""MXNet's ``mx.mon.Monitor(interval, pattern=".*")`` (fit.py's --monitor N) for a torch model.

Every N-th batch (the 1st, the N+1-th, ...) it logs, for each layer's output, each
parameter and each buffer (a BatchNorm's running statistics: MXNet's auxiliary
states), the statistic ``norm(x) / sqrt(x.size)``, in MXNet's line format::

    Batch:       1 features.0_output              0.8312
    Batch:       1 features.0.weight              0.0625

Layers are the model's leaf modules, named by their path in the model; MXNet names
them by its symbols (``conv0_output``, ``conv0_weight``).

    mon = Monitor(model, 100)
    mon.tic()       # before the forward
    ...             # forward, backward, step
    mon.toc_print() # after the step
"""

from __future__ import annotations

import logging
import math
import re

import torch
from torch import nn

log = logging.getLogger("fit")


def stat(x: torch.Tensor) -> float:
    """MXNet's default statistic: norm(x) / sqrt(x.size)."""
    x = x.detach().float()
    return float(torch.linalg.vector_norm(x)) / math.sqrt(max(x.numel(), 1))


class Monitor:
    """Collects the statistics of the module docstring every ``interval``-th batch."""

    def __init__(self, model: nn.Module, interval: int, pattern: str = ".*"):
        if interval < 1:
            raise ValueError(f"Monitor: interval must be >= 1, got {interval}")
        self.model, self.interval, self.pattern = model, interval, re.compile(pattern)
        self.step = 0
        self.active = False
        self.queue: list[tuple[int, str, float]] = []
        self._hooks = [module.register_forward_hook(self._hook(name))
                       for name, module in model.named_modules() if name and not list(module.children())]

    def _hook(self, name: str):
        def record(module, inputs, output):
            if self.active and isinstance(output, torch.Tensor) and self.pattern.match(name + "_output"):
                self.queue.append((self.step, name + "_output", stat(output)))
        return record

    def tic(self) -> None:
        """Before a batch's forward: start collecting if this batch is monitored."""
        if self.step % self.interval == 0:
            self.queue, self.active = [], True
        self.step += 1

    def toc_print(self) -> None:
        """After a batch's update: add the parameters and buffers, log every line."""
        if not self.active:
            return
        for name, tensor in list(self.model.named_parameters()) + list(self.model.named_buffers()):
            if tensor.is_floating_point() and self.pattern.match(name):
                self.queue.append((self.step, name, stat(tensor)))
        self.active = False
        for step, name, value in self.queue:
            log.info("Batch: %7d %-30s %s\t", step, name, value)
        self.queue = []

    def close(self) -> None:
        """Remove the hooks from the model."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
