"""Optimizers that parameter servers apply to gradient chunks.

An optimizer crosses the wire as a registry name plus hyper-parameters (never a
pickle) and is rebuilt with :func:`from_config`. Updates run in place on NumPy or
CuPy arrays with MXNet 1.x math; learning-rate schedulers are pure functions of
the per-weight update count, so restarts from checkpoints are exact. A second
family, named apart (``torch_sgd``, ``torch_adam``, ``torch_adamw``,
``torch_rmsprop``, ``torch_adagrad``, ``torch_adadelta``), computes what
``torch.optim`` computes, bit for bit, with torch's own step
(:mod:`kvstore.optimizer.torch_twin`).

Example::

    from kvstore import optimizer as opt
    o = opt.create("sgd", learning_rate=0.1, momentum=0.9,
                   lr_scheduler=opt.FactorScheduler(step=100, factor=0.5))
    cfg = o.to_config()              # plain dict: send it with msgpack
    u = opt.Updater(opt.from_config(cfg))   # e.g. on a server
    u(3, grad, weight)               # weight (numpy or cupy) updated in place

Invalid names, parameters or values raise :class:`kvstore.errors.ConfigError`.
"""

from .base import STATE_VERSION, Optimizer, create, from_config, register, registered
from .lr_scheduler import (CosineScheduler, FactorScheduler, LRScheduler, MultiFactorScheduler, PolyScheduler,
                           register_scheduler, registered_schedulers, scheduler_from_config)
from .optimizers import NAG, SGD, AdaGrad, Adam, RMSProp, Test
# MXNet 1.x's other optimizers, one module each: importing registers them (LARS, LAMB
# and LBSGD's "lars" scale each key's step by its norms: kvstore.optimizer.layerwise).
from .adadelta import AdaDelta
from .adamax import Adamax
from .dcasgd import DCASGD
from .ftml import FTML
from .ftrl import Ftrl
from .lamb import LAMB
from .lars import LARS
from .lbsgd import LBSGD
from .nadam import Nadam
from .sgld import SGLD
from .signum import Signum
from .updater import Updater
# torch.optim's optimizers, torch's own math on the servers (kvstore.optimizer.torch_twin)
from .torch_adadelta import TorchAdadelta
from .torch_adagrad import TorchAdagrad
from .torch_adam import TorchAdam
from .torch_adamw import TorchAdamW
from .torch_rmsprop import TorchRMSprop
from .torch_sgd import TorchSGD
from .torch_twin import TorchTwin

__all__ = [
    "Optimizer", "create", "from_config", "register", "registered", "Updater", "STATE_VERSION",
    "SGD", "NAG", "Adam", "AdaGrad", "RMSProp", "Test",
    "Signum", "FTML", "DCASGD", "SGLD", "AdaDelta", "Ftrl", "Adamax", "Nadam", "LARS", "LAMB", "LBSGD",
    "TorchTwin", "TorchSGD", "TorchAdam", "TorchAdamW", "TorchRMSprop", "TorchAdagrad", "TorchAdadelta",
    "LRScheduler", "FactorScheduler", "MultiFactorScheduler", "CosineScheduler", "PolyScheduler",
    "register_scheduler", "registered_schedulers", "scheduler_from_config",
]
