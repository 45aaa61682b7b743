"""``python -m benchmarks.mixed_precision``: :func:`benchmarks.mixed_precision.run.main`."""

import sys

from benchmarks.mixed_precision.run import main

sys.exit(main())
