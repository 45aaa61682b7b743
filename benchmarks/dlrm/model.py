"""DLRM (Naumov et al., 2019) written once in plain torch, for both contenders.

    dense (B, n_dense) -> bottom MLP -> x (B, D)
    sparse -> the embedding part -> e (B, T, D)     (one pooled bag per table)
    z = [x, e_1 .. e_T]; the dot products z_i . z_j, i < j (B, (T+1)T/2)
    [x, dots] -> top MLP -> a logit; BCE with logits, mean over the batch

The embedding part is pluggable: any module whose ``forward(sparse)`` returns the
pooled bags as (B, T, D). Ours gives it a ``ShardedEmbedding`` (the tables on our
servers), TorchRec an ``EmbeddingBagCollection`` (sharded by
``DistributedModelParallel``). Every ReLU layer but the top's last, which is linear
(the logit), as in TorchRec's ``torchrec.models.dlrm.DLRM``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def mlp(sizes: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    li: torch.Tensor    # the pairs (i < j) of the interaction's dot products (buffers)
    lj: torch.Tensor

    def __init__(self, embedding: nn.Module, num_tables: int, dim: int, n_dense: int,
                 bottom: list[int], top: list[int]):
        super().__init__()
        self.embedding = embedding
        self.bottom = mlp([n_dense, *bottom, dim], last_relu=True)
        pairs = (num_tables + 1) * num_tables // 2
        self.top = mlp([dim + pairs, *top, 1], last_relu=False)
        li, lj = torch.triu_indices(num_tables + 1, num_tables + 1, offset=1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)

    def forward(self, dense: torch.Tensor, sparse) -> torch.Tensor:
        x = self.bottom(dense)
        e = self.embedding(sparse)                                   # (B, T, D)
        z = torch.cat([x.unsqueeze(1), e], dim=1)                   # (B, T + 1, D)
        dots = torch.bmm(z, z.transpose(1, 2))[:, self.li, self.lj]  # (B, (T+1)T/2)
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)


def dense_parameters(model: DLRM) -> list[tuple[str, nn.Parameter]]:
    """The MLPs' parameters in a fixed order (the embedding part's are not here)."""
    return [(n, p) for n, p in model.named_parameters() if n.startswith(("bottom.", "top."))]


def init_dense(model: DLRM, seed: int) -> None:
    """The MLPs' initial values from ``numpy.random.default_rng(seed)`` (the same
    numbers whatever torch version runs): a weight uniform in +-sqrt(6 / fan_in) (He's
    bound for ReLU layers: a signal that neither shrinks nor grows through the MLPs, so
    a short run learns), a bias zero."""
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, p in dense_parameters(model):
            if name.endswith("weight"):
                bound = np.sqrt(6.0 / p.shape[1])
                p.copy_(torch.from_numpy(rng.uniform(-bound, bound, tuple(p.shape)).astype(np.float32)))
            else:
                p.zero_()


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(logits, labels)
