"""``python -m tracker.local``: run a whole job on this machine.

Starts the scheduler as a child of this process (restarted if it dies), S
server processes and W copies of the command, prefixes every output line with
role and rank, and exits with the first failure's status (every other process
is stopped at once).
"""

from __future__ import annotations

import os
import sys

import click

from .control import env
from .cli import (check_elastic, elastic_options, log_level, restart_servers_option, resume_option,
                  server_device_option, setup_logging)
from .cli import LauncherCommand, parse_env
from .launcher import JobSpec, cpu_count, run_cli, with_default_threads
from .process import Child
from .wrapper import bindable

EXAMPLE = """\b
Example:
  python -m tracker.local -n 2 -s 2 python examples/dist_sync_mlp.py --kvstore dist_sync
Environment variables (KVSTORE_TIMEOUT, KVSTORE_HEARTBEAT_TIMEOUT, ...) are read
here and passed on to every process; see docs/configuration.md.
"""


@click.command(cls=LauncherCommand, context_settings={"ignore_unknown_options": True,
                                 "allow_interspersed_args": False,
                                 "help_option_names": ["-h", "--help"]},
               epilog=EXAMPLE)
@click.option("-n", "--num-workers", type=click.IntRange(min=1), required=True,
              help="Number of worker processes (copies of COMMAND).")
@click.option("-s", "--num-servers", type=click.IntRange(min=1), default=None,
              help="Number of server processes [default: the number of workers].")
@click.option("--env", "env_pairs", multiple=True, metavar="NAME=VALUE",
              help="Extra environment variable for every process (repeatable).")
@click.option("--worker-env", "env_worker", multiple=True, metavar="NAME[=VALUE]",
              help="Variable for workers only: its value here, or VALUE (repeatable).")
@click.option("--server-env", "env_server", multiple=True, metavar="NAME[=VALUE]",
              help="Variable for servers only: its value here, or VALUE (repeatable).")
@click.option("--host-ip", default=None, metavar="ADDR",
              help="Address of this machine that the scheduler and the nodes bind and advertise "
                   "[default: 127.0.0.1].")
@click.option("--log-dir", type=click.Path(file_okay=False), default=None,
              help="Also write each process's output to LOG_DIR/ROLE-RANK.log (without the prefix).")
@click.option("--output-ranks", default=None, metavar="R[,R...]",
              help="Show only these workers' output on the console (as torchrun's --local-ranks-filter); "
                   "servers' and other workers' output still goes to --log-dir.")
@click.option("--kill-grace", type=click.FloatRange(min=0), default=3.0, show_default=True,
              help="Seconds between SIGTERM and SIGKILL when tearing the job down.")
@click.option("--emulate-hosts", type=click.IntRange(min=1), default=None, metavar="K",
              help="Emulate K machines: server and worker of rank r go on host r % K, and "
                   "processes on different hosts talk tcp (shared memory only within one).")
@click.option("--dry-run", is_flag=True, help="Print what would run, start nothing.")
@resume_option()
@server_device_option()
@elastic_options
@restart_servers_option
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def main(num_workers, num_servers, env_pairs, env_worker, env_server, host_ip, log_dir, output_ranks,
         kill_grace, emulate_hosts, dry_run, max_restarts, restart_servers, command):
    """Run COMMAND as NUM_WORKERS workers plus servers and a scheduler, locally."""
    if command[0].startswith("-"):
        raise click.UsageError(f"no such option: {command[0]} (COMMAND cannot start with '-')")
    setup_logging()
    extra = {}
    for pair in env_pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise click.BadParameter(f"{pair!r} is not NAME=VALUE", param_hint="--env")
        extra[name] = value
    log_level({**os.environ, **extra})   # what the servers will be given
    try:
        settings = env.read({**os.environ, **extra})
    except env.EnvError as e:
        raise click.UsageError(str(e))
    check_elastic(settings, num_workers)
    num_servers = num_servers or num_workers
    if host_ip is not None and not bindable(host_ip):
        raise click.BadParameter(f"{host_ip} is not an address of this machine", param_hint="--host-ip")
    role_env = {"worker": parse_env(env_worker, "--worker-env"), "server": parse_env(env_server, "--server-env")}
    where = {"scheduler_host": host_ip, "node_host": host_ip} if host_ip else {}
    spec = JobSpec(num_workers=num_workers, num_servers=num_servers,
                   command=tuple(command), env=extra, role_env=role_env, kill_grace=kill_grace,
                   settings=settings, emulate_hosts=emulate_hosts or 0, max_restarts=max_restarts,
                   restart_servers=restart_servers, **where)
    # every process runs on this machine (emulated hosts too)
    total = num_servers + num_workers
    spec = with_default_threads(spec, ["this machine"] * total, {"this machine": cpu_count()},
                                {**os.environ, **extra})
    shown = _ranks(output_ranks, num_workers)
    spawn = None
    if log_dir and not dry_run:
        os.makedirs(log_dir, exist_ok=True)
    if (log_dir or shown is not None) and not dry_run:
        def spawn(proc):
            visible = shown is None or (proc.role == "worker" and proc.rank in shown)
            out = sys.stdout if visible else _Discard()
            if log_dir:
                out = LogTee(out, os.path.join(log_dir, f"{proc.role}-{proc.rank}.log"),
                             f"[{proc.role}:{proc.rank}] ")
            return Child(proc, out)
    sys.exit(run_cli(spec, dry_run=dry_run, spawn=spawn))


def _ranks(text: str | None, num_workers: int) -> set[int] | None:
    if text is None:
        return None
    try:
        ranks = {int(r) for r in text.split(",") if r.strip()}
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of worker ranks",
                                 param_hint="--output-ranks") from None
    bad = sorted(r for r in ranks if not 0 <= r < num_workers)
    if bad or not ranks:
        raise click.BadParameter(f"worker ranks are 0..{num_workers - 1}, got {text!r}",
                                 param_hint="--output-ranks")
    return ranks


class _Discard:
    """The console output of a process --output-ranks hides."""

    def write(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass


class LogTee:
    """A process's output: to this launcher's stdout as it comes (prefixed) and to
    its log file without the prefix. A log that cannot be written is dropped."""

    def __init__(self, out, path: str, prefix: str):
        self._out, self._prefix = out, prefix
        self._file = open(path, "a", encoding="utf-8")

    def write(self, text: str) -> None:
        self._out.write(text)
        try:
            self._file.write(text[len(self._prefix):] if text.startswith(self._prefix) else text)
            self._file.flush()
        except (OSError, ValueError):
            pass

    def flush(self) -> None:
        self._out.flush()


if __name__ == "__main__":
    main()
