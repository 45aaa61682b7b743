"""dist_async on replicated servers (KVSTORE_REPLICAS=1): every worker pushes
integer gradients under SGD(learning_rate=1) (float32 sums of small integers are
exact), so the final value is exactly the initial one minus every push, each
counted once. With KILL=R:S worker 0 sends server R SIGKILL right after its push
of step S and goes on (REBUILT=S, with --restart-servers: first it waits until a
replacement holds a complete replica of every share). After a barrier every worker pulls and prints ``exact`` if
every push was applied exactly once, else the difference.

    python -m tracker.local -n 2 -s 3 python replicated_async.py     (KVSTORE_REPLICAS=1)
"""


import numpy as np

import kvstore
from kvstore import optimizer as opt

from replicated import kill_at, kills_by_step  # tests/scripts/replicated.py, beside this file

STEPS = 40
SIZES = {"w": 3000, "b": 7}

kills = kills_by_step()
kv = kvstore.create("dist_async")
keys = list(SIZES)
kv.init(keys, [np.zeros(n, np.float32) for n in SIZES.values()])
kv.set_optimizer(opt.SGD(learning_rate=1.0))
for step in range(STEPS):
    kv.push(keys, [np.full(n, (kv.rank + 1) * (step % 5 + 1), np.float32) for n in SIZES.values()])
    kill_at(kv, step, kills)
kv.barrier()
outs = [np.empty(n, np.float32) for n in SIZES.values()]
kv.pull(keys, out=outs)
want = -float(sum(w + 1 for w in range(kv.num_workers)) * sum(s % 5 + 1 for s in range(STEPS)))
wrong = [float(o[0]) - want for o in outs if not np.all(o == want)]
print("exact" if not wrong else f"differs by {wrong} pushes' worth", flush=True)
kv.close()
