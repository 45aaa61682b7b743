"""The launcher API shared by every way of starting processes.

A :class:`JobSpec` says what to run; :func:`launch` starts the scheduler in this
process, the servers and workers through a ``spawn`` function (local
subprocesses here; ssh/mpi launchers pass their own), then monitors them: the
first process to fail tears the job down and is reported as the root cause.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, IO, Sequence

from . import env
from .process import Child, ProcSpec, terminate_all
from .rendezvous import Scheduler, describe_exit
from .security import Security, new_secret

log = logging.getLogger(__name__)

TICK = 0.05


@dataclass(frozen=True)
class JobSpec:
    """What to run. ``command`` is the worker argv; servers run ``server_command``."""
    num_workers: int
    num_servers: int
    command: tuple[str, ...]
    server_command: tuple[str, ...] = (sys.executable, "-m", "kvstore.server")
    scheduler_host: str = "127.0.0.1"
    node_host: str = "127.0.0.1"
    env: dict = field(default_factory=dict)
    role_env: dict = field(default_factory=dict)  # role -> extra variables for that role only
    kill_grace: float = 3.0
    settings: dict = field(default_factory=dict)  # parsed tracker.env values
    emulate_hosts: int = 0   # > 0: split the processes over this many emulated hosts

    def processes(self, scheduler_port: int) -> list[ProcSpec]:
        """Servers first, then workers, each with its rank in launch order. With
        ``emulate_hosts`` = K, server and worker of rank r are on emulated host r % K
        (``KVSTORE_HOST_LABEL``), as a launcher over K machines would place them."""
        specs = []
        for role, count, argv in (("server", self.num_servers, self.server_command),
                                  ("worker", self.num_workers, self.command)):
            for rank in range(count):
                label = {"KVSTORE_HOST_LABEL": f"host{rank % self.emulate_hosts}"} \
                    if self.emulate_hosts > 0 else {}
                child_env = env.for_process(
                    role=role, rank=rank, scheduler_host=self.scheduler_host,
                    scheduler_port=scheduler_port, num_workers=self.num_workers,
                    num_servers=self.num_servers, node_host=self.node_host,
                    extra={**self.env, **self.role_env.get(role, {}), **label})
                specs.append(ProcSpec(role, rank, tuple(argv), child_env))
        return specs


@dataclass
class Outcome:
    """How a job ended: the exit status to return and a per-process table."""
    returncode: int
    root_cause: str | None
    rows: list[tuple]  # label, pid, code, note[, host]

    def table(self) -> str:
        hosts = any(len(row) > 4 for row in self.rows)
        width = max([len(row[4]) for row in self.rows if len(row) > 4] + [4])
        head = f"{'host':<{width}}  " if hosts else ""
        lines = [f"{'process':<12} {'pid':>8}  {head}status"]
        for label, pid, code, note, *host in self.rows:
            status = "running (killed by launcher)" if code is None else describe_exit(code)
            where = f"{(host or [''])[0]:<{width}}  " if hosts else ""
            pid = "-" if pid is None else pid
            lines.append(f"{label:<12} {pid:>8}  {where}{status}{'  <- ' + note if note else ''}")
        return "\n".join(lines)


class _Interrupted(Exception):
    def __init__(self, signum: int):
        self.signum = signum


def launch(spec: JobSpec, spawn: Callable[[ProcSpec], Child] | None = None,
           out: IO[str] | None = None,
           start_all: Callable[[list[ProcSpec]], list[Child]] | None = None) -> Outcome:
    """Run a whole job and return its :class:`Outcome`. SIGINT/SIGTERM to this
    process end every child and return status 128 + signal.

    ``spawn`` starts one process (default: a local :class:`Child`); launchers that
    start every process with one command (mpirun, srun) pass ``start_all``
    instead, which returns one child-like object per process (see
    ``tracker.group``). A child-like object has ``spec``, ``pid``, ``popen``,
    ``poll()``, ``signal(sig)`` and ``finish_output()``; optionally ``host``,
    ``detail`` (text added to the root cause) and ``exit_order`` (when several
    end in one monitor tick, the lowest is reported as the first failure)."""
    settings = spec.settings or env.read({})
    spawn = spawn or (lambda p: Child(p, out))
    # one secret per job, handed to the children in their environment (never argv)
    secret = settings.get("KVSTORE_SECRET") or new_secret()
    security = Security(secret, bool(settings.get("KVSTORE_SECURE")))
    scheduler = Scheduler(spec.num_workers, spec.num_servers, host=spec.scheduler_host,
                          timeout=settings["KVSTORE_TIMEOUT"],
                          heartbeat_interval=settings["KVSTORE_HEARTBEAT_INTERVAL"],
                          heartbeat_timeout=settings["KVSTORE_HEARTBEAT_TIMEOUT"],
                          security=security).start()
    children: list[Child] = []
    codes: dict[str, int] = {}
    first_failure: tuple[str, int] | None = None
    interrupted: int | None = None
    restore = _install_signal_handlers()
    spawn_error = None
    try:
        procs = [dataclasses.replace(p, env={**p.env, "KVSTORE_SECRET": secret})
                 for p in spec.processes(scheduler.port)]
        if start_all is not None:
            try:
                children.extend(start_all(procs))
            except OSError as e:
                spawn_error = f"could not start the job: {e}"
        for proc in procs if start_all is None else ():
            try:
                children.append(spawn(proc))
            except OSError as e:
                spawn_error = f"could not start {proc.label} ({' '.join(proc.argv)}): {e}"
                break
        if spawn_error is None:
            first_failure = _monitor(children, codes, scheduler, settings)
    except _Interrupted as e:
        interrupted = e.signum
        log.error("launcher got %s: stopping every process", signal.Signals(e.signum).name)
    finally:
        _restore_signal_handlers(restore)
        alive = [c for c in children if c.poll() is None]
        if alive:  # tell the survivors why before they are stopped
            scheduler.abort("the launcher stopped the job")
        terminate_all(alive, spec.kill_grace)
        for c in children:
            c.finish_output()
        scheduler.close()
    if spawn_error is not None:
        return Outcome(127, spawn_error, [_row(c, c.poll(), "") for c in children])
    return _outcome(children, codes, first_failure, interrupted, scheduler.failure)


def _monitor(children, codes, scheduler, settings) -> tuple[str, int] | None:
    """Wait until every worker succeeded (and servers ended) or something failed."""
    servers_done_by = None
    while True:
        ended = [(c, c.poll()) for c in children if c.spec.label not in codes]
        ended.sort(key=lambda item: (item[1] is None, getattr(item[0], "exit_order", 0) or 0))
        for child, code in ended:
            label = child.spec.label
            if code is None:
                continue
            codes[label] = code
            scheduler.node_exited(child.spec.role, child.spec.rank, code)
            if code != 0:
                return label, code
        if scheduler.failure is not None and len(codes) < len(children):
            return "scheduler", 1  # e.g. a stuck process: heartbeats stopped
        workers = [c for c in children if c.spec.role == "worker"]
        if all(c.spec.label in codes for c in workers):
            if len(codes) == len(children):
                return None
            # servers leave once the scheduler tells them every worker finished
            if servers_done_by is None:
                servers_done_by = time.monotonic() + settings["KVSTORE_HEARTBEAT_TIMEOUT"] + 5
            elif time.monotonic() > servers_done_by:
                log.warning("servers did not exit after the workers finished; stopping them")
                return None
        time.sleep(TICK)  # a poll interval of the monitor, not synchronisation


def _outcome(children, codes, first_failure, interrupted, scheduler_failure) -> Outcome:
    rows = []
    root = None
    if first_failure is not None:
        label, code = first_failure
        if label == "scheduler":
            root = f"the scheduler aborted the job: {scheduler_failure}"
        else:
            culprit = next(c for c in children if c.spec.label == label)
            root = f"{label} {describe_exit(code)}"
            if getattr(culprit, "host", None):
                root = f"{label} on {culprit.host} {describe_exit(code)}"
            if getattr(culprit, "detail", None):
                root += f" ({culprit.detail})"
    elif interrupted is not None:
        root = f"the launcher was interrupted by {signal.Signals(interrupted).name}"
    for child in children:
        label = child.spec.label
        code = codes.get(label, child.poll())
        note = "root cause" if first_failure and first_failure[0] == label else ""
        rows.append(_row(child, code, note))
    if interrupted is not None:
        returncode = 128 + interrupted
    elif first_failure is None:
        returncode = 0
    else:
        code = first_failure[1]
        returncode = 128 - code if code < 0 else code
    return Outcome(returncode, root, rows)


def _row(child, code, note) -> tuple:
    host = getattr(child, "host", None)
    row = (child.spec.label, child.pid, code, note)
    return row if host is None else (*row, host)


def _install_signal_handlers():
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        raise _Interrupted(signum)
    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}


def _restore_signal_handlers(previous) -> None:
    if previous:
        for sig, old in previous.items():
            signal.signal(sig, old)


def report(outcome: Outcome, stream: IO[str] = sys.stderr) -> None:
    """Print the per-process table and the root cause (if any)."""
    if outcome.root_cause is None and outcome.returncode == 0:
        return
    stream.write(f"\njob failed: {outcome.root_cause}\n{outcome.table()}\n")
    stream.flush()


def run_cli(spec: JobSpec, dry_run: bool = False, stream: IO[str] = sys.stderr,
            spawn: Callable[[ProcSpec], Child] | None = None,
            start_all: Callable[[list[ProcSpec]], list[Child]] | None = None,
            show: Callable[[list[ProcSpec]], str] | None = None) -> int:
    """Shared tail of every launcher CLI: print the plan (``show`` renders it for
    launchers that start processes elsewhere) or launch and report."""
    if dry_run:
        if show is not None:
            stream.write(show(spec.processes(scheduler_port=0)) + "\n")
            return 0
        for proc in spec.processes(scheduler_port=0):
            shown = {k: ("***" if k == "KVSTORE_SECRET" else v)
                     for k, v in proc.env.items() if k.startswith("KVSTORE_")}
            stream.write(f"{proc.label}: {' '.join(proc.argv)}  env {shown}\n")
        return 0
    outcome = launch(spec, spawn=spawn, start_all=start_all)
    report(outcome, stream)
    return outcome.returncode


def settings_from(environ) -> dict:
    return env.read(environ)


def split_command(command: Sequence[str]) -> tuple[str, ...]:
    if not command:
        raise ValueError("no command given: say what every worker runs, e.g. `python train.py`")
    return tuple(command)
