"""One worker of the sparse-embedding benchmark (started by benchmarks/sparse/run.py).

Every contender trains the same R x D fp32 table on the same batches: worker r at
step i draws ``--batch`` ids from a Zipf law (seeded by (seed, r, i)); the gradient
of a row is its count in the batch times ``GRAD`` (what nn.Embedding's backward
gives for a loss whose gradient is GRAD at every lookup). Contenders:

  ours    (tracker.local job) the table on the servers, RowInit zeros; a step is
          kv.push(RowSparse gradient) + kv.row_sparse_pull(the batch's rows),
          updated lazily on the servers by --optimizer (sgd or adam)
  dense   (torch.distributed gloo) every rank holds the table and a dense gradient
          (DDP with nn.Embedding(sparse=False)); a step is all_reduce of the whole
          gradient + torch SGD over the table + the lookup of the batch's rows;
          clearing the gradient and scattering the batch into it are not timed
  sparse  (gloo) every rank holds the table; a step is gloo's sparse all_reduce
          of the COO gradient (all_gather of indices and values, then sum; DDP
          with nn.Embedding(sparse=True)) + torch SGD on the rows + the lookup

Each step is checked: the summed gradient (gloo) or the pulled rows (ours: SGD
exactly, Adam by direction and bound) against values computed from every worker's
batch. Per step: time, TCP bytes this process sent and received (``ss``, every
socket of this pid) and, for ours, kv.comm_stats(). At the end: peak RSS
(ru_maxrss) and the RSS before the table. Rank 0 writes the JSON result.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.harness import common  # noqa: E402
from benchmarks.harness.common import tcp_bytes  # noqa: E402
from benchmarks.harness.zipf import scatter, zipf_ids  # noqa: E402

GRAD = 2.0 ** -10              # a count times GRAD is exact in fp32, and so are their sums
KEY = "table"


# ---------------------------------------------------------------- the batches

class Batches:
    """The rows and counts of worker ``rank`` at ``step``, for any rank (the checks
    need every worker's), and the sample of rows every check looks at."""

    def __init__(self, args, workers: int):
        self.args, self.workers = args, workers
        # the rows every check looks at, every step: the 32 hottest (in every batch),
        # some touched in most steps and some in few (popularity ranks 1000.., 30000..)
        ranks = np.concatenate([np.arange(32), 1000 + np.arange(32), 30000 + np.arange(32)])
        self.sample = np.unique(scatter(ranks[ranks < args.rows], args.rows))

    def of(self, rank: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng((self.args.seed, rank, step))
        return np.unique(zipf_ids(rng, self.args.batch, self.args.zipf, self.args.rows), return_counts=True)

    def gradient(self, counts: np.ndarray) -> np.ndarray:
        return np.repeat((counts * GRAD).astype(np.float32)[:, None], self.args.dim, axis=1)

    def merged_counts(self, step: int, sample: np.ndarray) -> tuple[np.ndarray, int]:
        """Every worker's count of each ``sample`` row at ``step``, summed, and the
        number of rows the step's batches touch together."""
        total, union = np.zeros(len(sample), np.int64), []
        for r in range(self.workers):
            rows, counts = self.of(r, step)
            at = np.searchsorted(rows, sample).clip(0, len(rows) - 1)
            total += np.where(rows[at] == sample, counts[at], 0)
            union.append(rows)
        return total, len(np.unique(np.concatenate(union)))


# ---------------------------------------------------------------- measuring

def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


class Steps:
    """The timed loop (common.timed_loop) plus, per step, the TCP bytes and the
    unique-row counts; ``check(i)`` of the contender runs after each step."""

    def __init__(self, args, batches: Batches, sync):
        self.args, self.batches, self.sync = args, batches, sync
        self.bytes: list[int] = []      # per timed step: TCP bytes
        self.unique: list[int] = []     # this worker's rows
        self.union: list[int] = []      # every worker's rows together
        self._mark = 0
        self.base_rss = rss_mb()

    def run(self, prepare, step, check, extra=None) -> dict:
        def synced():            # count from before the barrier: ss takes longer than it
            self._mark = tcp_bytes(os.getpid())
            self.sync()

        def checked(i):
            moved = tcp_bytes(os.getpid()) - self._mark
            check(i)
            if i >= self.args.warmup:
                self.bytes.append(moved)
        times, per = common.timed_loop(step, prepare, checked, self.args.steps, self.args.warmup, synced)
        return {"times": times, **per, "tcp_bytes": self.bytes, "unique_rows": self.unique,
                "union_rows": self.union, "rss_start_mb": self.base_rss,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **(extra or {})}

    def expected(self, i: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The sample of rows to check and every worker's summed count of each at
        step ``i``; records the unique counts."""
        sample = self.batches.sample
        total, union = self.batches.merged_counts(i, sample)
        if i >= self.args.warmup:
            self.unique.append(len(rows))
            self.union.append(union)
        return sample, total


def wrong(what: str, i: int, got, want) -> None:
    bad = np.flatnonzero(~np.isclose(got, want, rtol=1e-5, atol=1e-7))
    if len(bad):
        raise common.WrongResult(f"{what}, step {i}: {len(bad)} of {len(want)} sampled values differ; "
                                 f"first: got {got[bad[0]]!r}, expected {want[bad[0]]!r}")


# ---------------------------------------------------------------- ours

def run_ours(args) -> dict:
    import kvstore
    from kvstore import RowInit, RowSparse
    from kvstore import optimizer as kvopt
    kv = kvstore.create("dist_sync")
    assert isinstance(kv, kvstore.KVStore)   # a built-in store type
    batches = Batches(args, kv.num_workers)
    steps = Steps(args, batches, kv.barrier)
    kv.init(KEY, RowInit("zeros", 0.0, (args.rows, args.dim)))
    opt = kvopt.SGD(learning_rate=args.lr) if args.optimizer == "sgd" else kvopt.Adam(learning_rate=args.lr)
    kv.set_optimizer(opt)
    shape = (args.rows, args.dim)
    cur: dict[str, Any] = {}               # this step's gradient, output, rows and stats
    last: dict[int, float] = {}            # Adam: row -> its value after the last step
    cumulative: dict[int, int] = {}        # SGD: row -> every worker's count so far

    def prepare(i):
        rows, counts = batches.of(kv.rank, i)
        cur.update(grad=RowSparse(batches.gradient(counts), rows, shape), out=RowSparse.zeros(shape),
                   rows=rows, stats=kv.comm_stats())

    def step(i):
        kv.push(KEY, cur["grad"])
        kv.row_sparse_pull(KEY, out=cur["out"], row_ids=cur["rows"])

    comm: dict[str, list[int]] = {"comm_sent": [], "comm_received": []}

    def check(i):
        stats = kv.comm_stats()
        if i >= args.warmup:
            comm["comm_sent"].append(stats["bytes_sent"] - cur["stats"]["bytes_sent"])
            comm["comm_received"].append(stats["bytes_received"] - cur["stats"]["bytes_received"])
        out = cur["out"]
        if not np.array_equal(out.indices, cur["rows"]):
            raise common.WrongResult(f"ours, step {i}: pulled rows are not the batch's rows")
        sample, total = steps.expected(i, cur["rows"])
        at = np.searchsorted(out.indices, sample)
        present = at < len(out.indices)
        present[present] = out.indices[at[present]] == sample[present]
        got = out.data[at[present]]
        if args.optimizer == "sgd":        # lazy SGD, no momentum: -lr * GRAD * (counts so far)
            for row, count in zip(sample.tolist(), total.tolist()):
                cumulative[row] = cumulative.get(row, 0) + count
            want = np.array([-args.lr * GRAD * cumulative[r] for r in sample[present].tolist()])
            wrong("ours (sgd)", i, got[:, 0].astype(np.float64), want)
        else:    # Adam: a touched row moves down (every gradient is > 0), by less than 5 lr a step
            rows = sample[present].tolist()
            value = got[:, 0].astype(np.float64)
            if not ((value < 0) & (value > -5 * args.lr * (i + 1))).all():
                raise common.WrongResult(f"ours (adam), step {i}: touched rows hold {value.min()} .. "
                                         f"{value.max()}, not in (-5 lr (i + 1), 0)")
            moved = np.array([last.get(r, np.nan) for r in rows]) - value    # hot rows: every step
            moved = moved[~np.isnan(moved)]
            if not ((moved > 0) & (moved < 5 * args.lr)).all():
                raise common.WrongResult(f"ours (adam), step {i}: a row moved by {moved.min()} .. "
                                         f"{moved.max()} since the last step, not in (0, 5 lr)")
            last.clear()
            last.update(zip(rows, value.tolist()))
        if not (got == got[:, :1]).all():
            raise common.WrongResult(f"ours, step {i}: the columns of a row differ")

    result = steps.run(prepare, step, check, comm)
    kv.close()
    return result if kv.rank == 0 else {}


# ---------------------------------------------------------------- gloo

def run_gloo(args) -> dict:
    import torch
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=os.environ["BENCH_INIT_METHOD"], rank=rank, world_size=world)
    batches = Batches(args, world)
    steps = Steps(args, batches, dist.barrier)
    weight = torch.nn.Parameter(torch.zeros(args.rows, args.dim))
    opt = torch.optim.SGD([weight], lr=args.lr)
    dense_grad = torch.zeros(args.rows, args.dim) if args.contender == "dense" else None
    cur = {}

    def prepare(i):
        rows, counts = batches.of(rank, i)
        rows_t, data = torch.from_numpy(rows), torch.from_numpy(batches.gradient(counts))
        if dense_grad is not None:     # what backward leaves in a dense gradient (not timed)
            dense_grad.zero_()
            dense_grad.index_copy_(0, rows_t, data)
            cur["grad"] = dense_grad
        else:
            cur["grad"] = torch.sparse_coo_tensor(rows_t[None], data, (args.rows, args.dim))
        cur.update(rows=rows, rows_t=rows_t)

    def step(i):
        grad = cur["grad"]
        dist.all_reduce(grad)
        weight.grad = grad
        opt.step()
        cur["looked_up"] = weight.detach().index_select(0, cur["rows_t"])

    def check(i):
        sample, total = steps.expected(i, cur["rows"])
        grad = cur["grad"]
        got = grad[torch.from_numpy(sample)] if dense_grad is not None else _rows_of_coo(grad, sample)
        wrong(f"gloo {args.contender}", i, got[:, 0].double().numpy(), total * GRAD)

    result = steps.run(prepare, step, check, {"torch": torch.__version__})
    dist.barrier()
    dist.destroy_process_group()
    return result if rank == 0 else {}


def _rows_of_coo(coo, sample: np.ndarray):
    """Rows ``sample`` of a sparse COO (R, D) tensor as a dense (len(sample), D) tensor."""
    import torch
    coo = coo.coalesce()
    rows, values = coo.indices()[0].numpy(), coo.values()
    at = np.searchsorted(rows, sample).clip(0, max(len(rows) - 1, 0))
    hit = torch.from_numpy((rows[at] == sample) if len(rows) else np.zeros(len(sample), bool))
    return torch.where(hit[:, None], values[torch.from_numpy(at)], torch.zeros(()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contender", choices=("ours", "dense", "sparse"), required=True)
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, required=True, help="ids per worker per step")
    p.add_argument("--zipf", type=float, required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    result = run_ours(args) if args.contender == "ours" else run_gloo(args)
    if result:
        common.write_json(args.out, {"args": vars(args), **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
