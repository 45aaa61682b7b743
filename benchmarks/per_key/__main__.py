"""``python -m benchmarks.per_key``: :func:`benchmarks.per_key.run.main`."""

import sys

from benchmarks.per_key.run import main

sys.exit(main())
