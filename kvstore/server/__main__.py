"""``python -m kvstore.server``: run one parameter server (normally started by a
launcher, which sets the KVSTORE_* environment; see docs/configuration.md).

    python -m kvstore.server         # configured by the environment only
    python -m kvstore.server -h      # this text
"""

import logging
import os
import sys

from tracker.control import env
from tracker.control.env import LOG_LEVELS

from ..config import Config
from ..errors import ConfigError
from . import run


def main() -> int:
    status = env.entry_point_arguments("kvstore.server", __doc__, sys.argv[1:])
    if status is not None:
        return status
    # A server's torch (the torch.optim twins' steps, imported at the first update)
    # gains nothing from threads on a chunk, and idle OpenMP threads spin on the cores
    # the workers need (benchmarks/trainer measured 92-131 ms of server CPU per step
    # with torch's default threads, 17-19 ms with one). The launchers set it already;
    # this covers a server started by hand. Set OMP_NUM_THREADS to choose.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        config = Config.from_env(os.environ)
    except ConfigError as e:
        print(f"kvstore.server: {e}", file=sys.stderr)
        return 2
    rank = "?" if config.rank is None else config.rank
    level = config.log_level.strip().upper()
    if level not in LOG_LEVELS:
        print(f"error: KVSTORE_LOG_LEVEL={config.log_level} is invalid: use one of "
              f"{', '.join(LOG_LEVELS)} (any case)", file=sys.stderr)
        return 2
    logging.basicConfig(level=level,
                        format=f"%(asctime)s [server:{rank}] %(levelname)s %(message)s")
    try:
        return run(config)
    except ConfigError as e:
        logging.error("%s", e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
