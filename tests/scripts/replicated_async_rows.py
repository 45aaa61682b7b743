"""Row-sparse and dynamic keys in dist_async on replicated servers
(KVSTORE_REPLICAS=1): every worker pushes integer row-sparse gradients to a
row-sparse table (rows over every server) and to a dynamic table under
SGD(learning_rate=1), lazy (float32 sums of small integers are exact), so each
final row is exactly its initial value (0) minus every push of it, each counted
once. With KILL=R:S (as tests/scripts/replicated.py) worker 0 sends server R
SIGKILL right after its pushes of step S and goes on (REBUILT=S, with
--restart-servers: first it waits until a replacement holds a complete replica of
every share). After a barrier every worker pulls both tables and prints
``exact`` if every push was applied exactly once, else how many values differ.

    python -m tracker.local -n 2 -s 3 python replicated_async_rows.py     (KVSTORE_REPLICAS=1)
"""


import numpy as np

import kvstore
from kvstore import optimizer as opt

from replicated import kill_at, kills_by_step  # tests/scripts/replicated.py, beside this file

STEPS, ROWS, WIDTH = 30, 200, 3
SPEC = kvstore.DynamicRows(WIDTH)        # rows made at 0 by their first push, never evicted


def rows_of(step: int, rank: int) -> np.ndarray:
    return np.unique((np.arange(20) * 13 + step * 7 + rank * 3) % ROWS)


def ids_of(step: int, rank: int) -> np.ndarray:
    """Large ids, spread over the servers by their hash; some pushed by both workers."""
    return np.unique((np.arange(10, dtype=np.int64) + step * 3 + rank * 5) * 7_919 + (1 << 40))


def amount(step: int, rank: int) -> float:
    return float((rank + 1) * (step % 5 + 1))


def main() -> None:
    kills = kills_by_step()
    kv = kvstore.create("dist_async")
    kv.init("emb", kvstore.RowInit("zeros", 0.0, (ROWS, WIDTH)))
    kv.init("dyn", SPEC)
    kv.set_optimizer(opt.SGD(learning_rate=1.0))
    for step in range(STEPS):
        rows, ids, value = rows_of(step, kv.rank), ids_of(step, kv.rank), amount(step, kv.rank)
        kv.push("emb", kvstore.RowSparse(np.full((len(rows), WIDTH), value, np.float32), rows, (ROWS, WIDTH)))
        kv.push("dyn", kvstore.RowSparse(np.full((len(ids), WIDTH), value, np.float32), ids, SPEC.shape))
        kill_at(kv, step, kills)
    kv.barrier()
    want_rows = np.zeros((ROWS, WIDTH), np.float64)
    want_ids: dict[int, float] = {}
    for step in range(STEPS):
        for rank in range(kv.num_workers):
            want_rows[rows_of(step, rank)] -= amount(step, rank)
            for i in ids_of(step, rank):
                want_ids[int(i)] = want_ids.get(int(i), 0.0) - amount(step, rank)
    table = np.empty((ROWS, WIDTH), np.float32)
    kv.row_sparse_pull("emb", out=table, row_ids=np.arange(ROWS))
    every = np.array(sorted(want_ids), np.int64)
    out = kvstore.RowSparse.zeros(SPEC.shape)
    kv.row_sparse_pull("dyn", out=out, row_ids=every)
    got_ids = np.ascontiguousarray(out.data).reshape(len(every), WIDTH)
    wrong_rows = int(np.count_nonzero(table != want_rows))
    wrong_ids = int(np.count_nonzero(got_ids != np.array([want_ids[int(i)] for i in every])[:, None]))
    print("exact" if not wrong_rows and not wrong_ids else
          f"differs: {wrong_rows} row-sparse values, {wrong_ids} dynamic values", flush=True)
    kv.close()


if __name__ == "__main__":
    main()
