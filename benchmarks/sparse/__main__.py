"""``python -m benchmarks.sparse``: :func:`benchmarks.sparse.run.main`."""

import sys

from benchmarks.sparse.run import main

sys.exit(main())
