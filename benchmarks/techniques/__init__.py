"""Before and after of each data-path technique: launches of benchmarks.pushpull, interleaved
in one session.

    python -m benchmarks.techniques --help

- run.py: the command
"""
