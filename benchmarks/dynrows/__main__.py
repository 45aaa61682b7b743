"""``python -m benchmarks.dynrows``: :func:`benchmarks.dynrows.run.main`."""

import sys

from benchmarks.dynrows.run import main

sys.exit(main())
