"""Accuracy after a fixed time with a straggler (the README's Fashion-MNIST job, one worker
slowed by benchmarks.harness.throttle).

    python -m benchmarks.straggler --help

- run.py: the command
- report.py: reading the workers' logs, the tables
"""
