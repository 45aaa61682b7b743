"""A big embedding table on dedicated server hosts over emulated links.

    python -m benchmarks.sparse_link --help

- run.py: the command (its workers: benchmarks/harness/sparse_worker.py's ours)
"""
