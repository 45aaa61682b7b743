"""``python -m tracker.slurm``: run a job through srun, inside a Slurm allocation.

The scheduler runs in this process (the batch script's node, or wherever srun is
called); one ``srun --ntasks=S+W`` starts the node wrapper in every task, which
becomes server ``r`` (``SLURM_PROCID`` r < S) or worker ``r - S``. Outside an
allocation srun requests one itself.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import click

from .cli import (CONTEXT, check_command, common_options, default_threads, env_choice, fail,
                  job_spec, setup_logging)
from .group import GroupCommand, run_group
from .remote import ipaddress_is_loopback, scheduler_address

EXAMPLE = """\b
Example (in a batch script, e.g. sbatch -N 2 --ntasks=4 job.sh):
  python -m tracker.slurm -n 2 -s 2 python train_cifar10.py --kvstore dist_sync
\b
  python -m tracker.slurm -n 4 -s 2 --host-ip ib0 --srun-arg=--cpus-per-task=4 python train.py
\b
Tasks 0..S-1 (SLURM_PROCID) are servers, S..S+W-1 workers; srun places them
(--srun-arg=--distribution=...). See docs/launching.md.
"""


def allocation_nodes(environ=os.environ) -> list[str]:
    """Host names of the current allocation (empty outside one)."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist or not shutil.which("scontrol"):
        return []
    r = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                       timeout=30)
    return r.stdout.split() if r.returncode == 0 else []


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


@click.command(context_settings=CONTEXT, epilog=EXAMPLE)
@common_options
@click.option("--srun", default="srun", show_default=True, help="The srun program.")
@click.option("--srun-arg", multiple=True, metavar="ARG", help="Extra srun argument (repeatable).")
@click.option("--python", "python", default=sys.executable, show_default=True,
              help="Interpreter on the nodes (for servers, the wrapper and a bare 'python').")
@click.option("--oversubscribe", is_flag=True,
              help="Allow more tasks than the allocation's (srun --overcommit).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def main(num_workers, num_servers, env_all, env_worker, env_server, host_ip, log_dir, kill_grace,
         dry_run, srun, srun_arg, python, oversubscribe, command):
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
    try:
        addresses = default_addresses(allocation_nodes())
        nodes = [(ipaddress_is_loopback(a), a) for a in addresses]
        sched_host = scheduler_address(host_ip, nodes)
    except (ValueError, subprocess.SubprocessError, OSError) as e:
        fail(str(e))
    spec = job_spec(num_workers=num_workers, num_servers=num_servers, command=command,
                    python=python, choice=choice, scheduler_host=sched_host, kill_grace=kill_grace,
                    multi_host=not all(loopback for loopback, _ in nodes))
    # threads: one value for every task (one environment); srun places the tasks,
    # estimated as spread evenly over the allocation's nodes, each with the cores
    # Slurm gave this node (SLURM_CPUS_ON_NODE) or, outside an allocation, this machine's
    names = [addr for _, addr in nodes] or ["this machine"]
    on_node = os.environ.get("SLURM_CPUS_ON_NODE", "")
    spec = default_threads(spec, [names[i % len(names)] for i in range(count)],
                           {n: int(on_node) if on_node.isdigit() else None for n in names},
                           uniform=True)

    def prefix(procs, job) -> list[str]:
        argv = [srun, f"--ntasks={len(procs)}", "--kill-on-bad-exit=1", "--export=ALL",
                f"--job-name=kvstore-{job}"]
        return argv + (["--overcommit"] if oversubscribe else []) + list(srun_arg)

    sys.exit(run_group(spec, GroupCommand("srun", "tasks", ["SLURM_PROCID"], prefix),
                       python=python, scheduler_host=sched_host, dry_run=dry_run, log_dir=log_dir))


if __name__ == "__main__":
    main()
