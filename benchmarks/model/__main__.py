"""``python -m benchmarks.model``: :func:`benchmarks.model.run.main`."""

import sys

from benchmarks.model.run import main

sys.exit(main())
