"""``python -m benchmarks.straggler``: :func:`benchmarks.straggler.run.main`."""

import sys

from benchmarks.straggler.run import main

sys.exit(main())
