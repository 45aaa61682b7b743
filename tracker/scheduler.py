"""``python -m tracker.scheduler``: run a job's scheduler as its own process.

For jobs started by another launcher (MXNet's ``DMLC_ROLE=scheduler`` process,
Kubernetes, ...). Our own launchers run the scheduler inside the launcher.

    KVSTORE_SCHEDULER_PORT=9091 KVSTORE_NUM_WORKERS=2 KVSTORE_NUM_SERVERS=1 \
        python -m tracker.scheduler      # configured by the environment only
    python -m tracker.scheduler -h       # this text
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Mapping

import zmq

from .control import env
from .control.rendezvous import Scheduler
from .control.security import Security

log = logging.getLogger(__name__)


def serve(environ: Mapping[str, str]) -> int:
    """Run the scheduler described by ``environ`` until the job ends. Returns 0 if
    every node finished, 1 if the job was aborted, 2 for a bad configuration."""
    try:
        values = env.read(environ)
        missing = [name for name in ("KVSTORE_SCHEDULER_PORT", "KVSTORE_NUM_WORKERS",
                                     "KVSTORE_NUM_SERVERS") if values[name] is None]
        if missing:
            raise env.EnvError(f"the scheduler needs {', '.join(missing)}")
    except env.EnvError as e:
        log.error("%s", e)
        return 2
    try:
        security = Security(values["KVSTORE_SECRET"], values["KVSTORE_SECURE"])
    except ValueError as e:
        log.error("%s", e)
        return 2
    host = values["KVSTORE_SCHEDULER_HOST"] or "127.0.0.1"
    try:
        sched = Scheduler(values["KVSTORE_NUM_WORKERS"], values["KVSTORE_NUM_SERVERS"],
                          host=host, security=security,
                          port=values["KVSTORE_SCHEDULER_PORT"], timeout=values["KVSTORE_TIMEOUT"],
                          heartbeat_interval=values["KVSTORE_HEARTBEAT_INTERVAL"],
                          heartbeat_timeout=values["KVSTORE_HEARTBEAT_TIMEOUT"]).start()
    except (zmq.ZMQError, OSError) as e:   # e.g. the port is taken, or the address is not ours
        log.error("the scheduler cannot listen on %s:%s (KVSTORE_SCHEDULER_HOST, "
                  "KVSTORE_SCHEDULER_PORT): %s", host, values["KVSTORE_SCHEDULER_PORT"], e)
        return 2
    try:
        sched.wait()
    finally:
        sched.close()
    if sched.failure:
        log.error("job failed: %s", sched.failure)
        return 1
    return 0


def main() -> int:
    if sys.argv[1:] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    if sys.argv[1:]:
        print(f"tracker.scheduler takes no arguments (got {' '.join(sys.argv[1:])}): it is configured "
              "by the KVSTORE_* environment (docs/configuration.md); -h for help", file=sys.stderr)
        return 2
    level = os.environ.get("KVSTORE_LOG_LEVEL", "INFO").upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        print(f"error: KVSTORE_LOG_LEVEL={os.environ['KVSTORE_LOG_LEVEL']!r} is invalid: use DEBUG, "
              "INFO, WARNING, ERROR or CRITICAL", file=sys.stderr)
        return 2
    logging.basicConfig(level=level, format="%(asctime)s [scheduler] %(levelname)s %(message)s")
    return serve(os.environ)


if __name__ == "__main__":
    sys.exit(main())
