"""``python -m benchmarks.chaos``: :func:`benchmarks.chaos.run.main`."""

import sys

from benchmarks.chaos.run import main

sys.exit(main())
