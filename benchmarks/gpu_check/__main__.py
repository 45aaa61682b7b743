"""``python -m benchmarks.gpu_check``: :func:`benchmarks.gpu_check.run.main`."""

import sys

from benchmarks.gpu_check.run import main

sys.exit(main())
