"""``python -m benchmarks.pushpull``: :func:`benchmarks.pushpull.run.main`."""

import sys

from benchmarks.pushpull.run import main

sys.exit(main())
