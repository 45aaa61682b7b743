"""``python benchmarks/harness/contenders/server_wrapper.py``: run kvstore's own server
(``kvstore.server.__main__.main``, unchanged) and, at its exit, write its CPU time
and page faults (and, with BENCH_SERVER_PROFILE=1, a cProfile dump) to
``$BENCH_SERVER_STATS/server-<rank>.{json,prof}``. Used as the launcher's
server command so the benchmark can tell where a server's time goes."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from benchmarks.harness import common  # noqa: E402
from kvstore.server.__main__ import main  # noqa: E402


def run() -> int:
    where = os.environ.get("BENCH_SERVER_STATS")
    rank = os.environ.get("KVSTORE_RANK", "x")
    usage = common.Usage()
    prof = None
    if where and os.environ.get("BENCH_SERVER_PROFILE") == "1":
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    try:
        return main()
    finally:
        if prof is not None:
            assert where is not None   # a profile is taken only with a directory to write it to
            prof.disable()
            prof.dump_stats(os.path.join(where, f"server-{rank}.prof"))
        if where:
            common.write_json(os.path.join(where, f"server-{rank}.json"), usage.since())


if __name__ == "__main__":
    sys.exit(run())
