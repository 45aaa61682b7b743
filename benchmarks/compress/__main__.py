"""``python -m benchmarks.compress``: :func:`benchmarks.compress.run.main`."""

import sys

from benchmarks.compress.run import main

sys.exit(main())
