"""The benchmarks: one package per experiment (``python -m benchmarks.NAME``: its run.py,
workers and report) over a shared harness (benchmarks.harness); results under
benchmarks/results. docs/architecture.md, "Benchmarks", lists them; docs/performance.md
has their commands and results."""
