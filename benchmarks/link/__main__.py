"""``python -m benchmarks.link``: :func:`benchmarks.link.run.main`."""

import sys

from benchmarks.link.run import main

sys.exit(main())
