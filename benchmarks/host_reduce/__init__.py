"""Summing on the host before pushing (KVSTORE_HOST_REDUCE) over emulated links, several
workers per host.

    python -m benchmarks.host_reduce --help

- run.py: the command, its wire model and report (the jobs: benchmarks.harness.exchange)
"""
