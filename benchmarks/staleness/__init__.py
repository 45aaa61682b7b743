"""Bounded staleness with a straggler: the step rate of dist_sync, dist_ssp and dist_async.

    python -m benchmarks.staleness --help

- run.py: the command
- worker.py: one worker
"""
