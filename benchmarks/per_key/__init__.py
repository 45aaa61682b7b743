"""The Python a call costs per key on each end, measured on the CPU: a worker's and
its servers' CPU time per ``pushpull``, in one process (the scheduler, the servers and
the workers as threads over real sockets and shared memory), so each thread's CPU
clock says what its end spent.

    python -m benchmarks.per_key --help

- run.py: the command, its comparison of checkouts and its report
- job.py: one measured job (run in a process of its own, on the checkout measured)
"""
