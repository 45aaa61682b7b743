"""``python -m benchmarks.trainer``: :func:`benchmarks.trainer.run.main`."""

import sys

from benchmarks.trainer.run import main

sys.exit(main())
