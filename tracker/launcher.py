"""The launcher API shared by every way of starting processes.

A :class:`JobSpec` says what to run; :func:`launch` starts the scheduler as a
child of this process (:class:`~tracker.scheduler_process.SchedulerProcess`,
which restarts it if it dies), the servers and workers through a ``spawn``
function (local subprocesses here; ssh/mpi launchers pass their own), then
monitors them: the first process to fail tears the job down and is reported as
the root cause.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, IO, Mapping, Sequence

from .control import env
from .control.env import Settings
from .control.records import describe_exit
from .control.rendezvous import DEFAULT_HOST
from .control.security import new_secret
from .outcome import Outcome, conclude, named_nodes, plural, report, row
from .process import Child, ProcSpec, Strays, needs_stopping, terminate_all
from .scheduler_process import SchedulerProcess

log = logging.getLogger(__name__)

TICK = 0.05
SETTLE = 2.0   # seconds the processes a scheduler-found failure names get to end by themselves
HEARD = 2.0    # seconds a failed exit waits for the scheduler's word on it (tracker.scheduler_process)
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True)
class JobSpec:
    """What to run. ``command`` is the worker argv; servers run ``server_command``."""
    num_workers: int
    num_servers: int
    command: tuple[str, ...]
    server_command: tuple[str, ...] = (sys.executable, "-m", "kvstore.server")
    scheduler_host: str = DEFAULT_HOST
    node_host: str = env.default("KVSTORE_NODE_HOST")
    env: dict = field(default_factory=dict)
    role_env: dict = field(default_factory=dict)  # role -> extra variables for that role only
    kill_grace: float = 3.0
    settings: Settings = field(default_factory=Settings)  # the launcher's, from env.read
    emulate_hosts: int = 0   # > 0: split the processes over this many emulated hosts
    # threads per process in launch order (servers, then workers), set as each of
    # thread_vars unless the process's variables already have OMP_NUM_THREADS;
    # () = none (see with_default_threads)
    threads: tuple[int, ...] = ()
    thread_vars: tuple[str, ...] = THREAD_VARS
    # elastic jobs (settings.elastic): replacements started for workers that left
    max_restarts: int = 0
    # replicated servers (settings.replicas): replacement servers started, in all, for
    # servers whose chunks their backups took over (--restart-servers)
    restart_servers: int = 0

    def processes(self, scheduler_port: int) -> list[ProcSpec]:
        """Servers first, then workers, each with its rank in launch order. With
        ``emulate_hosts`` = K, server and worker of rank r are on emulated host r % K
        (``KVSTORE_HOST_LABEL``), as a launcher over K machines would place them."""
        specs: list[ProcSpec] = []
        for role, count, argv in (("server", self.num_servers, self.server_command),
                                  ("worker", self.num_workers, self.command)):
            for rank in range(count):
                label = {"KVSTORE_HOST_LABEL": f"host{rank % self.emulate_hosts}"} \
                    if self.emulate_hosts > 0 else {}
                extra = {**self.env, **self.role_env.get(role, {}), **label}
                index = len(specs)
                if index < len(self.threads) and "OMP_NUM_THREADS" not in extra:
                    extra = {**{name: str(self.threads[index]) for name in self.thread_vars},
                             **extra}
                child_env = env.for_process(
                    role=role, rank=rank, scheduler_host=self.scheduler_host,
                    scheduler_port=scheduler_port, num_workers=self.num_workers,
                    num_servers=self.num_servers, node_host=self.node_host, extra=extra)
                specs.append(ProcSpec(role, rank, tuple(argv), child_env))
        return specs


def cpu_count() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def with_default_threads(spec: JobSpec, hosts: Sequence[str], cores: Mapping[str, int],
                         user_env: Mapping[str, str], uniform: bool = False) -> JobSpec:
    """Unless the user set ``OMP_NUM_THREADS`` (in ``user_env``: this environment
    and the variables given to every process), give every process
    ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` (unless the user set that one) =
    the cores of its host // the processes started on that host, at least 1, and
    log it once. ``hosts``: the host of each process in launch order (servers,
    then workers); ``cores``: cores per host. As torchrun does: a numeric
    library's default (one thread per core in every process) oversubscribes
    the cores several processes share. ``uniform``: one value for every process
    (the smallest; mpirun and srun pass one environment to all)."""
    if user_env.get("OMP_NUM_THREADS"):
        return spec
    count = collections.Counter(hosts)
    threads = tuple(max(1, cores[h] // count[h]) for h in hosts)
    if uniform:
        threads = (min(threads),) * len(threads)
    names = tuple(n for n in THREAD_VARS if n == "OMP_NUM_THREADS" or not user_env.get(n))
    detail = ", ".join(f"{h}: {cores[h]} cores / {plural(count[h], 'process', 'processes')}"
                       f" = {max(1, cores[h] // count[h])}" for h in count)
    log.info("OMP_NUM_THREADS is not set: each process gets %s = its host's cores // the "
             "processes started there (%s%s); set OMP_NUM_THREADS to choose",
             " and ".join(names), detail,
             f"; {threads[0]} for every process" if uniform and threads else "")
    return dataclasses.replace(spec, threads=threads, thread_vars=names)


class _Signals:
    """SIGINT, SIGTERM and SIGHUP (the terminal closed) end the job: every process
    is stopped and the launcher exits with 128 + the signal. Another one while the
    job is being torn down skips the rest of the grace period: SIGKILL at once.

    The handler only records what came (it may run between any two bytecodes of
    the main thread, even inside a lock): the monitor loop and the teardown poll
    it. A signal ignored when we start (``nohup``, a background job) stays ignored."""

    HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.received: list[int] = []
        self.tearing_down = False
        self.kill_now = False
        self._previous: dict = {}

    def install(self) -> "_Signals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.HANDLED:
                if signal.getsignal(sig) != signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received.append(signum)
        if self.tearing_down or len(self.received) > 1:
            self.kill_now = True

    def restore(self) -> None:
        for sig, old in self._previous.items():
            signal.signal(sig, old)
        self._previous.clear()


def launch(spec: JobSpec, spawn: Callable[[ProcSpec], Child] | None = None,
           out: IO[str] | None = None,
           start_all: Callable[[list[ProcSpec]], list[Child]] | None = None) -> Outcome:
    """Run a whole job and return its :class:`Outcome`. SIGINT/SIGTERM/SIGHUP to
    this process end every child and return status 128 + signal; a second one
    during the teardown kills every child at once (SIGKILL). While the job runs
    this process is a child subreaper (Linux): whatever the children leave
    behind, even after setsid(), is re-parented to it and ended by the teardown
    (:class:`tracker.process.Strays`).

    ``spawn`` starts one process (default: a local :class:`Child`); launchers that
    start every process with one command (mpirun, srun) pass ``start_all``
    instead, which returns one child-like object per process (see
    ``tracker.group``). A child-like object has ``spec``, ``pid``, ``popen``,
    ``poll()``, ``signal(sig)`` and ``finish_output()``; optionally ``host``,
    ``detail`` (text added to the root cause), ``exit_order`` (when several
    end in one monitor tick, the lowest is reported as the first failure) and
    ``running()`` (true while anything of it needs stopping; default: ``poll()``
    is None)."""
    started = time.monotonic()
    settings = spec.settings
    spawn = spawn or (lambda p: Child(p, out))
    # one secret per job, handed to the children in their environment (never argv)
    secret = settings.secret or new_secret()
    refusal = _refuse_replicas(spec, start_all is not None)
    if refusal is not None:
        log.error("%s", refusal)
        return Outcome(2, refusal, [], spec.num_workers, spec.num_servers, 0.0)
    try:
        scheduler = SchedulerProcess(settings, spec.num_workers, spec.num_servers, host=spec.scheduler_host,
                                     secret=secret).start()
    except OSError as e:
        log.error("%s", e)
        return Outcome(1, str(e), [], spec.num_workers, spec.num_servers, 0.0)
    children: list[Child] = []
    codes: dict[str, int] = {}   # label -> status of the processes that ended by themselves
    first_failure: tuple[str, int] | None = None
    interrupted: int | None = None
    signals = _Signals().install()
    spawn_error = None
    strays = Strays(lambda: [c.popen.pid for c in children] + scheduler.pids)
    replace: _Replacements | None = None
    try:
        procs = [dataclasses.replace(p, env={**p.env, "KVSTORE_SECRET": secret})
                 for p in spec.processes(scheduler.port)]
        if start_all is not None:
            try:
                children.extend(start_all(procs))
            except OSError as e:
                spawn_error = f"could not start the job: {e}"
        for proc in procs if start_all is None else ():
            if signals.received:
                break
            try:
                children.append(spawn(proc))
            except OSError as e:
                spawn_error = f"could not start {proc.label} ({' '.join(proc.argv)}): {e}"
                break
        if spawn_error is None and not signals.received:
            replace = _Replacements(spec, spawn, children) if settings.elastic and start_all is None else None
            restart = _ServerRestarts(spec, spawn, children) if spec.restart_servers else None
            again = _StartsAgain(spawn, children, codes) if settings.replicas else None
            first_failure = _monitor(children, codes, scheduler, settings, signals, replace, restart, again)
            if replace is not None:
                replace.judge(scheduler, over=True)   # exits still waiting: the job is over
            if first_failure is not None and first_failure[0] == "scheduler":
                _settle(children, codes, scheduler, signals)
    finally:
        # from here on a signal only hurries the teardown (SIGKILL at once)
        early = len(signals.received)
        signals.tearing_down = True
        if early and first_failure is None:
            interrupted = signals.received[0]
            log.error("launcher got %s: stopping every process", signal.Signals(interrupted).name)
        if early > 1 or (early and first_failure is not None):
            signals.kill_now = True
        if any(c.poll() is None for c in children):  # tell the survivors why before they are stopped
            scheduler.abort("the launcher stopped the job")
        # the strays always take part: a worker the teardown ends leaves its orphans
        terminate_all([c for c in children if needs_stopping(c)] + [strays], spec.kill_grace,
                      lambda: signals.kill_now)
        strays.close()
        for c in children:
            c.finish_output()
        scheduler.close()
        signals.restore()
    if spawn_error is not None:
        return Outcome(127, spawn_error, [row(c, c.poll(), "") for c in children],
                       spec.num_workers, spec.num_servers, time.monotonic() - started)
    outcome = conclude(children, codes, first_failure, interrupted, scheduler.failure,
                       late=replace.late if replace is not None else ())
    outcome.num_workers, outcome.num_servers = spec.num_workers, spec.num_servers
    outcome.elapsed = time.monotonic() - started
    return outcome


def _refuse_replicas(spec: JobSpec, all_at_once: bool) -> str | None:
    """Why a job with KVSTORE_REPLICAS=1 cannot run as launched (None: it can):
    fewer than 2 servers, or a launcher (mpirun, srun) that ends every process
    when one fails, so that no server's death could be survived."""
    if not spec.settings.replicas:
        if spec.restart_servers:
            return (f"--restart-servers {spec.restart_servers} starts servers in place of dead ones, whose "
                    "chunks their backups took over: it needs replicated servers (KVSTORE_REPLICAS=1); "
                    "without them a server's death ends the job")
        return None
    if spec.num_servers < 2:
        return (f"KVSTORE_REPLICAS=1 needs at least 2 servers (each server's chunks have a backup on "
                f"another server); this job has {spec.num_servers} (-s)")
    if all_at_once:
        return ("KVSTORE_REPLICAS=1 is set, but this launcher (mpirun, srun) ends every process when one "
                "fails: run replicated jobs with tracker.local or tracker.ssh")
    return None


class _Replacements:
    """Elastic jobs: a worker that ended with a non-zero status left the job (the
    scheduler decides; below the minimum it aborts), and up to ``max_restarts``
    times a new process is started in its place, with the same command, rank and
    variables: it joins the running job (docs/elastic.md).

    A worker that had called close() first had finished its part: it is not
    replaced, and its status is the job's at the end (:attr:`late`; the others go
    on). Which it was, the scheduler knows: each failed exit waits (:meth:`judge`)
    until the scheduler's report has handled it, then reads whether that worker
    had said ``finish`` (it says so before close() returns, so before the exit)."""

    def __init__(self, spec: JobSpec, spawn, children: list):
        self._left = spec.max_restarts
        self._spawn = spawn
        self._children = children
        self.started = 0
        self._waiting: list[tuple] = []      # (child, status, the exit's number) to judge
        self.late: list[tuple[str, int]] = []   # (label, status): failed after close()

    def __call__(self, child, code: int, told: int) -> None:
        self._waiting.append((child, code, told))

    def judge(self, scheduler: SchedulerProcess, over: bool = False) -> None:
        """Decide each waiting exit the scheduler has handled (every one once the job is
        ``over`` or done: nothing is started then)."""
        heard = scheduler.heard
        over = over or scheduler.done
        for item in [w for w in self._waiting if w[2] <= heard.exits or over]:
            self._waiting.remove(item)
            child, code, _ = item
            if child.spec.rank in heard.closed:
                log.error("%s %s after it finished (called close()): not replaced; the job goes on and "
                          "ends with its status", child.spec.label, describe_exit(code))
                self.late.append((child.spec.label, code))
            elif over:
                log.warning("%s %s: the elastic job is over, nothing replaces it", child.spec.label,
                            describe_exit(code))
            else:
                self._replace(child, code)

    def _replace(self, child, code: int) -> None:
        log.warning("%s %s: it leaves the elastic job%s", child.spec.label, describe_exit(code),
                    " (no replacement: --max-restarts reached)" if self.started and not self._left else "")
        if self._left <= 0:
            return
        self._left -= 1
        self.started += 1
        proc = dataclasses.replace(child.spec, restart=self.started)
        try:
            self._children.append(self._spawn(proc))
            log.warning("started %s in place of %s", proc.label, child.spec.label)
        except OSError as e:
            log.error("could not start a replacement for %s: %s", child.spec.label, e)


class _ServerRestarts:
    """Replicated servers (``--restart-servers N``): when the scheduler handed a dead
    server's chunks to their backups (tracker.control.failover), a new server
    process is started, up to N in all: server ``num_servers + i`` (a new process
    with its own sockets, on the dead one's host, with its variables), which
    registers with the running job as a replacement and becomes the backup of the
    shares that lost theirs (docs/reliability.md, replicated servers)."""

    def __init__(self, spec: JobSpec, spawn, children: list):
        self._left = spec.restart_servers
        self._spawn = spawn
        self._children = children
        self._next = spec.num_servers
        self._seen: set[int] = set()

    def __call__(self, failed_over: frozenset) -> None:
        for rank in sorted(failed_over - self._seen):
            self._seen.add(rank)
            dead = next(c for c in reversed(self._children) if c.spec.role == "server" and c.spec.rank == rank)
            if self._left <= 0:
                log.warning("no server started in place of %s: --restart-servers reached (a second failure of "
                            "its chains ends the job)", dead.spec.label)
                continue
            self._left -= 1
            proc = dataclasses.replace(dead.spec, rank=self._next, env={**dead.spec.env, "KVSTORE_RANK": str(self._next)},
                                       replaces=dead.spec.replaces if dead.spec.replaces is not None else rank)
            self._next += 1
            try:
                self._children.append(self._spawn(proc))
                log.warning("started %s in place of %s (--restart-servers: %d more allowed)", proc.label,
                            dead.spec.label, self._left)
            except OSError as e:
                log.error("could not start a server in place of %s: %s", dead.spec.label, e)


class _StartsAgain:
    """Replicated servers: the servers the scheduler asked to start again in place,
    because they died or hung before the job formed (tracker.control.start_again;
    ``scheduler.start_again``, rank -> count). For each new request, the process
    of that rank is killed if it still runs (a stopped one; its end is recorded here,
    not reported: the scheduler forgot it) and the same command starts again, with
    the same rank and variables, as ``server R #N``."""

    def __init__(self, spawn, children: list, codes: dict):
        self._spawn = spawn
        self._children = children
        self._codes = codes
        self._done: dict[int, int] = {}

    def __call__(self, asked: Mapping[int, int]) -> None:
        for rank, count in sorted(asked.items()):
            while self._done.get(rank, 0) < count:
                self._done[rank] = self._done.get(rank, 0) + 1
                self._start(rank)

    def _start(self, rank: int) -> None:
        old = next((c for c in reversed(self._children) if c.spec.role == "server" and c.spec.rank == rank),
                   None)
        if old is None:
            log.error("the scheduler asked to start server %d again, but no such server was started", rank)
            return
        if old.spec.label not in self._codes:
            code = old.poll()
            if code is None:
                old.signal(signal.SIGKILL)
                code = -signal.SIGKILL
            self._codes[old.spec.label] = code
        proc = dataclasses.replace(old.spec, restart=old.spec.restart + 1)
        try:
            self._children.append(self._spawn(proc))
            log.warning("started %s in place of %s: it died or hung before the job formed (KVSTORE_REPLICAS=1)",
                        proc.label, old.spec.label)
        except OSError as e:
            log.error("could not start %s again: %s", old.spec.label, e)


def _monitor(children, codes, scheduler, settings, signals, replace=None,
             restart=None, again=None) -> tuple[str, int] | None:
    """Wait until every worker succeeded (and servers ended), something failed
    (returned: the first failure), or a signal came (None). ``replace``: an elastic
    job's :class:`_Replacements`; a worker's failure is then the scheduler's to
    judge (it aborts the job below the minimum, returned as a scheduler failure).
    With replicated servers (``settings.replicas``) a server's death is the
    scheduler's to judge too (tracker.control.failover); ``restart``
    (:class:`_ServerRestarts`) starts servers in place of those it failed over, and
    ``again`` (:class:`_StartsAgain`) those lost before the job formed."""
    servers_done_by = done_at = None
    failed_over_ended: set = set()     # replicated servers the scheduler failed over, then killed here
    while not signals.received:
        # read before polling: an exit seen after the scheduler found a failure may
        # be a consequence of it (it told every node to stop), not its cause
        failed_before = scheduler.failure is not None
        ended = [(c, c.poll()) for c in children if c.spec.label not in codes]
        ended.sort(key=lambda item: (item[1] is None, getattr(item[0], "exit_order", 0) or 0))
        nonzero = False
        for child, code in ended:
            label = child.spec.label
            if code is None:
                continue
            codes[label] = code
            blamed = bool(code and getattr(child, "blame", None))
            if blamed:      # never started: its command failed (this abort is this exit's own)
                scheduler.abort(child.blame)
            told = scheduler.node_exited(child.spec.role, child.spec.rank, code)
            if code != 0:
                if replace is not None and child.spec.role == "worker" and not failed_before:
                    replace(child, code, told)
                    continue
                if settings.replicas and child.spec.role == "server" and not failed_before:
                    # replicated servers: the scheduler hands its chunks to their backups, or
                    # (a chain's second failure) aborts the job, found at the next turn
                    log.warning("%s %s: with KVSTORE_REPLICAS=1 the scheduler hands its chunks to their "
                                "backups, has it started again (the job had not formed), or ends the job "
                                "(a chain's second failure)", label, describe_exit(code))
                    continue
                if not failed_before and (blamed or not _after_failure(scheduler, told)):
                    return label, code
                nonzero = True
        if replace is not None:
            replace.judge(scheduler)
        if settings.replicas:
            if again is not None and scheduler.failure is None:
                again(scheduler.start_again)
            _end_failed_over(children, codes, scheduler.failed_over, failed_over_ended)
            if restart is not None and scheduler.failure is None and not scheduler.done:
                restart(scheduler.failed_over)
        if scheduler.failure is not None and (nonzero or len(codes) < len(children)):
            return "scheduler", 1  # e.g. a stuck process (heartbeats), a reported exception
        if replace is not None and scheduler.done and scheduler.failure is None:
            # every node finished or left: a worker that was removed for silence (e.g.
            # stopped) has no job any more; the others get SETTLE seconds to exit
            done_at = done_at or time.monotonic()
            if time.monotonic() > done_at + SETTLE:
                log.warning("the elastic job is over; stopping what is left of it")
                return None
        workers = [c for c in children if c.spec.role == "worker"]
        if all(c.spec.label in codes for c in workers):
            if len(codes) == len(children):
                return None
            if scheduler.done and all(c.spec.label in codes for c in children if c.spec.replaces is None):
                return None     # a replacement server still starting: the job ended without it
            # servers leave once the scheduler tells them every worker finished
            if servers_done_by is None:
                servers_done_by = time.monotonic() + settings.heartbeat_timeout + 5
            elif time.monotonic() > servers_done_by:
                log.warning("servers did not exit after the workers finished; stopping them")
                return None
        time.sleep(TICK)  # a poll interval of the monitor, not synchronisation
    return None


def _after_failure(scheduler: SchedulerProcess, told: int) -> bool:
    """Whether the launcher's exit number ``told`` came after the job had failed (a
    consequence: the scheduler aborted the job, and a process it told exited), not
    its cause. The scheduler's word on it may reach the launcher later than that
    exit (the abort reaches the process over its socket, the failure the launcher
    over the scheduler's pipe): it is awaited, up to HEARD seconds."""
    scheduler.wait_heard(told, HEARD)
    after = scheduler.heard.failed_after
    return after is not None and after < told and scheduler.failure is not None


def _end_failed_over(children, codes, failed_over: frozenset, ended: set) -> None:
    """Replicated servers: a server whose chunks the scheduler handed to their backups
    (it went silent: stopped, cut off) must not come back to serve stale values: if
    its process still runs, it is killed (SIGKILL) now (once: ``ended`` keeps their labels)."""
    for child in children:
        label = child.spec.label
        if child.spec.role == "server" and child.spec.rank in failed_over and label not in codes \
                and label not in ended and child.poll() is None:
            log.warning("%s was failed over (its backup serves its chunks) but still runs: killing it", label)
            child.signal(signal.SIGKILL)
            ended.add(label)


def _settle(children, codes, scheduler, signals) -> None:
    """The scheduler found a failure and told every node to stop. Give the
    processes its message names (the one that reported it is usually exiting
    already) up to SETTLE seconds to end by themselves, so that the table shows
    how they ended instead of the teardown's signal."""
    named = set(named_nodes(scheduler.failure))
    deadline = time.monotonic() + SETTLE
    while not signals.received:
        waiting = False
        for child in children:
            label = child.spec.label
            if label in codes:
                continue
            code = child.poll()
            if code is None:
                waiting = waiting or label in named
                continue
            codes[label] = code
            scheduler.node_exited(child.spec.role, child.spec.rank, code)
        if not waiting or time.monotonic() > deadline:
            return
        time.sleep(TICK)  # a poll interval, not synchronisation


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
