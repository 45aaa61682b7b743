"""``python -m benchmarks.emulated_ipc``: :func:`benchmarks.emulated_ipc.run.main`."""

import sys

from benchmarks.emulated_ipc.run import main

sys.exit(main())
