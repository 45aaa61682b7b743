"""Sparse embeddings: a big table's training step with ours (row-sparse keys) against torch's
dense and sparse ways on one host.

    python -m benchmarks.sparse --help

- run.py: the command
- worker.py: one worker, every contender (also run by benchmarks.sparse_link)
"""
