"""``python -m benchmarks.techniques``: :func:`benchmarks.techniques.run.main`."""

import sys

from benchmarks.techniques.run import main

sys.exit(main())
