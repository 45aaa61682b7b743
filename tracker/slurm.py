"""``python -m tracker.slurm``: run a job through srun, inside a Slurm allocation.

The scheduler runs as a child of this process (the batch script's node, or wherever srun is
called); one ``srun --ntasks=S+W`` starts the node wrapper in every task, which
becomes server ``r`` (``SLURM_PROCID`` r < S) or worker ``r - S``. Outside an
allocation srun requests one itself.

With ``--server-hosts FILE`` (dedicated server nodes, inside an allocation) the
servers run on the file's nodes and the workers on the allocation's other nodes,
each group round-robin: the launcher writes the node of every task, in task
order, to a file that srun reads with ``--distribution=arbitrary``
(``SLURM_HOSTFILE``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile

import click

from . import hostfile
from .cli import (CONTEXT, LauncherCommand, check_command, common_options, default_threads, env_choice, fail,
                  job_spec, refuse_elastic, server_hosts_option, setup_logging)
from .group import GroupCommand, run_group
from .addresses import ipaddress_is_loopback, scheduler_address

EXAMPLE = """\b
Example (in a batch script, e.g. sbatch -N 2 --ntasks=4 job.sh):
  python -m tracker.slurm -n 2 -s 2 python train_cifar10.py --kvstore dist_sync
\b
  python -m tracker.slurm -n 4 -s 2 --host-ip ib0 --srun-arg=--cpus-per-task=4 python train.py
\b
  python -m tracker.slurm -n 4 -s 4 --server-hosts cpu_nodes python train.py
\b
Tasks 0..S-1 (SLURM_PROCID) are servers, S..S+W-1 workers; srun places them
(--srun-arg=--distribution=...), or with --server-hosts: servers on those nodes
of the allocation, workers on its other nodes. See docs/launching.md.
"""


def allocation_nodes(environ=os.environ) -> list[str]:
    """Host names of the current allocation (empty outside one)."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist or not shutil.which("scontrol"):
        return []
    r = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                       timeout=30)
    return r.stdout.split() if r.returncode == 0 else []


def place_apart(path: str, nodes: list[str], num_servers: int, num_workers: int,
                oversubscribe: bool) -> list[hostfile.Host]:
    """The node of every task when servers have nodes of their own: the nodes
    of the host file at ``path`` (node names, optional ``slots=N``; all in the
    allocation ``nodes``) for the servers, the allocation's other nodes for the
    workers, each group round-robin. Raises HostfileError naming the file."""
    where = f"--server-hosts {path}"
    if not nodes:
        raise hostfile.HostfileError(
            f"{where}: dedicated server nodes need an allocation (run inside sbatch or salloc "
            "with the server and worker nodes): its other nodes run the workers")
    servers = hostfile.read(path, "--server-hosts")
    odd = [h.name for h in servers if h.user or h.port is not None]
    if odd:
        raise hostfile.HostfileError(f"{where}: give node names only, not {', '.join(odd)}")
    outside = [h.name for h in servers if h.host not in nodes]
    if outside:
        raise hostfile.HostfileError(
            f"{where}: {', '.join(outside)} {'is' if len(outside) == 1 else 'are'} not in this "
            f"allocation ({', '.join(nodes)})")
    workers = [hostfile.Host(n) for n in nodes if n not in {h.host for h in servers}]
    if not workers:
        raise hostfile.HostfileError(
            f"{where} lists every node of the allocation ({', '.join(nodes)}): none is left "
            "for the workers; allocate worker nodes too (e.g. sbatch -N 4, two of them in FILE)")
    return hostfile.place_apart(workers, servers, num_servers, num_workers, oversubscribe,
                                ("the allocation's other nodes", where))


def default_addresses(nodes: list[str]) -> list[str]:
    """Addresses of the allocation's nodes; this machine's own address when it is
    not known (srun outside an allocation)."""
    found = []
    for name in nodes or [socket.gethostname()]:
        try:
            found.append(socket.gethostbyname(name))
        except OSError:
            continue
    return found


@click.command(cls=LauncherCommand, context_settings=CONTEXT, epilog=EXAMPLE)
@common_options
@click.option("--srun", default="srun", show_default=True, help="The srun program.")
@click.option("--srun-arg", multiple=True, metavar="ARG", help="Extra srun argument (repeatable).")
@click.option("--python", "python", default=sys.executable, show_default=True,
              help="Interpreter on the nodes (for servers, the wrapper and a bare 'python').")
@server_hosts_option("Nodes of the allocation (one name a line)", "its other nodes")
@click.option("--oversubscribe", is_flag=True,
              help="Allow more tasks than the allocation's (srun --overcommit).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def main(num_workers, num_servers, env_all, env_worker, env_server, host_ip, log_dir, kill_grace,
         dry_run, srun, srun_arg, python, server_hosts_path, oversubscribe, command):
    """Run COMMAND as NUM_WORKERS workers plus servers as the tasks of one srun,
    with the scheduler on this machine."""
    command = check_command(command)
    setup_logging()
    num_servers = num_servers or num_workers
    count = num_servers + num_workers
    choice = env_choice(env_all, env_worker, env_server)
    if shutil.which(srun) is None:
        fail(f"{srun} not found: run inside a Slurm installation (or give --srun)")
    allocated = os.environ.get("SLURM_NTASKS") or os.environ.get("SLURM_NPROCS")
    if allocated and allocated.isdigit() and count > int(allocated) and not oversubscribe:
        fail(f"{count} tasks ({num_servers} servers + {num_workers} workers) exceed the "
             f"allocation's {allocated} tasks; allocate more or allow --oversubscribe")
    placed = None
    try:
        allocated_nodes = allocation_nodes()
        if server_hosts_path is not None:
            placed = place_apart(server_hosts_path, allocated_nodes, num_servers, num_workers,
                                 oversubscribe)
        addresses = default_addresses(allocated_nodes)
        nodes = [(ipaddress_is_loopback(a), a) for a in addresses]
        sched_host = scheduler_address(host_ip, nodes)
    except (ValueError, subprocess.SubprocessError, OSError) as e:
        fail(str(e))
    spec = job_spec(num_workers=num_workers, num_servers=num_servers, command=command,
                    python=python, choice=choice, scheduler_host=sched_host, kill_grace=kill_grace,
                    multi_host=not all(loopback for loopback, _ in nodes))
    refuse_elastic(spec.settings, "tracker.slurm (srun)")
    # threads: one value for every task (one environment); srun places the tasks,
    # estimated as spread evenly over the allocation's nodes, each with the cores
    # Slurm gave this node (SLURM_CPUS_ON_NODE) or, outside an allocation, this machine's
    names = [addr for _, addr in nodes] or ["this machine"]
    on_node = os.environ.get("SLURM_CPUS_ON_NODE", "")
    hosts = [h.name for h in placed] if placed else [names[i % len(names)] for i in range(count)]
    spec = default_threads(spec, hosts, {n: int(on_node) if on_node.isdigit() else None
                                          for n in hosts}, uniform=True)

    def prefix(procs, job) -> list[str]:
        argv = [srun, f"--ntasks={len(procs)}", "--kill-on-bad-exit=1", "--export=ALL",
                f"--job-name=kvstore-{job}"] + (["--distribution=arbitrary"] if placed else [])
        return argv + (["--overcommit"] if oversubscribe else []) + list(srun_arg)

    command = GroupCommand("srun", "tasks", ["SLURM_PROCID"], prefix)
    if not placed:
        sys.exit(run_group(spec, command, python=python, scheduler_host=sched_host,
                           dry_run=dry_run, log_dir=log_dir))
    labels = [p.label for p in spec.processes(0)]
    click.echo(f"placement (servers on --server-hosts, workers on the allocation's other nodes):\n"
               f"{hostfile.describe(labels, placed)}", err=True)
    with tempfile.TemporaryDirectory(prefix="kvstore-slurm-") as tmp:
        # srun --distribution=arbitrary: task i on line i of SLURM_HOSTFILE
        os.environ["SLURM_HOSTFILE"] = os.path.join(tmp, "tasks")
        with open(os.environ["SLURM_HOSTFILE"], "w", encoding="utf-8") as f:
            f.write("".join(f"{h.host}\n" for h in placed))
        sys.exit(run_group(spec, command, python=python, scheduler_host=sched_host,
                           dry_run=dry_run, log_dir=log_dir))


if __name__ == "__main__":
    main()
