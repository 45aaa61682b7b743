"""``python -m benchmarks.failover``: :func:`benchmarks.failover.run.main`."""

import sys

from benchmarks.failover.run import main

sys.exit(main())
