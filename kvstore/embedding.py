"""``ShardedEmbedding``: an embedding table that lives on the servers.

The module holds no weight. Each forward pulls only the batch's unique rows
(``row_sparse_pull``), computes on them, and keeps them as a leaf tensor;
backward fills that leaf's gradient, and :meth:`ShardedEmbedding.step` pushes
it as a row-sparse gradient (the servers' optimizer updates those rows only).
A worker's memory grows with the rows a batch touches, never with ``num_rows``.

    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.1))
    emb = ShardedEmbedding(10_000_000, 64, kv, key="emb", init=("normal", 0.01))
    loss = model(emb(ids)).sum(); loss.backward()
    emb.step()            # push this step's rows; the next forward sees the update

Imported by :mod:`kvstore.torch` (it needs torch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .rowinit import RowInit
from .sparse import RowSparse

__all__ = ["ShardedEmbedding"]


class ShardedEmbedding(torch.nn.Module):
    """``nn.Embedding`` (``mode=None``) or ``nn.EmbeddingBag`` (``mode`` "sum",
    "mean" or "max") over a ``num_rows`` x ``dim`` row-sparse key of ``kv``.

    ``init`` is ``(kind, scale)`` for a :class:`~kvstore.RowInit` made on the
    servers ("zeros", "normal" or "uniform"; ``seed`` picks the stream), or
    ``None`` when the key is already initialised. Call :meth:`step` once per
    training step, after ``backward``: it pushes every forward's gradient rows
    since the last step as one push (MXNet's sparse push)."""

    def __init__(self, num_rows: int, dim: int, kv, key="embedding", init=("normal", 0.01),
                 mode: str | None = None, seed: int = 0, dtype=torch.float32):
        super().__init__()
        if mode not in (None, "sum", "mean", "max"):
            raise ValueError(f"ShardedEmbedding: mode must be None, 'sum', 'mean' or 'max', got {mode!r}")
        self.num_rows, self.dim, self.kv, self.key, self.mode = int(num_rows), int(dim), kv, key, mode
        self.dtype = dtype
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []   # (rows, leaf) since step()
        if init is not None:
            kind, scale = init
            np_dtype = torch.empty(0, dtype=dtype).numpy().dtype.name
            kv.init(key, RowInit(kind, scale, (self.num_rows, self.dim), np_dtype, seed))

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        rows, inverse = torch.unique(ids.reshape(-1), sorted=True, return_inverse=True)
        out = RowSparse(torch.empty((0, self.dim), dtype=self.dtype), torch.empty(0, dtype=torch.int64),
                        (self.num_rows, self.dim))
        self._store().row_sparse_pull(self.key, out=out, row_ids=rows.cpu())
        weight = out.data.to(ids.device)
        if torch.is_grad_enabled() and self.training:
            weight.requires_grad_(True)
            self._pending.append((out.indices, weight))
        inverse = inverse.reshape(ids.shape)
        if self.mode is None:
            return F.embedding(inverse, weight)
        return F.embedding_bag(inverse, weight, offsets, mode=self.mode,
                               per_sample_weights=per_sample_weights)

    def step(self) -> None:
        """Push the gradient rows of every forward since the last step (forwards
        whose output got no gradient add nothing) and forget them."""
        pending, self._pending = self._pending, []
        grads = [RowSparse(leaf.grad.detach().cpu(), rows, (self.num_rows, self.dim))
                 for rows, leaf in pending if leaf.grad is not None]
        if grads:
            self._store().push(self.key, grads if len(grads) > 1 else grads[0])

    # torch.save(model) pickles the module: the table stays on the servers, and the
    # store (sockets, threads) cannot travel; attach one after loading (emb.kv = kv)
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["kv"], state["_pending"] = None, []
        return state

    def _store(self):
        if self.kv is None:
            raise RuntimeError(f"ShardedEmbedding {self.key!r} has no store (it was loaded from a file): "
                               "set emb.kv = kv, the store that holds its table")
        return self.kv

    def extra_repr(self) -> str:
        return f"{self.num_rows}, {self.dim}, key={self.key!r}, mode={self.mode!r}"
