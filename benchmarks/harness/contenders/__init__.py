"""The contenders of benchmarks/pushpull/run.py. Each module has ``run(cfg, launch)``
returning result rows (dicts) or raising :class:`benchmarks.harness.contenders.base.Skip`."""
