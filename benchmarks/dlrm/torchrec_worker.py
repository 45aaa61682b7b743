"""A TorchRec worker of the DLRM benchmark (started by benchmarks/dlrm/run.py with
``benchmarks/.venv-torchrec/bin/torchrun``; every rank on this machine, gloo over
loopback TCP):

    torchrun --nnodes 1 --nproc-per-node W --master-addr 127.0.0.1 --master-port P \\
        -m benchmarks.dlrm.torchrec_worker --tables 8x100000 --out-dir DIR

The same DLRM (benchmarks/dlrm/model.py) with a TorchRec ``EmbeddingBagCollection``
(one table a feature, pooling "sum") as its embedding part, wrapped whole in
``DistributedModelParallel`` on the CPU with the default planner
(``EmbeddingShardingPlanner`` over a CPU ``Topology`` of W ranks, chosen
collectively) and the default sharders: the planner shards the tables over the
ranks, DMP moves ids and pooled bags with all-to-alls and wraps the MLPs in DDP.

Optimizers, to match ours exactly: the tables get TorchRec's fused optimizer
(``apply_optimizer_in_backward(torch.optim.SGD, lr=lr)`` before sharding: fbgemm's
EXACT_SGD, applied in backward). The pooled bags' all-to-all divides their
gradient by W in backward (``torchrec.distributed.comm_ops.GRADIENT_DIVISION``,
True by default, asserted below), so the fused SGD applies lr x the gradient
averaged over the ranks: ours' servers' SGD(lr) with the Trainer's rescale_grad
1/W. (A first version set lr / W, assuming a sum: after one step its tables had
moved half as far as a one-process reference's.) The MLPs: DDP averages the
gradients, ``torch.optim.SGD(lr)`` steps them (ours: the same servers' SGD). Initial values: the tables' shards are written from
``data.init_rows`` at their global rows (the numbers our servers' RowInit makes),
the MLPs from ``model.init_dense``.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from benchmarks.dlrm import common
from benchmarks.dlrm.data import batch, init_rows
from benchmarks.dlrm.model import DLRM, init_dense, loss_fn


class Tables(nn.Module):
    """The embedding part: a KeyedJaggedTensor -> (B, T, D) pooled bags, in table order."""

    def __init__(self, ebc, num_tables: int):
        super().__init__()
        self.ebc, self.num_tables = ebc, num_tables

    def forward(self, kjt) -> torch.Tensor:
        bags = self.ebc(kjt).to_dict()
        return torch.stack([bags[f"f{t}"] for t in range(self.num_tables)], dim=1)


def write_initial_tables(dmp, cfg) -> dict:
    """Fill this rank's shards of every table with the shared initial values;
    returns {table: [(row offset, rows, column offset, columns), ...]} (the plan as
    placed on this rank)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    placed: dict[str, list[tuple[int, int, int, int]]] = {}
    offsets = cfg.offsets
    with torch.no_grad():
        for name, value in dmp.state_dict().items():
            if ".embedding_bags." not in name:
                continue
            t = int(name.split(".embedding_bags.t", 1)[1].split(".", 1)[0])
            if isinstance(value, ShardedTensor):
                shards = [(s.metadata.shard_offsets, s.metadata.shard_sizes, s.tensor) for s in value.local_shards()]
            else:
                shards = [([0, 0], list(value.shape), value)]
            for (r0, c0), (nr, nc), tensor in shards:
                for start in range(0, nr, 1 << 16):       # a block of rows at a time (bounded temporaries)
                    rows = offsets[t] + r0 + np.arange(start, min(nr, start + (1 << 16)), dtype=np.int64)
                    values = init_rows(rows, cfg.dim, cfg.init_scale, cfg.seed)[:, c0:c0 + nc]
                    tensor[start:start + len(rows)].copy_(torch.from_numpy(np.ascontiguousarray(values)))
                placed.setdefault(f"t{t}", []).append((int(r0), int(nr), int(c0), int(nc)))
    return placed


def main() -> int:
    args = common.parser(__doc__).parse_args()
    torch.set_num_threads(1)
    rss_start = common.status_kb("VmRSS") / 1024
    import torchrec
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = common.config(args)
    t_count = len(cfg.tables)
    ebc = torchrec.EmbeddingBagCollection(
        tables=[torchrec.EmbeddingBagConfig(name=f"t{t}", embedding_dim=cfg.dim, num_embeddings=rows,
                                            feature_names=[f"f{t}"], pooling=torchrec.PoolingType.SUM)
                for t, rows in enumerate(cfg.tables)],
        device=torch.device("meta"))                # DMP allocates the shards, each on its rank
    model = DLRM(Tables(ebc, t_count), t_count, cfg.dim, cfg.n_dense, common.sizes(args.bottom),
                 common.sizes(args.top))
    init_dense(model, cfg.seed)
    from torchrec.distributed.comm_ops import get_gradient_division
    if not get_gradient_division():      # the table's lr below assumes the averaged gradient
        raise SystemExit("torchrec's gradient division is off: the fused SGD's lr would not match ours")
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": args.lr})   # model.embedding.ebc
    dmp = DistributedModelParallel(model, device=torch.device("cpu"))   # the default planner and sharders
    placed = write_initial_tables(dmp, cfg)
    plan = {name: {"sharding_type": p.sharding_type, "compute_kernel": p.compute_kernel,
                   "ranks": p.ranks} for module in dmp.plan.plan.values() for name, p in module.items()}
    dense_opt = torch.optim.SGD([p for _, p in in_backward_optimizer_filter(dmp.named_parameters())], lr=args.lr)
    lengths = torch.full((t_count * cfg.batch,), cfg.pooling, dtype=torch.int64)
    keys = [f"f{t}" for t in range(t_count)]

    def step(i: int) -> float:
        b = batch(cfg, rank, i)
        kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.from_numpy(b.ids.reshape(-1)),
                                                           lengths=lengths)
        dense_opt.zero_grad()
        loss = loss_fn(dmp(torch.from_numpy(b.dense), kjt), torch.from_numpy(b.labels))
        loss.backward()          # the tables' SGD runs here (fused, in backward)
        dense_opt.step()
        return loss.item()

    result = common.train(args, step, dist.barrier)
    result.update(rss_start_mb=rss_start, workers=world, torch=torch.__version__,
                  torchrec=_version("torchrec"), fbgemm_gpu=_version("fbgemm_gpu_cpu"), plan=plan,
                  placed=placed)
    dist.barrier()
    common.write(args, rank, result)
    dist.destroy_process_group()
    return 0


def _version(dist_name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist_name)
    except PackageNotFoundError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
