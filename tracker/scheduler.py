"""``python -m tracker.scheduler``: run a job's scheduler as its own process.

For jobs started by another launcher (MXNet's ``DMLC_ROLE=scheduler`` process,
Kubernetes, ...): nothing restarts it if it dies, and the job's processes stop
KVSTORE_HEARTBEAT_TIMEOUT + KVSTORE_SCHEDULER_RESTART_TIMEOUT after they lost it.

    KVSTORE_SCHEDULER_PORT=9091 KVSTORE_NUM_WORKERS=2 KVSTORE_NUM_SERVERS=1 \
        python -m tracker.scheduler      # configured by the environment only
    python -m tracker.scheduler -h       # this text

Our own launchers run it as their child with ``--launcher``
(:class:`tracker.scheduler_process.SchedulerProcess`, which restarts it when it
dies): the settings and the secret in its environment, then one JSON line per
message on its stdin (the first: ``{"job": ID, "restarted": BOOL, "port": P}``,
port 0 for any free one; then ``{"exited": [ROLE, RANK, STATUS]}``, ``{"abort":
REASON}``, ``{"ping": N}`` or ``{"stop": true}``) and on its stdout (``{"port": P}`` once it
listens, ``{"pong": N}`` once its serving loop handled ping N (the launcher kills
and restarts a scheduler that stops answering), ``{"failure": REASON}``,
``{"failed_over": [RANKS]}``, ``{"start_again": [[RANK, COUNT], ...]}``,
``{"exits": N, "closed": [RANKS], "failed_after": M}`` (the ``exited`` lines handled
so far, the workers that called close(), and how many exits it had heard when the
job failed, or null: what the launcher judges a failed exit by),
``{"done": true}``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from typing import IO, Mapping

import zmq

from .control import env
from .control.rendezvous import DEFAULT_HOST, Scheduler
from .control.security import Security

log = logging.getLogger(__name__)

LAUNCHER_FLAG = "--launcher"
TICK = 0.05   # seconds between reports of its state to the launcher


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


def serve_launcher(environ: Mapping[str, str], stdin: IO[str], stdout: IO[str]) -> int:
    """Run the scheduler a launcher started (``--launcher``: the module's doc gives the
    lines it reads and writes) until the job ends or the launcher says ``stop``.
    Returns as :func:`serve`. A launcher that ends without ``stop`` (its stdin closes)
    aborts the job: nothing would watch or restart it any more."""
    try:
        start = json.loads(stdin.readline() or "null")
        if not (isinstance(start, dict) and isinstance(start.get("job"), str)
                and type(start.get("restarted")) is bool and type(start.get("port")) is int):
            raise ValueError(f"the launcher's first line is not {{job, restarted, port}}: {start!r:.200}")
        settings = env.read(environ)
        if settings.num_workers is None or settings.num_servers is None:
            raise env.EnvError("the scheduler needs KVSTORE_NUM_WORKERS and KVSTORE_NUM_SERVERS")
        security = Security(settings.secret, settings.secure)
    except ValueError as e:   # EnvError, JSON, a secret that is not hex
        log.error("%s", e)
        return 2
    host = settings.scheduler_host or DEFAULT_HOST
    try:
        sched = Scheduler.for_job(settings, settings.num_workers, settings.num_servers, host=host,
                                  port=start["port"], security=security, job=start["job"],
                                  restarted=start["restarted"], restartable=True).start()
    except (zmq.ZMQError, OSError) as e:
        log.error("the scheduler cannot listen on %s:%s: %s", host, start["port"], e)
        return 2
    lock = threading.Lock()

    def say(**fields) -> None:
        with lock:
            stdout.write(json.dumps(fields) + "\n")
            stdout.flush()

    stop = threading.Event()
    threading.Thread(target=_launcher_events, args=(sched, stdin, stop), daemon=True,
                     name="kvstore-scheduler-launcher").start()
    failure: str | None = None
    failed_over: frozenset[int] = frozenset()
    start_again: dict[int, int] = {}
    exits: tuple[int, frozenset[int], int | None] = (0, frozenset(), None)
    pinged = 0
    try:
        say(port=sched.port, pid=os.getpid())
        while not stop.is_set():
            ended = sched.wait(TICK) or sched.done
            if sched.pinged != pinged:
                pinged = sched.pinged
                say(pong=pinged)
            if sched.failure != failure:
                failure = sched.failure
                say(failure=failure)
            if sched.failed_over != failed_over:
                failed_over = sched.failed_over
                say(failed_over=sorted(failed_over))
            if sched.start_again != start_again:
                start_again = sched.start_again
                say(start_again=sorted(start_again.items()))
            # the count first: a worker's finish comes before its exit, and a failure
            # before the exits it causes, so what is read after a count that holds an
            # exit holds that worker's close() and a failure that came first
            if (sched.exits_heard, sched.closed_workers, sched.failed_after) != exits:
                exits = (sched.exits_heard, sched.closed_workers, sched.failed_after)
                say(exits=exits[0], closed=sorted(exits[1]), failed_after=exits[2])
            if ended:
                say(done=True)
                break
    except OSError:   # the launcher is gone (a broken pipe): the events thread aborted the job
        sched.wait(10.0)   # until every node heard it (or 10 s)
    finally:
        sched.close()
    return 1 if sched.failure else 0


def _launcher_events(sched: Scheduler, stdin: IO[str], stop: threading.Event) -> None:
    """Hand the launcher's lines to the scheduler until ``stop`` or the end of stdin."""
    for line in stdin:
        try:
            event = json.loads(line)
            if "exited" in event:
                role, rank, code = event["exited"]
                sched.node_exited(str(role), int(rank), int(code))
            elif "abort" in event:
                sched.abort(str(event["abort"]))
            elif "ping" in event:
                sched.ping(int(event["ping"]))
            elif event.get("stop"):
                stop.set()
                return
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            log.error("a line from the launcher that is no event (%s): %.200r", e, line)
    sched.abort("the launcher that started the scheduler ended (its pipe closed)")


def main() -> int:
    launcher = sys.argv[1:] == [LAUNCHER_FLAG]
    status = None if launcher else env.entry_point_arguments("tracker.scheduler", __doc__, sys.argv[1:])
    if status is not None:
        return status
    text, level = env.log_level(os.environ)
    if level is None:
        print(f"error: KVSTORE_LOG_LEVEL={text!r} is invalid: use "
              f"{', '.join(env.LOG_LEVELS[:-1])} or {env.LOG_LEVELS[-1]}", file=sys.stderr)
        return 2
    logging.basicConfig(level=level, format="%(asctime)s [scheduler] %(levelname)s %(message)s")
    if launcher:
        return serve_launcher(os.environ, sys.stdin, sys.stdout)
    return serve(os.environ)


if __name__ == "__main__":
    sys.exit(main())
