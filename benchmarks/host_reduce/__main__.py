"""``python -m benchmarks.host_reduce``: :func:`benchmarks.host_reduce.run.main`."""

import sys

from benchmarks.host_reduce.run import main

sys.exit(main())
