"""``python -m benchmarks.sparse_link``: :func:`benchmarks.sparse_link.run.main`."""

import sys

from benchmarks.sparse_link.run import main

sys.exit(main())
