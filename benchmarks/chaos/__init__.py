"""Chaos: short jobs, each with one random fault (kills, stops, signals, partitions, faults in
start-up, checkpoints, resume and teardown); every run must end cleanly.

    python -m benchmarks.chaos --help

- run.py: the command, the mid-run faults, the table
- phases.py: the faults in the other phases of a job's life
- replicated.py: ``--replicated``, faults of a server that replicated jobs must survive
- jobs.py: starting a job through a launcher, its outcome, leftover processes
- worker.py: the workload of the mid-run faults (exact sums every round)
- train.py: the workload of the phase faults (deterministic training, checkpoints)
- replicated_worker.py: the workload of ``--replicated`` (deterministic dist_sync, exact dist_async)
"""
