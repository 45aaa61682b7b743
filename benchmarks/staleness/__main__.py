"""``python -m benchmarks.staleness``: :func:`benchmarks.staleness.run.main`."""

import sys

from benchmarks.staleness.run import main

sys.exit(main())
