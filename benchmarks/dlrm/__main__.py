"""``python -m benchmarks.dlrm``: :func:`benchmarks.dlrm.run.main` (as ``python -m benchmarks.dlrm.run``)."""

import sys

from benchmarks.dlrm.run import main

sys.exit(main())
