"""The contenders of benchmarks/pushpull.py. Each module has ``run(cfg, launch)``
returning result rows (dicts) or raising :class:`benchmarks.contenders.base.Skip`."""
