"""A model's parameters as views of a few flat buffers, one store key per buffer:
what ``kvstore.torch.Trainer(..., flat_buckets=True)`` exchanges (DDP's
``gradient_as_bucket_view``).

Each exchange costs per key, whatever its size (argument checks, a frame or device
reference per chunk, a reply lookup, a server round and update): ResNet-50's 161
parameters cost more in keys than in bytes (docs/gpu.md §8). With flat buckets,
the parameters (in reverse order, as backward produces their gradients; grouped by
device and dtype; cut at ``bucket_bytes``) become views of one weight buffer and
their ``.grad`` views of one gradient buffer per bucket, and a bucket is one key:
a pushpull of the bucket's gradient buffer answered into its weight buffer (servers
updating) or into the gradient buffer itself (workers updating).

Autograd accumulates into an existing ``.grad`` in place, so the gradients land in
the buffer; a ``.grad`` that was replaced (``model.zero_grad()`` sets it to None,
and the next backward makes a new tensor) is copied in and pointed at the buffer
again (:meth:`FlatBuckets.take`).

On ``dist_device_sync`` with CUDA parameters the gradient buffers come from
``kv.empty(size, dtype, device=i)`` (kvstore/devices/arena.py): co-located GPU
servers read them in place over cuda_ipc, with no copy into the link's slots and
no slot memory (the size of the gradients); the Trainer leaves a bucket's buffer
unchanged until its pushpull has filled its outputs, as that requires.

Only elementwise optimizers give the same update on a bucket as on each of its
parameters: layer-wise ones (LARS, LAMB) keep one key per parameter (the Trainer
refuses flat buckets with them), and so do sparse gradients.

Example::

    buckets = FlatBuckets(list(model.parameters()), [0, 1, 2, 3], bucket_bytes=4 << 20,
                          key_of=lambda b: f"bucket.{b}")
    bucket = buckets.arrived(3)       # after parameter 3's gradient: None, or the bucket it completed
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .errors import InvalidArgumentError


@dataclass
class Bucket:
    key: object
    indices: list[int]            # parameter indices, in their order in the buffers
    offsets: dict[int, int]       # parameter index -> its first element in the buffers
    weight: torch.Tensor          # flat: the parameters' data are views of it
    grad: torch.Tensor            # flat: their .grad are views of it
    grads: dict[int, torch.Tensor] = field(default_factory=dict)   # parameter index -> its .grad view
    waiting: set[int] = field(default_factory=set)    # gradients not yet arrived this step
    started: bool = False         # exchanged this step


class FlatBuckets:
    """The buckets of ``params[i]`` for ``i`` in ``indices`` (in that order: pass them
    reversed, as backward produces them)."""

    def __init__(self, params: list, indices: list[int], bucket_bytes: int, key_of: Callable[[int], object],
                 grad_memory: Callable[[int, torch.dtype, torch.device], torch.Tensor | None] | None = None):
        self._params = params
        # a gradient buffer of (size, dtype, device) the store reads in place, or None
        self._grad_memory = grad_memory
        self.buckets: list[Bucket] = []
        self.of: dict[int, Bucket] = {}
        open_groups: dict[tuple, list[int]] = {}     # (device, dtype) -> the bucket being filled
        sizes: dict[tuple, int] = {}
        groups: list[list[int]] = []
        for i in indices:
            p = params[i]
            group = (p.device, p.dtype)
            if group not in open_groups:
                open_groups[group] = []
                sizes[group] = 0
                groups.append(open_groups[group])
            open_groups[group].append(i)
            sizes[group] += p.numel() * p.element_size()
            if sizes[group] >= bucket_bytes:
                del open_groups[group]
        for b, members in enumerate(groups):
            self.buckets.append(self._bind(key_of(b), members))
        for bucket in self.buckets:
            for i in bucket.indices:
                self.of[i] = bucket

    def _bind(self, key, members: list[int]) -> Bucket:
        """A bucket over ``members``: their values copied into a new weight buffer and
        their data and gradients made views of the bucket's buffers."""
        first = self._params[members[0]]
        offsets, total = {}, 0
        for i in members:
            offsets[i] = total
            total += self._params[i].numel()
        weight = torch.empty(total, dtype=first.dtype, device=first.device)
        grad = self._grad_memory(total, first.dtype, first.device) if self._grad_memory is not None else None
        if grad is None:
            grad = torch.zeros(total, dtype=first.dtype, device=first.device)
        else:
            grad.zero_()
        bucket = Bucket(key, list(members), offsets, weight, grad)
        for i, offset in offsets.items():
            p = self._params[i]
            view = weight[offset:offset + p.numel()].view_as(p)
            view.copy_(p.detach())
            p.data = view
            # made once: a view per parameter per step cost ~5 us each (161 of them in ResNet-50)
            p.grad = bucket.grads[i] = grad[offset:offset + p.numel()].view_as(p)
        bucket.waiting = set(members)
        return bucket

    def take(self, index: int) -> None:
        """Make parameter ``index``'s ``.grad`` its view of the bucket: a replaced
        gradient is copied in; none at all leaves zeros there, as a parameter without
        a gradient is exchanged."""
        p = self._params[index]
        view = self.of[index].grads[index]
        grad = p.grad
        if grad is view:                 # autograd added into it: the common case
            return
        if grad is not None and grad.layout != torch.strided:
            raise InvalidArgumentError(f"flat_buckets: parameter {index} got a sparse gradient; "
                                       "create the Trainer with flat_buckets=False")
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
        p.grad = view

    def arrived(self, index: int) -> Bucket | None:
        """Parameter ``index``'s gradient arrived (:meth:`take` first): the bucket it
        completes, if any."""
        bucket = self.of[index]
        bucket.waiting.discard(index)
        return bucket if not bucket.waiting and not bucket.started else None

    def unstarted(self) -> list[Bucket]:
        return [b for b in self.buckets if not b.started]

    def new_step(self) -> None:
        for bucket in self.buckets:
            bucket.started = False
            bucket.waiting = set(bucket.indices)

    def zero_grad(self) -> None:
        """Zero every bucket's gradients (the ``.grad`` views stay)."""
        for bucket in self.buckets:
            bucket.grad.zero_()
            for i, view in bucket.grads.items():
                if self._params[i].grad is not view:     # replaced since (model.zero_grad())
                    self._params[i].grad = view
