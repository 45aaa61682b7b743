"""Launchers that start every process of a job with one command (mpirun, srun).

Each MPI/Slurm task runs the node wrapper (:mod:`tracker.wrapper`) in ``rank``
mode: it reads its global rank from the launcher's variable
(``OMPI_COMM_WORLD_RANK``, ``PMI_RANK``, ``SLURM_PROCID``...), becomes server
``r`` when ``r < S`` and worker ``r - S`` otherwise, and starts that role's
command. Its status lines (``@kvstore-node {...}``) tell this process which role
and rank started or ended, so :func:`tracker.launcher.launch` sees one child per
process, as with the local and ssh launchers.

The plan (argv per role, the contract variables: roles, counts, scheduler
address) is an argument of the wrapper; every other variable (the KVSTORE_*
settings, the user's ``--env`` variables) travels in the environment of
mpirun/srun (Open MPI: exported by name, ``-x NAME``), never on a command line.
"""

from __future__ import annotations

import collections
import json
import os
import shlex
import signal
import subprocess
import threading
import uuid
from dataclasses import dataclass
from typing import Callable

import click

from .cli import fail
from .control import env
from .launcher import JobSpec, run_cli
from .process import ProcSpec
from .node_output import PREFIXED, Sink, exit_counter, parse_status, wrapper_source


def split_env(procs: list[ProcSpec]) -> tuple[dict, dict, dict]:
    """Split the processes' variables into (per-role contract variables for the
    plan, which is on a command line; values of every other variable, for the
    environment of mpirun/srun; per-role names to remove). Only the contract
    (roles, counts, scheduler address) goes on the command line: settings and
    the user's variables, secrets included, travel in the environment.
    Raises ValueError if one name has different values for the two roles."""
    plan_env: dict[str, dict[str, str]] = {}
    values: dict[str, str] = {}
    present: dict[str, set[str]] = {}
    for proc in procs:
        plan_env.setdefault(proc.role, {k: v for k, v in proc.env.items()
                                        if k in env.PER_PROCESS and k != "KVSTORE_RANK"})
        present.setdefault(proc.role, set())
        for name, value in proc.env.items():
            if name in env.PER_PROCESS:
                continue
            present[proc.role].add(name)
            if values.setdefault(name, value) != value:
                raise ValueError(f"{name} has different values for workers and servers; "
                                 "this launcher passes one environment to every process")
    drop = {role: sorted(set(values) - names) for role, names in present.items()}
    return plan_env, values, drop


def rank_plan(procs: list[ProcSpec], rank_vars: list[str], grace: float,
              scheduler: tuple[str, int]) -> dict:
    """The wrapper's plan for a job whose processes are ``procs`` (servers first)."""
    plan_env, values, drop = split_env(procs)
    node_var = env.BY_NAME["KVSTORE_NODE_HOST"]
    # an address the user chose (--env KVSTORE_NODE_HOST=...); else each task
    # finds its host's address on the route to the scheduler
    wanted = {role: e.get(node_var.name) for role, e in plan_env.items()
              if e.get(node_var.name) not in (None, "", node_var.default)}
    return {"num_servers": sum(1 for p in procs if p.role == "server"), "rank_vars": rank_vars,
            "grace": grace, "scheduler": list(scheduler), "rank_names": ["KVSTORE_RANK"],
            "host_names": [node_var.name, *node_var.aliases], "node_host": wanted,
            "argv": {p.role: list(p.argv) for p in procs}, "env": plan_env, "drop": drop}


def wrapper_argv(python: str, job: str, plan: dict, source: str | None = None) -> list[str]:
    return [python, "-c", source if source is not None else "<wrapper>", "rank", job,
            json.dumps(plan, separators=(",", ":"))]


class Group:
    """The one command that runs every process; :attr:`children` has one
    child-like object per process for :func:`tracker.launcher.launch`."""

    def __init__(self, name: str, argv: list[str], environ: dict, procs: list[ProcSpec], sink: Sink):
        self.name = name
        self.sink = sink
        self.popen = subprocess.Popen(argv, env=environ, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        self.children = [GroupChild(self, p) for p in procs]
        # (role, rank) -> child, looked up with what a status line says (any JSON values)
        self._by_key: dict[tuple[object, object], GroupChild] = {
            (c.spec.role, c.spec.rank): c for c in self.children}
        self._signalled: set[int] = set()
        self.stopping = False   # the launcher began tearing the job down
        self.own_lines: collections.deque[str] = collections.deque(maxlen=5)   # the command's own output
        self._lock = threading.Lock()
        self._pump = threading.Thread(target=self._read, daemon=True, name=f"output-{name}")
        self._pump.start()

    def _read(self) -> None:
        # read to the end whatever happens to one line (the sink drops output it
        # cannot write): a command blocked on a full pipe would hang the job
        stdout = self.popen.stdout
        assert stdout is not None   # a pipe (stdout=PIPE)
        for raw in iter(stdout.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            msg = parse_status(line)
            if msg is None:
                if PREFIXED.match(line):
                    self.sink.write(line)
                else:
                    self.own_lines.append(line)
                    self.sink.write(f"[{self.name}] {line}")
                continue
            child = self._by_key.get((msg.get("role"), msg.get("rank")))
            if child is not None:
                try:
                    child.on_status(msg)
                except (TypeError, ValueError):   # a malformed status line: show it
                    self.sink.write(f"[{self.name}] {line}")
        stdout.close()

    def drain(self) -> None:
        self._pump.join(2.0)

    def failed_to_start(self) -> str | None:
        """Once the command ended with a failure before any process of it started
        (srun outside an allocation, mpirun that cannot reach a host): what to blame,
        the command and its last words; else None."""
        code = self.popen.poll()
        if not code or any(c.remote_pid is not None or c.host is not None for c in self.children):
            return None
        said = "; ".join(line.strip() for line in self.own_lines if line.strip())
        return f"{self.name} failed (status {code}) before starting any process" + (f": {said}" if said else "")

    def signal(self, sig: int) -> None:
        """Each signal once: SIGTERM to the command (it forwards it to every task),
        SIGKILL to its whole process group.

        mpirun and srun (--kill-on-bad-exit) end every task by themselves once one
        exits non-zero; SIGTERM during that abort is not needed and made Open MPI
        4.1's mpirun crash, so it is skipped then (SIGKILL still follows if the
        command does not end within the grace period)."""
        with self._lock:
            self.stopping = True
            if sig in self._signalled or self.popen.poll() is not None:
                return
            self._signalled.add(sig)
            if sig == signal.SIGTERM and any(c.reported for c in self.children):
                return
        try:
            if sig == signal.SIGKILL:
                os.killpg(self.popen.pid, signal.SIGKILL)
            else:
                self.popen.send_signal(sig)
        except (ProcessLookupError, PermissionError):
            pass

    def finish(self, timeout: float = 15.0) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.popen.wait(5)
        self.drain()


class GroupChild:
    """One process of a :class:`Group` (the interface of ``tracker.process.Child``)."""

    def __init__(self, group: Group, spec: ProcSpec):
        self.group = group
        self.spec = spec
        self.popen = group.popen
        self.host: str | None = None
        self.remote_pid: int | None = None
        self.detail: str | None = None
        self.blame: str | None = None       # the command failed before starting this process
        self.exception: str | None = None   # the last traceback's exception (the wrapper saw it)
        self.exit_order: int | None = None
        self._code: int | None = None

    @property
    def pid(self) -> int | None:
        return self.remote_pid

    @property
    def reported(self) -> int | None:
        """The exit status this process reported (or its group's command gave it), None before."""
        return self._code

    def on_status(self, msg: dict) -> None:
        if msg.get("event") == "started":
            self.remote_pid, self.host = msg.get("pid"), msg.get("host")
        elif msg.get("event") == "exit" and self._code is None:
            self.detail = msg.get("error")
            self.exception = msg.get("exception")
            self.exit_order = next(exit_counter)
            self._code = int(msg.get("code", 1))

    def running(self) -> bool:
        """True until this process reported its exit or the command (mpirun,
        srun) that runs every process ended."""
        return self._code is None and self.popen.poll() is None

    def poll(self) -> int | None:
        if self._code is not None or self.popen.poll() is None:
            return self._code
        self.group.drain()
        if self._code is None and self.group.stopping:
            return None  # ended in the teardown without a word: "killed by launcher"
        if self._code is None:
            code = self.popen.returncode
            self._code = code if code else 0
            self.exit_order = next(exit_counter)
            if code:
                self.detail = (f"{self.group.name} ended with status {code} before this "
                               "process reported its exit")
                self.blame = self.group.failed_to_start()
        return self._code

    def signal(self, sig: int) -> None:
        self.group.signal(sig)

    def finish_output(self, timeout: float = 15.0) -> None:
        self.group.finish(timeout)


def start_group(name: str, make_argv, sink: Sink):
    """A ``start_all`` function for :func:`tracker.launcher.launch`:
    ``make_argv(procs, source)`` builds the command (mpirun/srun + wrapper)."""
    def start_all(procs: list[ProcSpec]):
        environ = {**os.environ, **split_env(procs)[1]}
        return Group(name, make_argv(procs, wrapper_source()), environ, procs, sink).children
    return start_all


@dataclass(frozen=True)
class GroupCommand:
    """How one command starts every process of a job: its name (``mpirun``,
    ``srun``), what it calls the processes (``openmpi ranks``, ``tasks``), the
    variables that hold a process's global rank, ``prefix(procs, job)``: its
    argv before the node wrapper's, and ``tail(procs, wrapper)``: the rest of
    the command line given the wrapper's argv (by default the wrapper itself;
    mpirun's MPMD form repeats it once per app context: ``-np S --hostfile
    SERVERS WRAPPER : -np W --hostfile WORKERS WRAPPER``)."""
    tool: str
    units: str
    rank_vars: list[str]
    prefix: Callable[[list[ProcSpec], str], list[str]]
    tail: Callable[[list[ProcSpec], list[str]], list[str]] = lambda procs, wrapper: wrapper


def run_group(spec: JobSpec, command: GroupCommand, *, python: str, scheduler_host: str,
              dry_run: bool, log_dir: str | None) -> int:
    """The shared tail of the mpi and slurm commands: build the one command line
    (``command.prefix`` + the wrapper with its plan), then print the plan
    (``--dry-run``), or print its first line and run the whole job through it.
    Exits with status 2 if a variable has different values for the two roles."""
    try:
        split_env(spec.processes(0))
    except ValueError as e:
        fail(str(e))
    job = uuid.uuid4().hex[:12]

    def make_argv(procs, source=None):
        port = int(procs[0].env["KVSTORE_SCHEDULER_PORT"])
        plan = rank_plan(procs, command.rank_vars, spec.kill_grace, (scheduler_host, port))
        return command.prefix(procs, job) + command.tail(
            procs, wrapper_argv(python, job, plan, source))

    def show(procs) -> str:
        servers = spec.num_servers
        lines = [f"job {job}: scheduler on {scheduler_host} (this machine); {command.units} "
                 f"0..{servers - 1} are servers, {servers}..{len(procs) - 1} workers",
                 shlex.join(make_argv(procs))]
        lines += [f"{proc.label}: {shlex.join(proc.argv)}" for proc in procs]
        return "\n".join(lines)

    if dry_run:
        return run_cli(spec, dry_run=True, show=show)
    click.echo(show(spec.processes(0)).split("\n")[0], err=True)
    sink = Sink(log_dir=log_dir)
    try:
        return run_cli(spec, start_all=start_group(command.tool, make_argv, sink))
    finally:
        sink.close()
