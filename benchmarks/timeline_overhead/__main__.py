"""``python -m benchmarks.timeline_overhead``: :func:`benchmarks.timeline_overhead.run.main`."""

import sys

from benchmarks.timeline_overhead.run import main

sys.exit(main())
