"""``python -m benchmarks.deterministic``: :func:`benchmarks.deterministic.run.main`."""

import sys

from benchmarks.deterministic.run import main

sys.exit(main())
