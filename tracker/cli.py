"""Command-line pieces shared by the remote launchers (ssh, mpi, slurm).

Each launcher module is a thin click command: it parses its own options, then
calls :func:`job_spec` and :func:`tracker.launcher.run_cli` with a function that
starts processes its way.
"""

from __future__ import annotations

import difflib
import logging
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import click

from .control import env
from .launcher import THREAD_VARS, JobSpec, cpu_count, with_default_threads

CONTEXT = {"ignore_unknown_options": True, "allow_interspersed_args": False,
           "help_option_names": ["-h", "--help"], "max_content_width": 100}

PYTHON_NAMES = ("python", "python3")

# other launchers' names for our options (torchrun, mpirun, MXNet's launch.py)
OTHER_NAMES = {"--nproc-per-node": "-n", "--nproc_per_node": "-n", "-np": "-n", "--num-workers": "-n",
               "--num_workers": "-n", "--num-servers": "-s", "--num_servers": "-s", "--hostfile": "-H"}


class LauncherCommand(click.Command):
    """A launcher's command: COMMAND follows the options, so an option it does not
    know would be taken for the start of COMMAND and the error would name a missing
    required option instead (``Missing option '-n'``). Every word before COMMAND
    that looks like an option must be one of ours; an unknown one is a usage error
    naming it, with the option meant where that is clear (``--nproc-per-node``:
    ``-n``; ``--num-worker``: ``--num-workers``)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        unknown = self.unknown_option(ctx, args)
        if unknown is not None:
            meant = self.suggestion(ctx, unknown)
            raise click.UsageError(f"no such option: {unknown}" + (
                f"; did you mean {meant}?" if meant else " (COMMAND cannot start with '-')"), ctx)
        return super().parse_args(ctx, args)

    def unknown_option(self, ctx: click.Context, args: list[str]) -> str | None:
        """The first word before COMMAND that looks like an option and is none of ours."""
        takes_value = {}
        for param in self.get_params(ctx):
            if isinstance(param, click.Option):
                for name in (*param.opts, *param.secondary_opts):
                    takes_value[name] = not (param.is_flag or param.count)
        words = iter(args)
        for word in words:
            if word == "--" or not word.startswith("-") or word == "-":
                return None
            name = word.partition("=")[0]
            if name in OTHER_NAMES and name not in takes_value:   # -np is not -n p
                return name
            if name in takes_value:
                if takes_value[name] and "=" not in word:
                    next(words, None)
            elif not (not word.startswith("--") and word[:2] in takes_value):   # -n2
                return name
        return None

    def suggestion(self, ctx: click.Context, name: str) -> str:
        """The option meant by ``name`` (``"-n / --num-workers"``), or ``""``."""
        options = {n: p for p in self.get_params(ctx) if isinstance(p, click.Option)
                   for n in (*p.opts, *p.secondary_opts)}
        meant = OTHER_NAMES.get(name)
        if meant not in options:
            close = difflib.get_close_matches(name, [n for n in options if n.startswith("--")], 1, 0.75)
            meant = close[0] if close else None
        if meant is None:
            return ""
        return " / ".join(options[meant].opts)


def common_options(f):
    """-n, -s, --env/--worker-env/--server-env, --host-ip, --log-dir, --kill-grace, --dry-run."""
    options = [
        click.option("-n", "--num-workers", type=click.IntRange(min=1), required=True,
                     help="Number of worker processes (copies of COMMAND)."),
        click.option("-s", "--num-servers", type=click.IntRange(min=1), default=None,
                     help="Number of server processes [default: the number of workers]."),
        click.option("--env", "env_all", multiple=True, metavar="NAME[=VALUE]",
                     help="Pass variable NAME to every process: its value here, or VALUE "
                          "(repeatable). Nothing else from this environment is passed, "
                          "except the KVSTORE_* settings."),
        click.option("--worker-env", "env_worker", multiple=True, metavar="NAME[=VALUE]",
                     help="Like --env, for workers only."),
        click.option("--server-env", "env_server", multiple=True, metavar="NAME[=VALUE]",
                     help="Like --env, for servers only."),
        click.option("--host-ip", default=None, metavar="ADDR|IFACE",
                     help="Address (or network interface) of this machine that the nodes use "
                          "to reach the scheduler, which binds it [default: 127.0.0.1 if every "
                          "node is local, else the address on the route to the first node]."),
        click.option("--log-dir", type=click.Path(file_okay=False), default=None,
                     help="Also write each process's output to LOG_DIR/ROLE-RANK.log here."),
        click.option("--kill-grace", type=click.FloatRange(min=0), default=3.0, show_default=True,
                     help="Seconds between SIGTERM and SIGKILL when tearing the job down."),
        click.option("--dry-run", is_flag=True, help="Print what would run where; start nothing."),
        resume_option(),
        server_device_option(),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def resume_option():
    """--resume: the servers start from their checkpoints (KVSTORE_RESUME=1 for every process)."""
    def set_resume(ctx, param, value):
        if value:
            os.environ["KVSTORE_RESUME"] = "1"
    return click.option("--resume", is_flag=True, expose_value=False, callback=set_resume,
                        help="Resume the job from the servers' checkpoints in KVSTORE_CHECKPOINT_DIR "
                             "(run the same command as before plus --resume).")


def server_device_option():
    """--server-device cpu|gpu: where servers keep values and optimizer state
    (KVSTORE_SERVER_DEVICE for every process; see docs/gpu.md)."""
    def set_device(ctx, param, value):
        if value is not None:
            os.environ["KVSTORE_SERVER_DEVICE"] = value
    return click.option("--server-device", type=click.Choice(env.SERVER_DEVICES), default=None,
                        expose_value=False, callback=set_device,
                        help="Where servers keep values, sums and optimizer state: cpu, or gpu "
                             "(server s on GPU s mod the host's GPUs, or KVSTORE_SERVER_GPUS) "
                             "[default: KVSTORE_SERVER_DEVICE, else cpu].")


def elastic_options(f):
    """--elastic MIN:MAX (KVSTORE_ELASTIC for the scheduler and every process) and
    --max-restarts N: workers that fail leave the job instead of ending it, and new
    ones may join (docs/elastic.md). Only for launchers that start each worker
    themselves (tracker.local, tracker.ssh)."""
    def set_elastic(ctx, param, value):
        if value is not None:
            os.environ["KVSTORE_ELASTIC"] = value
    f = click.option("--max-restarts", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Elastic jobs: start a new worker in place of one that failed, at most "
                          "this many times in all (it joins the running job).")(f)
    return click.option("--elastic", metavar="MIN:MAX", default=None, expose_value=False,
                        callback=set_elastic,
                        help="Elastic workers (as torchrun's --nnodes=MIN:MAX): a worker that fails "
                             "leaves the job while at least MIN remain, and workers may join up to "
                             "MAX; -n workers start [default: fail-fast, KVSTORE_ELASTIC].")(f)


def restart_servers_option(f):
    """--restart-servers N: replicated servers (KVSTORE_REPLICAS=1) get a new server
    in place of a dead one, at most N in all (JobSpec.restart_servers; docs/reliability.md).
    Only for launchers that start each process themselves (tracker.local, tracker.ssh)."""
    return click.option("--restart-servers", type=click.IntRange(min=0), default=0, show_default=True,
                        help="Replicated servers (KVSTORE_REPLICAS=1): start a new server in place of one "
                             "whose chunks its backups took over, at most this many times in all; it "
                             "becomes the backup of the shares that lost theirs, so that a later failure "
                             "is survived too.")(f)


def check_elastic(settings: env.Settings, num_workers: int) -> None:
    """-n must lie within --elastic MIN:MAX (a usage error before anything starts)."""
    if settings.elastic is not None:
        low, high = settings.elastic
        if not low <= num_workers <= high:
            raise click.UsageError(f"-n {num_workers} is outside --elastic {low}:{high}: start "
                                   "between MIN and MAX workers")


def refuse_elastic(settings: env.Settings, launcher: str) -> None:
    """mpirun and srun end every process when one fails: no elastic jobs there."""
    if settings.elastic is not None:
        fail(f"KVSTORE_ELASTIC is set, but {launcher} ends every process when one fails: "
             "run elastic jobs with tracker.local or tracker.ssh")


def server_hosts_option(hosts: str, workers: str):
    """--server-hosts FILE: dedicated server hosts (``server_hosts_path``; None
    without it): servers on the ``hosts`` the file lists, workers on ``workers``
    (docs/launching.md, "Dedicated server hosts")."""
    return click.option("--server-hosts", "server_hosts_path", default=None, metavar="FILE",
                        help=f"{hosts} for the servers only (none in both): servers round-robin "
                             f"over these, workers over {workers}.")


def log_level(environ=os.environ) -> str:
    """KVSTORE_LOG_LEVEL of ``environ`` (case-insensitive; default INFO), upper
    case. A value that is not a level is reported (``error: ...``, status 2)."""
    text, level = env.log_level(environ)
    if level is None:
        fail(f"KVSTORE_LOG_LEVEL={text} is invalid: use one of {', '.join(env.LOG_LEVELS)} "
             "(any case)")
    return level


def setup_logging(environ=os.environ) -> None:
    """The launcher's own log lines, on stderr, at KVSTORE_LOG_LEVEL."""
    logging.basicConfig(level=log_level(environ),
                        format="%(asctime)s [launcher] %(levelname)s %(message)s")


def check_command(command) -> tuple[str, ...]:
    if not command:
        raise click.UsageError("Missing argument 'COMMAND...': say what every worker runs")
    if command[0].startswith("-"):
        raise click.UsageError(f"no such option: {command[0]} (COMMAND cannot start with '-')")
    return tuple(command)


def parse_env(pairs, option: str, environ=os.environ) -> dict[str, str]:
    """``NAME`` (value taken from ``environ``) or ``NAME=VALUE`` items."""
    values = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not name or not name.replace("_", "a").isalnum() or name[0].isdigit():
            raise click.BadParameter(f"{pair!r} is not NAME or NAME=VALUE", param_hint=option)
        if not sep:
            if name not in environ:
                raise click.BadParameter(f"{name} is not set in this environment", param_hint=option)
            value = environ[name]
        values[name] = value
    return values


@dataclass
class EnvChoice:
    """The user's allow-list: variables for every process and per role."""
    all: dict
    worker: dict
    server: dict

    @property
    def names(self) -> set[str]:
        return set(self.all) | set(self.worker) | set(self.server)

    def for_role(self, role: str) -> dict:
        return {**self.all, **(self.worker if role == "worker" else self.server)}


def env_choice(env_all, env_worker, env_server) -> EnvChoice:
    return EnvChoice(parse_env(env_all, "--env"), parse_env(env_worker, "--worker-env"),
                     parse_env(env_server, "--server-env"))


def forwarded_settings(environ=os.environ) -> dict[str, str]:
    """The contract's user settings set here (KVSTORE_TIMEOUT, ...), which every
    node must share; the per-process ones (role, rank, addresses) are left out."""
    return {name: environ[name] for var in env.VARIABLES for name in (var.name, *var.aliases)
            if name in environ and name not in env.PER_PROCESS}


def job_spec(*, num_workers: int, num_servers: int | None, command, python: str,
             choice: EnvChoice, scheduler_host: str, kill_grace: float,
             multi_host: bool = False) -> JobSpec:
    """The :class:`JobSpec` of a remote job. A bare ``python``/``python3`` as the
    first word of COMMAND becomes ``python`` (the remote interpreter). When the
    job spans machines (``multi_host``) and the user did not choose,
    ``KVSTORE_SECURE=1``: traffic that crosses a network is encrypted."""
    if command[0] in PYTHON_NAMES:
        command = (python, *command[1:])
    defaults = {}
    if multi_host and not (os.environ.get("KVSTORE_SECURE") or choice.all.get("KVSTORE_SECURE")):
        defaults["KVSTORE_SECURE"] = "1"
    log_level({**os.environ, **choice.all})
    try:
        settings = env.read({**os.environ, **defaults, **choice.all})
    except env.EnvError as e:
        raise click.UsageError(str(e))
    # thread counts the user set here are passed on, like the KVSTORE_* settings
    threads = {name: os.environ[name] for name in THREAD_VARS if os.environ.get(name)}
    return JobSpec(num_workers=num_workers, num_servers=num_servers or num_workers,
                   command=tuple(command), server_command=(python, "-m", "kvstore.server"),
                   scheduler_host=scheduler_host,
                   env={**forwarded_settings(), **threads, **defaults, **choice.all},
                   role_env={"worker": dict(choice.worker), "server": dict(choice.server)},
                   kill_grace=kill_grace, settings=settings)


def default_threads(spec: JobSpec, hosts, cores: dict, uniform: bool = False) -> JobSpec:
    """:func:`tracker.launcher.with_default_threads` for a remote job: ``hosts``
    is the host name of each process (launch order), ``cores`` the cores of each
    host where known (else this machine's count is assumed: a remote host's
    count is not known here before the job starts)."""
    cores = {h: cores.get(h) or cpu_count() for h in hosts}
    return with_default_threads(spec, hosts, cores, {**os.environ, **spec.env}, uniform)


def fail(message: str, code: int = 2) -> NoReturn:
    """A problem found before anything started: print it and exit."""
    click.echo(f"error: {message}", err=True)
    sys.exit(code)
