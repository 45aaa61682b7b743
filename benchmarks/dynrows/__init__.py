"""Dynamic rows under a long id stream: memory, evictions and step time of a
kvstore.DynamicRows table.

    python -m benchmarks.dynrows --help

- run.py: the command; its workers are the same module (``--worker-args``)
"""
