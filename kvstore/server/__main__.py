"""``python -m kvstore.server``: run one parameter server (normally started by a
launcher, which sets the KVSTORE_* environment; see docs/configuration.md)."""

import logging
import os
import sys

from ..config import Config
from ..errors import ConfigError
from . import run


def main() -> int:
    try:
        config = Config.from_env(os.environ)
    except ConfigError as e:
        print(f"kvstore.server: {e}", file=sys.stderr)
        return 2
    rank = "?" if config.rank is None else config.rank
    logging.basicConfig(level=config.log_level.upper(),
                        format=f"%(asctime)s [server:{rank}] %(levelname)s %(message)s")
    try:
        return run(config)
    except ConfigError as e:
        logging.error("%s", e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
