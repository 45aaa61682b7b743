"""Worker scripts for the launcher's own tests (tests/launchers/test_launcher.py).

    python launcher_cases.py MODE
chatty: print 20,000 lines after init (more than any pipe holds), then close.
ignore-term: ignore SIGTERM, print 'ready', wait forever (never joins the job).
grandchild-group / grandchild-session / grandchild-setsid: start a grandchild that
    waits forever (in this process's group / in a group of its own, same session /
    in a session of its own: setsid()), print 'grandchild PID', then init, close and
    exit 0 (rank 1: exit 3 if argv[2] == 'fail'; with argv[2] == 'hang', rank 1 exits 3
    right after init, without closing, while rank 0 waits until the teardown stops it).
threads: print 'threads OMP MKL' (the environment's values, '-' if unset or empty),
    then init and close.
systemexit / exception: rank 1 ends with SystemExit(1) / RuntimeError right after
    init; rank 0 waits at a barrier.
absent: after init, rank 1 waits forever (heartbeats go on) while the others call
    barrier(): theirs times out (KVSTORE_TIMEOUT) naming rank 1.
"""

import os
import signal
import subprocess
import sys
import threading

mode = sys.argv[1]

if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ready", flush=True)
    while True:
        signal.pause()

import numpy as np  # noqa: E402

import kvstore  # noqa: E402

if mode.startswith("grandchild"):
    leave = {"grandchild-session": "os.setpgid(0, 0); ", "grandchild-setsid": "os.setsid(); "}
    child = subprocess.Popen([sys.executable, "-c",
                              f"import os, signal; {leave.get(mode, '')}print('grandchild', os.getpid(), "
                              "flush=True); signal.pause()"], stdout=subprocess.PIPE, text=True)
    print(child.stdout.readline().strip(), "ready", flush=True)   # it exists, in its group

if mode == "threads":
    print("threads", os.environ.get("OMP_NUM_THREADS") or "-",
          os.environ.get("MKL_NUM_THREADS") or "-", flush=True)

kv = kvstore.create("dist_sync")
kv.init(0, np.zeros(3, np.float32))

if mode == "chatty":
    for i in range(20_000):
        print(f"line {i} " + "x" * 60)
    sys.stdout.flush()
if mode == "systemexit" and kv.rank == 1:
    raise SystemExit(1)
if mode == "exception" and kv.rank == 1:
    raise RuntimeError("boom in worker 1")
if mode.startswith("grandchild") and sys.argv[2:] == ["hang"]:
    if kv.rank == 1:
        os._exit(3)   # no clean close: the launcher sees the exit first and tears down
    threading.Event().wait()   # alive, its grandchild below it, until the teardown
if mode == "absent" and kv.rank == 1:
    threading.Event().wait()   # alive and heartbeating, but never at the barrier
if mode in ("systemexit", "exception", "absent"):
    kv.barrier()
kv.close()
if mode.startswith("grandchild") and kv.rank == 1 and sys.argv[2:] == ["fail"]:
    sys.exit(3)
