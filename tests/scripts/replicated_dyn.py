"""Dynamic rows (kvstore.DynamicRows) on replicated servers (KVSTORE_REPLICAS=1): a
dist_sync loop pushing row-sparse gradients of a dynamic table (ids in [0, 2**63)
hashed to the servers, lazy Adam on the servers, a row budget with eviction and
eviction by age, so rows are created and evicted every few steps). With KILL=R:S
(as tests/scripts/replicated.py) worker 0 sends server R SIGKILL right after its
pushes of step S, before the pulls (so that step's rounds are open or unanswered
when it dies). REBUILT=S (with --restart-servers): before its kills of step S
worker 0 waits until a replacement's rebuild made every replica complete again
(tests/scripts/replicated.py). Prints a digest of the final table (every id ever pushed, pulled:
an evicted row reads as its initial value) and of the counters that the rows
decide (rows, created, evicted by age and by budget, rounds, updates).

    python -m tracker.local -n 2 -s 3 python replicated_dyn.py     (KVSTORE_REPLICAS=1)
"""

import hashlib

import numpy as np

import kvstore
from kvstore import optimizer as opt
from replicated import kill_at, kills_by_step      # tests/scripts/, this script's folder

STEPS, WIDTH = 12, 4
SPEC = kvstore.DynamicRows(WIDTH, init=("normal", 0.1), seed=7, budget=14, evict_after=3)


def ids_of(step: int, rank: int) -> np.ndarray:
    """A worker's ids of a step: some hot (every step), some of this step only; large ids."""
    hot = np.arange(8, dtype=np.int64) * 1_000_003
    cold = (np.arange(12, dtype=np.int64) + step * 12 + rank * 5) * 7_919 + (1 << 40)
    return np.unique(np.concatenate([hot, cold]))


def main() -> None:
    kills = kills_by_step()
    kv = kvstore.create("dist_sync")
    kv.init("emb", SPEC)
    kv.set_optimizer(opt.Adam(learning_rate=0.01, lazy_update=True))
    seen = set()
    for step in range(STEPS):
        ids = ids_of(step, kv.rank)
        grad = np.cos(ids[:, None] % 1000 * 0.1 + np.arange(WIDTH) + step).astype(np.float32)
        kv.push("emb", kvstore.RowSparse(grad, ids, SPEC.shape))
        kill_at(kv, step, kills)
        kv.row_sparse_pull("emb", out=kvstore.RowSparse.zeros(SPEC.shape), row_ids=ids)
        seen |= {int(i) for r in range(2) for i in ids_of(step, r)}
        print(f"step {step} done", flush=True)
    every = np.array(sorted(seen), np.int64)
    out = kvstore.RowSparse.zeros(SPEC.shape)
    kv.row_sparse_pull("emb", out=out, row_ids=every)
    table = np.ascontiguousarray(out.data)
    stats = kv.row_stats("emb")
    counted = [stats[k] for k in ("rows", "created", "evicted_by_age", "evicted_by_budget", "rounds", "updates")]
    print(f"counters {counted}", flush=True)
    print("digest", hashlib.sha256(every.tobytes() + table.tobytes() + str(counted).encode()).hexdigest(), flush=True)
    kv.close()


if __name__ == "__main__":
    main()
