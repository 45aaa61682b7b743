"""What deterministic sums (KVSTORE_DETERMINISTIC=1) cost against arrival order.

    python -m benchmarks.deterministic --help

- run.py: the command
"""
