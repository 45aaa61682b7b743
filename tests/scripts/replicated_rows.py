"""Row-sparse keys on replicated servers (KVSTORE_REPLICAS=1): a dist_sync loop
pushing a row-sparse gradient of an embedding table (rows placed over every
server, lazy Adam on the servers) beside a dense key, a dense key pushed
row-sparse gradients (updated lazily: only the rows named change) and an
``assign_rows`` after step 3. With KILL=R:S (as tests/scripts/replicated.py) worker 0 sends server
R SIGKILL right after its pushes of step S, before the pulls (so that step's
rounds are open or unanswered when it dies). SAVE=S: save_checkpoint after step
S; STOP=S: the job ends after step S (resumed with --resume from the checkpoint's
step). Prints a digest of the final table and dense weights.

    python -m tracker.local -n 2 -s 3 python replicated_rows.py     (KVSTORE_REPLICAS=1)
"""

import hashlib
import os
import signal

import numpy as np

import kvstore
from kvstore import optimizer as opt
from job_processes import server_pid
from replicated import kills_by_step      # tests/scripts/, this script's folder

STEPS, ROWS, WIDTH = 10, 600, 4


def main() -> None:
    kills = kills_by_step()
    kv = kvstore.create("dist_sync")
    start = kv.resume_meta.get("step", 0) if kv.resumed else 0
    print(f"resumed={kv.resumed} start={start}", flush=True)      # (init keeps a resumed job's values)
    kv.init("emb", kvstore.RowInit("normal", 0.1, (ROWS, WIDTH), seed=5))
    kv.init("w", np.linspace(-1, 1, 2000, dtype=np.float32))
    kv.init("d", np.linspace(1, 2, 300 * WIDTH, dtype=np.float32).reshape(300, WIDTH))   # cut over servers
    kv.set_optimizer(opt.Adam(learning_rate=0.01))
    w = np.empty(2000, np.float32)
    table = np.empty((ROWS, WIDTH), np.float32)
    d = np.empty((300, WIDTH), np.float32)
    save, stop = int(os.environ.get("SAVE", -1)), int(os.environ.get("STOP", STEPS))
    for step in range(start, STEPS):
        rows = np.unique((np.arange(40) * 37 + step * 11 + kv.rank * 5) % ROWS)
        grad = np.cos(rows[:, None] * 0.1 + np.arange(WIDTH) + step).astype(np.float32)
        kv.push("emb", kvstore.RowSparse(grad, rows, (ROWS, WIDTH)))
        kv.push("w", np.sin(np.arange(2000, dtype=np.float32) * (kv.rank + 1) + step).astype(np.float32))
        named = np.unique((np.arange(9) * 31 + step * 7 + kv.rank) % 300)
        kv.push("d", kvstore.RowSparse(np.sin(named[:, None] + np.arange(WIDTH) * 0.5 + step).astype(np.float32),
                                       named, (300, WIDTH)))
        if kv.rank == 0:
            for server in kills.get(step, ()):
                os.kill(server_pid(server), signal.SIGKILL)
                print(f"killed server {server} at step {step}", flush=True)
        kv.row_sparse_pull("emb", out=table, row_ids=np.arange(ROWS))
        kv.pull("w", out=w)
        kv.pull("d", out=d)
        if step == 3:
            kv.barrier()                  # every round of step 3 applied: assign between steps
            if kv.rank == 0:
                some = np.arange(0, ROWS, 7)
                kv.assign_rows("emb", kvstore.RowSparse(np.full((len(some), WIDTH), 0.5, np.float32), some,
                                                        (ROWS, WIDTH)))
            kv.barrier()
        if step == save:
            kv.save_checkpoint({"step": step + 1})
        print(f"step {step} done", flush=True)
        if step == stop:
            kv.close()
            return
    kv.row_sparse_pull("emb", out=table, row_ids=np.arange(ROWS))
    kv.pull("w", out=w)
    kv.pull("d", out=d)
    print("digest", hashlib.sha256(table.tobytes() + w.tobytes() + d.tobytes()).hexdigest(), flush=True)
    kv.close()


if __name__ == "__main__":
    main()
