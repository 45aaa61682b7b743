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
from .control.rendezvous import DEFAULT_HOST, Scheduler
from .control.security import Security

log = logging.getLogger(__name__)


def serve(environ: Mapping[str, str]) -> int:
    """Run the scheduler described by ``environ`` until the job ends. Returns 0 if
    every node finished, 1 if the job was aborted, 2 for a bad configuration."""
    try:
        settings = env.read(environ)
        missing = [name for name in ("KVSTORE_SCHEDULER_PORT", "KVSTORE_NUM_WORKERS",
                                     "KVSTORE_NUM_SERVERS")
                   if getattr(settings, env.BY_NAME[name].field) is None]
        if missing:
            raise env.EnvError(f"the scheduler needs {', '.join(missing)}")
        security = Security(settings.secret, settings.secure)
    except ValueError as e:   # EnvError, or a secret that is not hex
        log.error("%s", e)
        return 2
    host = settings.scheduler_host or DEFAULT_HOST
    try:
        sched = Scheduler.for_job(settings, settings.num_workers, settings.num_servers, host=host,
                                  port=settings.scheduler_port, security=security).start()
    except (zmq.ZMQError, OSError) as e:   # e.g. the port is taken, or the address is not ours
        log.error("the scheduler cannot listen on %s:%s (KVSTORE_SCHEDULER_HOST, "
                  "KVSTORE_SCHEDULER_PORT): %s", host, settings.scheduler_port, e)
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
    status = env.entry_point_arguments("tracker.scheduler", __doc__, sys.argv[1:])
    if status is not None:
        return status
    text, level = env.log_level(os.environ)
    if level is None:
        print(f"error: KVSTORE_LOG_LEVEL={text!r} is invalid: use "
              f"{', '.join(env.LOG_LEVELS[:-1])} or {env.LOG_LEVELS[-1]}", file=sys.stderr)
        return 2
    logging.basicConfig(level=level, format="%(asctime)s [scheduler] %(levelname)s %(message)s")
    return serve(os.environ)


if __name__ == "__main__":
    sys.exit(main())
