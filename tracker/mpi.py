"""``python -m tracker.mpi``: run a job through mpirun (Open MPI or MPICH).

The scheduler runs as a child of this process; one ``mpirun -np S+W`` starts the node
wrapper on every rank, which becomes server ``r`` (r < S) or worker ``r - S``
from the MPI rank variable and runs that role's command. The host file is
passed to mpirun as it is (Open MPI: ``--hostfile``, MPICH: ``-f``).

With ``--server-hosts FILE`` (dedicated server hosts) the servers run on that
file's hosts and the workers on the ``-H`` hosts, each group round-robin over
its hosts. Open MPI: one app context per group, each with its own host file,
mapped ``--map-by node`` (``mpirun ... -np S --hostfile SERVERS WRAPPER : -np W
--hostfile WORKERS WRAPPER``). MPICH's hydra has one host list for the whole
command, but keeps a repeated entry as its own slot, in order: the rank-by-rank
list ``-hosts s1:1,s2:1,...,w1:1,...`` places each rank exactly.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from typing import Callable

import click

from . import hostfile
from .cli import (CONTEXT, LauncherCommand, check_command, common_options, default_threads, env_choice, fail,
                  job_spec, refuse_elastic, server_hosts_option, setup_logging)
from .group import GroupCommand, run_group, split_env
from .addresses import resolve, scheduler_address

RANK_VARS = {"openmpi": ["OMPI_COMM_WORLD_RANK", "PMIX_RANK"],
             "mpich": ["PMI_RANK", "PMIX_RANK", "MPI_LOCALRANKID"]}

EXAMPLE = """\b
Example:
  python -m tracker.mpi -n 2 -s 2 -H hosts python train_cifar10.py --kvstore dist_sync
\b
  python -m tracker.mpi -n 4 -s 2 -H hosts --oversubscribe --env PYTHONPATH \\
      --mpi-arg=--mca --mpi-arg=btl_tcp_if_include --mpi-arg=eth0 python train.py
\b
  python -m tracker.mpi -n 4 -s 4 -H gpu_hosts --server-hosts cpu_hosts python train.py
\b
Ranks 0..S-1 are servers, S..S+W-1 workers. The host file is in your MPI's own
format (Open MPI: "node1 slots=4"; MPICH: "node1:4") and goes to mpirun as it is.
With --server-hosts (same format), servers run on those hosts, workers on -H's.
See docs/launching.md.
"""


def detect(mpirun: str) -> str:
    """'openmpi' or 'mpich', from ``mpirun --version``."""
    try:
        r = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ValueError(f"cannot run {mpirun} --version: {e}") from None
    text = r.stdout + r.stderr
    if "Open MPI" in text or "OpenRTE" in text:
        return "openmpi"
    if "HYDRA" in text or "MPICH" in text or "Intel(R) MPI" in text:
        return "mpich"
    raise ValueError(f"{mpirun} is neither Open MPI nor MPICH (it said: {text.strip()[:200]!r}); "
                     "choose with --mpi")


def mpirun_argv(kind: str, mpirun: str, count: int | None, hostfile_path: str | None,
                oversubscribe: bool, names: list[str], extra: tuple[str, ...]) -> list[str]:
    """mpirun and its options, before the node wrapper; ``count`` None: the
    number of ranks and the hosts come later (``--server-hosts``)."""
    argv = [mpirun]
    if kind == "openmpi":
        if count is not None:
            argv += ["-np", str(count)]
        if hostfile_path:
            argv += ["--hostfile", hostfile_path]
        if os.geteuid() == 0:
            argv.append("--allow-run-as-root")
        if oversubscribe:
            argv.append("--oversubscribe")
        argv += ["--bind-to", "none"]
        for name in names:
            argv += ["-x", name]
    else:
        argv += ["-n", str(count)] if count is not None else []
        if hostfile_path:
            argv += ["-f", hostfile_path]
        # hydra passes the whole environment by default
    return argv + list(extra)


def read_hosts(kind: str, path: str, option: str | None = None) -> list[hostfile.Host]:
    """A host file in the MPI's own format: Open MPI's ``node slots=N`` is ours;
    MPICH's ``node:N`` (N processes) is read as a host with N slots."""
    hosts = hostfile.read(path, option)
    return [hostfile.Host(h.host, slots=h.port) for h in hosts] if kind == "mpich" else hosts


def apart_argv(kind: str, placed: list[hostfile.Host], num_servers: int,
               files: tuple[str, str]) -> tuple[list[str], Callable | None]:
    """Dedicated server hosts: the words after mpirun's own options, and the tail
    (:class:`tracker.group.GroupCommand`; None: the wrapper alone) that places
    servers on the hosts of ``files[1]`` and workers on those of ``files[0]``, as
    ``placed`` says. Open MPI's ``-x NAME`` holds for one app context: each
    context exports the names itself."""
    if kind == "openmpi":
        def tail(procs, wrapper: list[str]) -> list[str]:
            exports = [w for name in sorted(split_env(procs)[1]) for w in ("-x", name)]
            return ["-np", str(num_servers), "--hostfile", files[1], *exports, *wrapper, ":",
                    "-np", str(len(procs) - num_servers), "--hostfile", files[0], *exports,
                    *wrapper]
        return ["--map-by", "node"], tail
    return ["-n", str(len(placed)), "-hosts", ",".join(f"{h.host}:1" for h in placed)], None


def check_slots(kind: str, hostfile_path: str | None, count: int, oversubscribe: bool) -> None:
    """Refuse more processes than Open MPI would place without --oversubscribe."""
    if kind != "openmpi" or oversubscribe:
        return
    if hostfile_path is None:
        capacity, where = os.cpu_count() or 1, f"the {os.cpu_count()} cores of this machine"
    else:
        hosts = hostfile.read(hostfile_path)
        slots = hostfile.capacity(hosts)
        if slots is None:
            return  # Open MPI decides (cores of each host)
        capacity, where = slots, f"the {slots} slots of {hostfile_path}"
    if count > capacity:
        raise hostfile.HostfileError(
            f"{count} processes do not fit in {where}; add slots or allow --oversubscribe")


@click.command(cls=LauncherCommand, context_settings=CONTEXT, epilog=EXAMPLE)
@common_options
@click.option("-H", "--hostfile", "hostfile_path", default=None, metavar="FILE",
              help="MPI host file, passed to mpirun as it is [default: this machine only].")
@server_hosts_option("Hosts (same format as -H, which it needs)", "the -H hosts")
@click.option("--mpi", "kind", type=click.Choice(["auto", "openmpi", "mpich"]), default="auto",
              show_default=True, help="Which MPI mpirun belongs to.")
@click.option("--mpirun", default="mpirun", show_default=True, help="The mpirun program.")
@click.option("--mpi-arg", multiple=True, metavar="ARG", help="Extra mpirun argument (repeatable).")
@click.option("--python", "python", default=sys.executable, show_default=True,
              help="Interpreter on the nodes (for servers, the wrapper and a bare 'python').")
@click.option("--oversubscribe", is_flag=True, help="Allow more processes than slots.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def main(num_workers, num_servers, env_all, env_worker, env_server, host_ip, log_dir, kill_grace,
         dry_run, hostfile_path, server_hosts_path, kind, mpirun, mpi_arg, python, oversubscribe,
         command):
    """Run COMMAND as NUM_WORKERS workers plus servers through mpirun, with the
    scheduler on this machine."""
    command = check_command(command)
    setup_logging()
    num_servers = num_servers or num_workers
    choice = env_choice(env_all, env_worker, env_server)
    if shutil.which(mpirun) is None:
        fail(f"{mpirun} not found: install Open MPI or MPICH (or give --mpirun)")
    if hostfile_path is not None and not os.path.isfile(hostfile_path):
        fail(f"cannot read host file {hostfile_path!r}")
    if server_hosts_path is not None and hostfile_path is None:
        fail("--server-hosts needs -H FILE: the hosts of the workers")
    placed = server_hosts = None
    try:
        kind = detect(mpirun) if kind == "auto" else kind
        hosts = read_hosts(kind, hostfile_path) if hostfile_path else []
        if server_hosts_path is None:
            check_slots(kind, hostfile_path, num_servers + num_workers, oversubscribe)
        else:
            server_hosts = read_hosts(kind, server_hosts_path, "--server-hosts")
            placed = hostfile.place_apart(
                hosts, server_hosts, num_servers, num_workers, oversubscribe,
                (f"-H {hostfile_path}", f"--server-hosts {server_hosts_path}"))
            hosts = hosts + server_hosts
        sched_host = scheduler_address(host_ip, [(h.is_loopback, resolve(h)) for h in hosts])
    except (ValueError, hostfile.HostfileError) as e:
        fail(str(e))
    spec = job_spec(num_workers=num_workers, num_servers=num_servers, command=command,
                    python=python, choice=choice, scheduler_host=sched_host, kill_grace=kill_grace,
                    multi_host=not all(h.is_loopback for h in hosts))
    refuse_elastic(spec.settings, "tracker.mpi (mpirun)")
    # threads: one value for every rank (one environment); placement is mpirun's,
    # estimated as round-robin over the host file, cores = a host's slots= if given
    names = ([h.name for h in placed or hostfile.place(hosts, num_servers, num_workers, True)]
             if hosts else ["this machine"] * (num_servers + num_workers))
    spec = default_threads(spec, names, {h.name: h.slots for h in hosts}, uniform=True)
    words, tail = [], None
    if placed:
        words, tail = apart_argv(kind, placed, num_servers, (hostfile_path, server_hosts_path))

    def prefix(procs, job) -> list[str]:
        if placed:   # the app contexts export the variables (tail)
            return mpirun_argv(kind, mpirun, None, None, oversubscribe, [], mpi_arg) + words
        names = sorted(split_env(procs)[1])   # Open MPI exports these by name (-x)
        return mpirun_argv(kind, mpirun, len(procs), hostfile_path, oversubscribe, names, mpi_arg)

    command = GroupCommand("mpirun", f"{kind} ranks", RANK_VARS[kind], prefix)
    if tail is not None:
        command = dataclasses.replace(command, tail=tail)
    sys.exit(run_group(spec, command, python=python, scheduler_host=sched_host, dry_run=dry_run,
                       log_dir=log_dir))


if __name__ == "__main__":
    main()
