"""dist_ssp on replicated servers (KVSTORE_REPLICAS=1), staleness S
(KVSTORE_STALENESS, default 1), 2 workers: integer gradients under
SGD(learning_rate=1) (float32 sums of small integers are exact): worker 0 pushes
1 and worker 1 pushes 1000 per step, so every value read is -(n0 + 1000 n1), n_r
the pushes of worker r applied to its chunk. Each read (a pushpull's reply on odd
steps, a pull after the push on even ones) at a worker's clock c (its pushes, this
step's included) must show n_own == c and n_other >= c - S (the bound).

With KILL=R (KILL_SIGNAL, default SIGKILL; SIGSTOP: found by heartbeats) the
failover happens while worker 0 is exactly as far ahead as the bound lets it be:
after HELD steps worker 1 stops (it writes EVENTS/held and waits for
EVENTS/release); worker 0 takes S more steps (no read waits), then its next read
must wait for worker 1. MOMENT=before: worker 0 stops server R first, so that read's
requests to R are sent again to the promoted backup and its push applied there;
MOMENT=during: a thread of worker 0 stops server R once that read's request is on
its way to R (R has usually applied it, replicated it and parked the read: sent
again, the push is not applied twice and the read waits again). Worker 1 is
released once worker 0's client has routed to the promoted backup (its requests to R
sent again), so that a promoted server that let the read through early (clocks
not replicated) is caught by the bound. After a barrier every worker pulls and
prints ``exact`` if every push was applied exactly once, else the counts; a read
that broke the bound prints ``bound broken`` and ends the worker with an error.

    python -m tracker.local -n 2 -s 3 python replicated_ssp.py     (KVSTORE_REPLICAS=1)
"""

import os
import signal
import threading
import time

import numpy as np

import kvstore
from kvstore import optimizer as opt

from job_processes import server_pid   # tests/scripts/, beside this file

STEPS, HELD = 12, 4
SIZES = {"w": 3000, "b": 7}
PUSHED = (1, 1000)                      # each worker's gradient, every step
DEADLINE = 60.0


def wait_for(what, deadline: float = DEADLINE) -> None:
    """Wait until ``what()`` is true (another process's doing), or fail loudly."""
    end = time.monotonic() + deadline
    while not what():
        if time.monotonic() > end:
            raise TimeoutError(f"{what.__doc__ or what} did not happen within {deadline}s")
        time.sleep(0.005)   # a bounded poll of another process's marker file: no event to wait on


def counts(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n0, n1) per value: the pushes of each worker in it."""
    total = -values.astype(np.int64)
    return total % PUSHED[1], total // PUSHED[1]


def check(kv, outs, clock: int, bound: int) -> None:
    for out in outs:
        n = counts(out)
        own, other = n[kv.rank], n[1 - kv.rank]
        if not (np.all(own == clock) and np.all(other >= clock - bound) and np.all(other <= STEPS)):
            print(f"bound broken: worker {kv.rank} at clock {clock} read its pushes {sorted(set(own.tolist()))} "
                  f"and the other's {sorted(set(other.tolist()))} (staleness {bound})", flush=True)
            raise SystemExit(1)


def main() -> None:
    bound = int(os.environ.get("KVSTORE_STALENESS", "1"))
    events = os.environ["EVENTS"]
    held, release = os.path.join(events, "held"), os.path.join(events, "release")
    victim = os.environ.get("KILL")
    how = getattr(signal, os.environ.get("KILL_SIGNAL", "SIGKILL"))
    kv = kvstore.create("dist_ssp", staleness=bound)
    keys = list(SIZES)
    kv.init(keys, [np.zeros(n, np.float32) for n in SIZES.values()])
    kv.set_optimizer(opt.SGD(learning_rate=1.0))
    client = kv._client                 # (a test script: the worker's own client, for its routing)
    outs = [np.empty(n, np.float32) for n in SIZES.values()]
    kill_at = HELD + bound              # worker 0's first step whose read waits for worker 1

    def stop_server() -> None:
        os.kill(server_pid(int(victim)), how)
        print(f"killed server {victim} before the read of step {kill_at} ({os.environ.get('MOMENT')})", flush=True)

    def failed_over() -> bool:
        """worker 0's client routed to the promoted backup"""
        return client.failover.epoch > 0

    def during() -> None:
        def on_its_way() -> bool:
            """worker 0's read of the bound's step sent to server R"""
            return any(r.server == int(victim) and "pull" in r.what for r in list(client._pending.values()))
        wait_for(on_its_way)
        stop_server()

    for step in range(STEPS):
        if kv.rank == 1 and step == HELD:
            open(held, "w").close()
            wait_for(lambda: os.path.exists(release))
        if kv.rank == 0 and step == kill_at:
            wait_for(lambda: os.path.exists(held))
            if victim is not None:
                if os.environ.get("MOMENT") == "during":
                    threading.Thread(target=during, daemon=True).start()
                else:
                    stop_server()

                def released() -> None:
                    wait_for(failed_over)
                    open(release, "w").close()
                threading.Thread(target=released, daemon=True).start()
            else:
                open(release, "w").close()
        grads = [np.full(n, PUSHED[kv.rank], np.float32) for n in SIZES.values()]
        if step % 2:
            kv.pushpull(keys, grads, out=outs)
        else:
            kv.push(keys, grads)
            kv.pull(keys, out=outs)
        check(kv, outs, step + 1, bound)
    kv.barrier()
    kv.pull(keys, out=outs)
    applied = [counts(o) for o in outs]
    exact = all(np.all(n0 == STEPS) and np.all(n1 == STEPS) for n0, n1 in applied)
    print("exact" if exact else f"not exact: {[(sorted(set(a.tolist())), sorted(set(b.tolist()))) for a, b in applied]}",
          flush=True)
    kv.close()


if __name__ == "__main__":
    main()
