"""MXNet's initializers (``mx.init``) for a torch model, chosen by fit.py's --initializer.

    initialize(model, "default", network="resnet")    # what MXNet's fit.py would use

MXNet initialises an array by its name: ``*weight`` with the initializer, ``*bias``
and ``*beta`` 0, ``*gamma`` 1 (and a BatchNorm's running mean 0, variance 1). Here a
normalisation layer's weight is its gamma and its bias its beta; every other
parameter named ``weight`` gets the initializer, every ``bias`` 0. Random draws use
torch's generator (``torch.manual_seed``).

| --initializer | MXNet | weights |
|---|---|---|
| default | ``Normal()`` for alexnet, ``Xavier()`` for vgg, else ``Xavier('gaussian', 'in', 2)`` | as those |
| xavier | ``Xavier()`` | uniform in +-sqrt(3 / ((fan_in + fan_out) / 2)) |
| msra | ``MSRAPrelu()`` | gaussian, std sqrt(2 / (1 + 0.25**2) / ((fan_in + fan_out) / 2)) |
| orthogonal | ``Orthogonal()`` | 1.414 x an orthogonal basis of a uniform(-1, 1) matrix (SVD) |
| normal | ``Normal()`` | gaussian, std 0.01 |
| uniform | ``Uniform()`` | uniform in +-0.07 |
| one / zero | ``One()`` / ``Zero()`` | 1 / 0 |

For a weight of shape (out, in, k...), fan_in = in * prod(k) and fan_out = out * prod(k).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

INITIALIZERS = ("default", "xavier", "msra", "orthogonal", "normal", "uniform", "one", "zero")
NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)


def xavier(rnd_type: str = "uniform", factor_type: str = "avg", magnitude: float = 3.0) -> Callable:
    """MXNet's ``Xavier``: scale = sqrt(magnitude / factor), factor the mean of the fans
    (``avg``), fan_in (``in``) or fan_out (``out``); uniform in +-scale or gaussian with
    standard deviation scale."""
    def init(w: torch.Tensor) -> None:
        if w.dim() < 2:
            raise ValueError(f"Xavier needs a weight of at least 2 dimensions, got shape {tuple(w.shape)}")
        field = math.prod(w.shape[2:])
        fan_in, fan_out = w.shape[1] * field, w.shape[0] * field
        factor = {"avg": (fan_in + fan_out) / 2.0, "in": fan_in, "out": fan_out}[factor_type]
        scale = math.sqrt(magnitude / factor)
        if rnd_type == "uniform":
            w.uniform_(-scale, scale)
        else:
            w.normal_(0.0, scale)
    return init


def orthogonal(scale: float = 1.414) -> Callable:
    """MXNet's ``Orthogonal(scale, 'uniform')``: the SVD factor of a uniform(-1, 1)
    (out, in * prod(k)) matrix that has its shape, times ``scale``."""
    def init(w: torch.Tensor) -> None:
        rows, cols = w.shape[0], math.prod(w.shape[1:])
        tmp = torch.empty(rows, cols, dtype=torch.float64).uniform_(-1.0, 1.0)
        u, _, vh = torch.linalg.svd(tmp, full_matrices=False)
        q = u if u.shape == tmp.shape else vh
        w.copy_((scale * q).reshape(w.shape))
    return init


def weight_init(name: str, network: str | None = None) -> Callable:
    """The weight initializer of ``--initializer name`` for ``--network network``."""
    if name == "default":
        if network == "alexnet":
            return weight_init("normal")
        return xavier() if network and "vgg" in network else xavier("gaussian", "in", 2.0)
    table: dict[str, Callable] = {
        "xavier": xavier(),
        "msra": xavier("gaussian", "avg", 2.0 / (1 + 0.25 ** 2)),
        "orthogonal": orthogonal(),
        "normal": lambda w: w.normal_(0.0, 0.01),
        "uniform": lambda w: w.uniform_(-0.07, 0.07),
        "one": lambda w: w.fill_(1.0),
        "zero": lambda w: w.zero_(),
    }
    if name not in table:
        raise ValueError(f"--initializer {name!r}: expected one of {', '.join(INITIALIZERS)}")
    return table[name]


def initialize(model: nn.Module, name: str, network: str | None = None) -> None:
    """Initialise every parameter and BatchNorm statistic of ``model`` by MXNet's rules
    (module docstring). Raises ValueError for an unknown ``name``."""
    init = weight_init(name, network)
    with torch.no_grad():
        for module in model.modules():
            is_norm = isinstance(module, NORMS)
            for pname, p in module.named_parameters(recurse=False):
                if pname == "weight":
                    p.fill_(1.0) if is_norm else init(p)
                else:   # bias, beta, a learned shift: 0
                    p.zero_()
            if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats:
                module.reset_running_stats()
