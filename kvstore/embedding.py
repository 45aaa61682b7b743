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

Its table is the module's ``weight`` in ``state_dict()`` and ``load_state_dict()``
(moved to and from the servers piece by piece; loading is collective: every
worker calls it, rank 0 sends), and :meth:`~ShardedEmbedding.save_table` /
:meth:`~ShardedEmbedding.load_table` stream it through a ``.npy`` file for
tables larger than a worker's memory.

Imported by :mod:`kvstore.torch` (it needs torch).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .rows.dynamic import ID_LIMIT, DynamicRows
from .rows.rowinit import RowInit
from .rows.sparse import RowSparse

__all__ = ["ShardedEmbedding"]


class ShardedEmbedding(torch.nn.Module):
    """``nn.Embedding`` (``mode=None``) or ``nn.EmbeddingBag`` (``mode`` "sum",
    "mean" or "max") over a ``num_rows`` x ``dim`` row-sparse key of ``kv``.

    ``init`` is ``(kind, scale)`` for a :class:`~kvstore.RowInit` made on the
    servers ("zeros", "normal" or "uniform"; ``seed`` picks the stream), or
    ``None`` when the key is already initialised. ``init`` a
    :class:`~kvstore.DynamicRows` (whose row shape is ``(dim,)``) makes a table of
    dynamic rows: ids are any int64 in [0, 2**63), rows are made by the first push
    and evicted (``num_rows`` None; also ``num_rows=None`` with ``init=None`` for such
    a key made already); its state_dict and save_table are refused (its rows
    travel in the servers' checkpoints). Call :meth:`step` once per
    training step, after ``backward``: it pushes every forward's gradient rows
    since the last step as one push (MXNet's sparse push)."""

    def __init__(self, num_rows: int, dim: int, kv, key="embedding", init=("normal", 0.01),
                 mode: str | None = None, seed: int = 0, dtype=torch.float32):
        super().__init__()
        if mode not in (None, "sum", "mean", "max"):
            raise ValueError(f"ShardedEmbedding: mode must be None, 'sum', 'mean' or 'max', got {mode!r}")
        self.dynamic = num_rows is None or isinstance(init, DynamicRows)
        if self.dynamic:
            if num_rows not in (None, ID_LIMIT) or (isinstance(init, DynamicRows) and init.row_shape != (int(dim),)):
                raise ValueError(f"ShardedEmbedding {key!r}: a table of dynamic rows has num_rows None and "
                                 f"rows of ({dim},), got num_rows {num_rows} and {init!r}")
            num_rows = ID_LIMIT
        self.num_rows, self.dim, self.kv, self.key, self.mode = int(num_rows), int(dim), kv, key, mode
        self.dtype = dtype
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []   # (rows, leaf) since step()
        if isinstance(init, DynamicRows):
            kv.init(key, init)
        elif init is not None:
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

    # -- the table in state_dict, torch.save and files ----------------------------------
    def table_pieces(self, piece_rows: int | None = None):
        """Yield ``(start, rows)``: the table's rows ``start ...`` as a tensor, pulled
        from the servers one piece at a time (``piece_rows`` rows, by default about
        64 MB), so that no more than a piece is in memory at once."""
        self._refuse_dynamic("its rows")
        store, step = self._store(), self._piece_rows(piece_rows)
        for start in range(0, self.num_rows, step):
            ids = torch.arange(start, min(start + step, self.num_rows), dtype=torch.int64)
            out = RowSparse(torch.empty((0, self.dim), dtype=self.dtype), torch.empty(0, dtype=torch.int64),
                            (self.num_rows, self.dim))
            store.row_sparse_pull(self.key, out=out, row_ids=ids)
            yield start, out.data

    def save_table(self, path: str, piece_rows: int | None = None) -> None:
        """Write the table to ``path`` as a ``.npy`` file, piece by piece (a table larger
        than this worker's memory streams through it); read by :meth:`load_table` or
        ``numpy.load``. Any one worker may call it."""
        np_dtype = torch.empty(0, dtype=self.dtype).numpy().dtype
        table = np.lib.format.open_memmap(path, mode="w+", dtype=np_dtype, shape=(self.num_rows, self.dim))
        for start, rows in self.table_pieces(piece_rows):
            table[start:start + len(rows)] = rows.numpy()
        table.flush()
        del table

    def load_table(self, path: str, piece_rows: int | None = None) -> None:
        """Load a table written by :meth:`save_table` (memory-mapped, sent piece by
        piece). Collective, like :meth:`load_state_dict`: every worker calls it."""
        self._assign(np.load(path, mmap_mode="r"), path, piece_rows)

    def _refuse_dynamic(self, what: str) -> None:
        if self.dynamic:
            raise RuntimeError(f"ShardedEmbedding {self.key!r} holds dynamic rows (ids up to 2**63, made by "
                               f"pushes): {what} cannot be listed or loaded as a table; the servers' "
                               "checkpoints (KVSTORE_CHECKPOINT_DIR) carry them")

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        self._refuse_dynamic("state_dict")
        # the whole table as "weight" (nn.Embedding's name): pulled piece by piece, but
        # a state_dict holds tensors, so it is in memory at once; save_table streams
        weight = torch.empty((self.num_rows, self.dim), dtype=self.dtype)
        for start, rows in self.table_pieces():
            weight[start:start + len(rows)] = rows
        destination[prefix + "weight"] = weight

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        self._refuse_dynamic("load_state_dict")
        name = prefix + "weight"
        if name not in state_dict:
            if strict:
                missing_keys.append(name)
            return
        weight = state_dict[name]
        if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (self.num_rows, self.dim):
            shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
            error_msgs.append(f"size mismatch for {name}: copying a param with shape {shape} from checkpoint, "
                              f"the shape in current model is {(self.num_rows, self.dim)}.")
            return
        self._assign(weight, name, None)

    def _assign(self, weight, what: str, piece_rows: int | None) -> None:
        """Send ``weight`` (the whole table, a tensor or a numpy array; memory-mapped or
        not) to the servers piece
        by piece: rank 0 sends, between two barriers, so that every worker reads the
        loaded table after and no step of anyone's is half applied during."""
        self._refuse_dynamic(what)
        store, step = self._store(), self._piece_rows(piece_rows)
        if tuple(weight.shape) != (self.num_rows, self.dim):
            raise ValueError(f"ShardedEmbedding {self.key!r}: {what} holds a {tuple(weight.shape)} table, "
                             f"this one is {(self.num_rows, self.dim)}")
        store.barrier()
        if store.rank == 0:
            for start in range(0, self.num_rows, step):
                ids = torch.arange(start, min(start + step, self.num_rows), dtype=torch.int64)
                piece = weight[start:start + len(ids)]
                if not isinstance(piece, torch.Tensor):           # a numpy (memory-mapped) table
                    piece = torch.from_numpy(np.array(piece))
                rows = piece.detach().to("cpu", self.dtype).contiguous()
                store.assign_rows(self.key, RowSparse(rows, ids, (self.num_rows, self.dim)))
        store.barrier()

    def _piece_rows(self, piece_rows: int | None) -> int:
        if piece_rows is None:
            piece_rows = (64 << 20) // max(1, self.dim * torch.empty(0, dtype=self.dtype).element_size())
        if piece_rows < 1:
            raise ValueError(f"piece_rows must be at least 1, got {piece_rows}")
        return int(piece_rows)

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
