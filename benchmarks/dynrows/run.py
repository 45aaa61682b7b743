"""Dynamic rows under a long id stream: a table of kvstore.DynamicRows trained on
ids drawn from a Zipf law over the 2**63 id space, staying under its row budget.

    python -m benchmarks.dynrows                               # 1e9 ids, W=2, S=2 (dist_sync)
    python -m benchmarks.dynrows --ids 2e6 --budget 20000      # small, for tests

Each worker draws --batch ids a step: ranks from numpy's Zipf law (--zipf), each
rank mapped to an id by splitmix64 (then >> 1: an int64 in [0, 2**63)), so the hot
ids are scattered over the whole id space as real ids (users, crosses) are. A step
is row_sparse_pull of the batch's unique ids, then a push of their gradient (each
row: its count in the batch times 0.01, every column), lazy SGD on the servers. Every
--report-every steps worker 0 reads kv.row_stats: rows per server, rows made,
evicted (by budget, by age), the hit rate of the pulls (ids that had a row), and
the elapsed time; the run ends after --ids ids over all workers.

Writes <name>.json (every report) and <name>.md (the table) to --out-dir (default: a new
scratch directory; ``--record``: benchmarks/results/dynrows).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import click
import numpy as np

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    __package__ = "benchmarks.dynrows"

from benchmarks.harness.output import ResultsDir  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUTPUT = ResultsDir("dynrows", "dynrows")
_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def zipf_ids(rng: np.random.Generator, count: int, a: float) -> np.ndarray:
    """``count`` ids: Zipf(a) ranks (1 the most frequent) scattered by splitmix64 over [0, 2**63)."""
    ranks = np.minimum(rng.zipf(a, count), 1 << 62).astype(np.uint64)
    with np.errstate(over="ignore"):
        z = ranks + np.uint64(_MIX[0])
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX[1])
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX[2])
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(1)).astype(np.int64)


def worker(args: dict) -> None:
    """One worker of the job (started by tracker.local): train, report from rank 0."""
    import kvstore
    from kvstore import DynamicRows, RowSparse

    kv = kvstore.create("dist_sync")
    assert isinstance(kv, kvstore.KVStore)   # a built-in store type
    spec = DynamicRows(args["dim"], init=("normal", 0.01), budget=args["budget"],
                       evict_after=args["evict_after"])
    kv.init("emb", spec)
    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.1))
    rng = np.random.default_rng(args["seed"] * 1000 + kv.rank)
    steps = int(args["ids"] // (args["batch"] * kv.num_workers))
    reports, start = [], time.perf_counter()
    out = RowSparse.zeros(spec.shape)
    for step in range(1, steps + 1):
        ids = zipf_ids(rng, args["batch"], args["zipf"])
        rows, counts = np.unique(ids, return_counts=True)
        kv.row_sparse_pull("emb", out=out, row_ids=rows)
        grad = np.repeat((counts * 0.01).astype(np.float32)[:, None], args["dim"], axis=1)
        kv.push("emb", RowSparse(grad, rows, spec.shape))
        if kv.rank == 0 and (step % args["report_every"] == 0 or step == steps):
            s = kv.row_stats("emb")
            elapsed = time.perf_counter() - start
            reports.append({"step": step, "ids": step * args["batch"] * kv.num_workers, "seconds": elapsed,
                            "rows_per_server": [p["rows"] for p in s["servers"]], "rows": s["rows"],
                            "created": s["created"], "evicted": s["evicted"],
                            "evicted_by_budget": s["evicted_by_budget"], "evicted_by_age": s["evicted_by_age"],
                            "hits": s["hits"], "misses": s["misses"], "hit_rate": s["hit_rate"],
                            "unique_per_step": len(rows)})
            print(f"step {step}/{steps}: {reports[-1]['ids']:.3e} ids, rows/server "
                  f"{reports[-1]['rows_per_server']}, evicted {s['evicted']}, hit rate {s['hit_rate']:.4f}, "
                  f"{step / elapsed:.1f} steps/s", flush=True)
            with open(args["result"] + ".tmp", "w") as f:      # every report, so a stopped run still has them
                json.dump(reports, f)
            os.replace(args["result"] + ".tmp", args["result"])
    kv.barrier()
    kv.close()


def table(reports: list, args: dict, wall: float) -> str:
    last = reports[-1]
    lines = [f"# Dynamic rows: {last['ids']:.3g} ids from Zipf({args['zipf']}) over [0, 2**63)", "",
             f"W={args['workers']} workers, S={args['servers']} servers (dist_sync, tracker.local, one host), "
             f"rows of {args['dim']} fp32, budget {args['budget']} rows per server, evict_after "
             f"{args['evict_after']}, batch {args['batch']} ids per worker per step, lazy SGD. "
             f"Wall time {wall:.0f} s (job start to end); steps/s over the timed loop of worker 0.", "",
             "| ids | steps | rows per server | created | evicted (budget / age) | hit rate (cumulative) | "
             "unique ids per step | steps/s |", "|---|---|---|---|---|---|---|---|"]
    for r in reports:
        lines.append(f"| {r['ids']:.3e} | {r['step']} | {' / '.join(map(str, r['rows_per_server']))} | "
                     f"{r['created']} | {r['evicted']} ({r['evicted_by_budget']} / {r['evicted_by_age']}) | "
                     f"{r['hit_rate']:.4f} | {r['unique_per_step']} | {r['step'] / r['seconds']:.1f} |")
    return "\n".join(lines) + "\n"


@click.command()
@click.option("--ids", type=float, default=1e9, help="ids to stream over all workers")
@click.option("--batch", type=int, default=1 << 16, help="ids per worker per step")
@click.option("--zipf", type=float, default=1.1, help="Zipf exponent (> 1)")
@click.option("--dim", type=int, default=8, help="row width (fp32)")
@click.option("--budget", type=int, default=1_000_000, help="rows per server")
@click.option("--evict-after", type=int, default=None, help="rounds unused before a row is evicted")
@click.option("--workers", type=int, default=2)
@click.option("--servers", type=int, default=2)
@click.option("--report-every", type=int, default=500, help="steps between reports")
@click.option("--seed", type=int, default=0)
@click.option("--name", default="dynrows")
@click.option("--timeout", type=float, default=7200.0, help="seconds before the job is stopped")
@click.option("--worker-args", default=None, hidden=True)
@OUTPUT.click_flags
def main(ids, batch, zipf, dim, budget, evict_after, workers, servers, report_every, seed, name, out_dir,
         record, timeout, worker_args):
    if worker_args is not None:
        worker(json.loads(worker_args))
        return
    if zipf <= 1 or batch < 1 or budget < 1 or ids < batch * workers:
        raise click.BadParameter("need --zipf > 1, --batch >= 1, --budget >= 1 and --ids >= batch x workers")
    out_dir = OUTPUT.click_choose(out_dir, record)
    with tempfile.TemporaryDirectory() as tmp:
        args = {"ids": ids, "batch": batch, "zipf": zipf, "dim": dim, "budget": budget, "evict_after": evict_after,
                "report_every": report_every, "seed": seed, "workers": workers, "servers": servers,
                "result": os.path.join(tmp, "reports.json")}
        cmd = [sys.executable, "-m", "tracker.local", "-n", str(workers), "-s", str(servers), sys.executable,
               "-m", "benchmarks.dynrows", "--worker-args", json.dumps(args)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
        tic = time.perf_counter()
        p = subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout, stdout=sys.stdout, stderr=sys.stderr)
        wall = time.perf_counter() - tic
        if p.returncode != 0:
            raise SystemExit(f"the job failed (exit status {p.returncode})")
        with open(args["result"]) as f:
            reports = json.load(f)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump({"args": {k: v for k, v in args.items() if k != "result"}, "wall_seconds": wall,
                   "reports": reports}, f, indent=1)
    text = table(reports, args, wall)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
