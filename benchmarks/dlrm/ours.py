"""A worker of ours in the DLRM benchmark (started by benchmarks/dlrm/run.py):

    python -m tracker.local -n W -s S --env KVSTORE_TRANSPORT=tcp \\
        python -m benchmarks.dlrm.ours --tables 8x100000 --out-dir DIR

The tables are one ``ShardedEmbedding(mode="sum")`` over the one id space (table
``t``'s row ``i`` is row ``offset[t] + i``; rows ``r % S`` on server ``r``), made
on the servers by ``RowInit("uniform", scale, seed=seed)``: a forward pulls the
batch's unique rows of every table in one ``row_sparse_pull``, ``emb.step()``
pushes their gradient in one push. The MLPs go through ``kvstore.torch.Trainer``
with ``kvstore.optimizer.SGD(lr)``: the servers update both, each with the
Trainer's ``rescale_grad`` of 1/W (the gradient averaged over the workers).

Rank 0 also reads every server's peak RSS (``VmHWM`` of the ``kvstore.server``
processes tracker.local started beside it) after the last step.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

from benchmarks.dlrm import common
from benchmarks.dlrm.data import batch
from benchmarks.dlrm.model import DLRM, dense_parameters, init_dense, loss_fn


class Tables(nn.Module):
    """The embedding part: (T, B, L) ids of each table -> (B, T, D) pooled bags."""

    def __init__(self, emb, offsets: torch.Tensor):
        super().__init__()
        self.emb, self.offsets = emb, offsets          # offsets: (T,) first row of each table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t, b, length = ids.shape
        flat = (ids + self.offsets.view(t, 1, 1)).reshape(-1)
        bags = torch.arange(0, t * b * length, length, dtype=torch.int64)
        return self.emb(flat, bags).view(t, b, -1).transpose(0, 1)


def server_peaks() -> list[float]:
    """Peak RSS (MB) of the kvstore.server processes of this job: the children of
    this worker's parent (tracker.local) whose command line runs kvstore.server."""
    parent, peaks = os.getppid(), []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if b"kvstore.server" in argv:
                peaks.append(common.status_kb("VmHWM", pid) / 1024)
        except (OSError, IndexError, ValueError, KeyError):
            continue              # gone, or not ours to read
    return peaks


def main() -> int:
    args = common.parser(__doc__).parse_args()
    torch.set_num_threads(1)
    import kvstore
    import kvstore.torch
    from kvstore.torch import ShardedEmbedding

    rss_start = common.status_kb("VmRSS") / 1024
    cfg = common.config(args)
    kv = kvstore.create("dist_sync")
    assert isinstance(kv, kvstore.KVStore)   # a built-in store type
    emb = ShardedEmbedding(cfg.total_rows, cfg.dim, kv, key="dlrm.tables", init=("uniform", cfg.init_scale),
                           mode="sum", seed=cfg.seed)
    model = DLRM(Tables(emb, torch.from_numpy(cfg.offsets[:-1])), len(cfg.tables), cfg.dim, cfg.n_dense,
                 common.sizes(args.bottom), common.sizes(args.top))
    init_dense(model, cfg.seed)
    trainer = kvstore.torch.Trainer(dense_parameters(model), kv, kvstore.optimizer.SGD(learning_rate=args.lr))
    comm = {}

    def step(i: int) -> float:
        if i == args.warmup:
            comm["start"] = kv.comm_stats()
        b = batch(cfg, kv.rank, i)
        trainer.zero_grad()
        loss = loss_fn(model(torch.from_numpy(b.dense), torch.from_numpy(b.ids)), torch.from_numpy(b.labels))
        loss.backward()
        trainer.step()          # the MLPs' gradients (their pushes began during backward)
        emb.step()              # the tables' rows
        return loss.item()

    result = common.train(args, step, kv.barrier)
    end = kv.comm_stats()
    result["comm_bytes_per_step"] = sum(end[k] - comm["start"][k] for k in ("bytes_sent", "bytes_received")) \
        / args.steps
    result.update(rss_start_mb=rss_start, workers=kv.num_workers,
                  torch=torch.__version__, kvstore=getattr(kvstore, "__version__", "?"))
    kv.barrier()                # every worker's last push applied
    if kv.rank == 0:
        result["server_peak_rss_mb"] = server_peaks()
    common.write(args, kv.rank, result)
    kv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
