"""A dist_sync training loop for replicated servers (KVSTORE_REPLICAS=1): keys cut
into chunks over every server, SGD with momentum and weight decay on the servers.
With KILL=R:S (a server rank and a step, several comma-separated), worker 0 sends
server R SIGKILL (or KILL_SIGNAL, e.g. SIGSTOP) right after its push of step S (so
that step's rounds are open or unanswered when it dies; step -1: between init and
set_optimizer) and goes on. COMPRESS=1: pushes are 2-bit compressed. STATES=path:
worker 0 saves the optimizer states there after step 3 and every worker loads them
after step 6 (load_optimizer_states: a momentum unlike the one the rounds made).
SAVE=S: save_checkpoint({"step": S + 1}) after step S (KVSTORE_CHECKPOINT_DIR set);
STOP=S: every worker ends the job after step S (a resume, --resume, goes on from
the checkpoint's step to the last). REBUILT=S (with --restart-servers): before its
kills of step S worker 0 waits until the servers' book says every share has a
complete replica again (a replacement's rebuild acknowledged). BARRIER=1: every
worker calls kv.barrier() at the end of each step. KILL_SCHEDULER=S:push or
S:barrier (several comma-separated): worker 0 sends the job's scheduler SIGKILL
(or KILL_SCHEDULER_SIGNAL) right after its push of step S, or right before its
barrier of step S (the other worker is usually waiting there already). Prints a
digest of the final weights.

    python -m tracker.local -n 2 -s 3 python replicated.py     (KVSTORE_REPLICAS=1)
"""

import hashlib
import os
import signal
import threading
import time

import numpy as np

import kvstore
from kvstore import optimizer as opt
from job_processes import scheduler_pid, server_pid  # tests/scripts/, this script's folder

STEPS = 10
SIZES = {"w": 3000, "b": 7, "v": 1500}


def kills_by_step() -> dict[int, list[int]]:
    """KILL=R:S[,R:S...] as {step: [server ranks]}."""
    kills: dict[int, list[int]] = {}
    for item in filter(None, os.environ.get("KILL", "").split(",")):
        server, step = item.split(":")
        kills.setdefault(int(step), []).append(int(server))
    return kills


def kill_scheduler(step: int, where: str) -> None:
    """KILL_SCHEDULER=S:where: worker 0 kills the scheduler there."""
    wanted = [item.split(":") for item in filter(None, os.environ.get("KILL_SCHEDULER", "").split(","))]
    if [str(step), where] in wanted:
        pid = scheduler_pid()
        os.kill(pid, getattr(signal, os.environ.get("KILL_SCHEDULER_SIGNAL", "SIGKILL")))
        print(f"killed the scheduler (pid {pid}) at step {step} ({where})", flush=True)


def kill_at(kv, step: int, kills: dict[int, list[int]]) -> None:
    """Worker 0, after its pushes of ``step``: with REBUILT=step, wait for the rebuilt
    replicas first; then send each server KILL names for this step SIGKILL (or
    KILL_SIGNAL)."""
    if kv.rank != 0:
        return
    if step == int(os.environ.get("REBUILT", -2)):
        wait_rebuilt(kv)
    for server in kills.get(step, ()):
        os.kill(server_pid(server), getattr(signal, os.environ.get("KILL_SIGNAL", "SIGKILL")))
        print(f"killed server {server} at step {step}", flush=True)


def wait_rebuilt(kv, deadline: float = 60.0) -> None:
    """Wait (an event: the servers' book the scheduler publishes) until a replacement
    server holds a complete replica of every share: every share has a backup and
    none is being rebuilt."""
    membership = kv._membership          # (a test script: the worker's own link to the scheduler)
    changed = threading.Event()
    end = time.monotonic() + deadline
    while True:
        book = membership.servers
        if book.added and all(b is not None for b in book.backups) and not book.rebuilding:
            print(f"replicas rebuilt: servers' book epoch {book.epoch}, backups {list(book.backups)}", flush=True)
            return
        if time.monotonic() > end:
            raise TimeoutError(f"no complete replicas within {deadline}s: servers' book {book}")
        changed.wait(0.05)   # the book comes with the heartbeat thread: look again shortly


def main() -> None:
    kills = kills_by_step()
    kv = kvstore.create("dist_sync")
    if os.environ.get("COMPRESS"):              # 2-bit gradient compression (error feedback on the workers)
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    keys = list(SIZES)
    start = kv.resume_meta.get("step", 0) if kv.resumed else 0
    print(f"resumed={kv.resumed} start={start} host group={list(kv.host_group)}", flush=True)
    kv.init(keys, [np.linspace(-1, 1, n, dtype=np.float32) for n in SIZES.values()])   # resumed: kept
    if kv.rank == 0:
        for server in kills.get(-1, ()):        # step -1: between init and set_optimizer
            os.kill(server_pid(server), getattr(signal, os.environ.get("KILL_SIGNAL", "SIGKILL")))
            print(f"killed server {server} at step -1", flush=True)
    kv.set_optimizer(opt.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3))
    outs = [np.empty(n, np.float32) for n in SIZES.values()]
    save, stop = int(os.environ.get("SAVE", -1)), int(os.environ.get("STOP", STEPS))
    for step in range(start, STEPS):
        grads = [np.sin(np.arange(n, dtype=np.float32) * (kv.rank + 1) * 0.37 + step).astype(np.float32)
                 for n in SIZES.values()]
        if step % 2:
            kv.pushpull(keys, grads, out=outs)
        else:
            kv.push(keys, grads)
            kill_at(kv, step, kills)
            if kv.rank == 0:
                kill_scheduler(step, "push")
            kv.pull(keys, out=outs)
        states = os.environ.get("STATES")
        if states and step == 3:
            if kv.rank == 0:
                kv.save_optimizer_states(states)
            kv.barrier()
        if states and step == 6:          # every round of step 6 applied (pulled): no round in flight
            kv.load_optimizer_states(states)
            kv.barrier()                  # no push of step 7 before every state is in place
        if step == save:
            kv.save_checkpoint({"step": step + 1})
        if os.environ.get("BARRIER"):
            if kv.rank == 0:
                kill_scheduler(step, "barrier")
            kv.barrier()
        print(f"step {step} done", flush=True)
        if step == stop:
            kv.close()
            return
    kv.pull(keys, out=outs)
    print("digest", hashlib.sha256(b"".join(o.tobytes() for o in outs)).hexdigest(), flush=True)
    kv.close()


if __name__ == "__main__":
    main()
