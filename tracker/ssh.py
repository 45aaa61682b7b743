"""``python -m tracker.ssh``: run a job on the hosts of a host file, over ssh.

The scheduler runs as a child of this process (on this machine; restarted if it
dies); each server and worker is
started with ``ssh HOST 'cd DIR && exec PYTHON -c <wrapper> ...'``, placed
round-robin over the hosts (servers first; see :mod:`tracker.hostfile`), or, with
``--server-hosts FILE``, servers round-robin over that file's hosts and workers
over the ``-H`` hosts (BytePS's layout: spare CPU machines as servers). The
environment reaches the remote process over ssh's stdin, never a command line.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
import uuid

import click

from . import hostfile
from .control import env
from .cli import (CONTEXT, LauncherCommand, check_command, check_elastic, common_options, default_threads,
                  elastic_options, env_choice, fail, job_spec, restart_servers_option, server_hosts_option,
                  setup_logging)
from .launcher import run_cli
from .outcome import plural
from .preflight import check_host, on_each, sync_dir
from .addresses import resolve, scheduler_address
from .node_output import Sink, wrapper_source
from .remote import RemoteChild, SshOptions, remote_command

EXAMPLE = """\b
Example (hosts: one host per line, e.g. "node1", "node2:2222", "alice@node3 slots=4"):
  python -m tracker.ssh -n 2 -s 2 -H hosts python train_cifar10.py --kvstore dist_sync
\b
  python -m tracker.ssh -n 4 -s 2 -H hosts --host-ip eth0 --sync-dst-dir /tmp/job \\
      --env PYTHONPATH --worker-env WANDB_API_KEY --log-dir logs python train.py
\b
  python -m tracker.ssh -n 4 -s 4 -H gpu_hosts --server-hosts cpu_hosts python train.py
\b
A bare "python" in COMMAND runs the remote interpreter (--remote-python).
Environment: only the KVSTORE_* settings and the --env names are passed on.
Placement: servers 0..S-1 then workers 0..W-1, round-robin over the hosts in
file order, skipping hosts whose slots=N are used up; with --server-hosts,
servers over those hosts and workers over the -H hosts. See docs/launching.md.
"""


@click.command(cls=LauncherCommand, context_settings=CONTEXT, epilog=EXAMPLE)
@common_options
@click.option("-H", "--hostfile", "hostfile_path", required=True, metavar="FILE",
              help="Hosts to run on: 'host', 'host:port' or 'user@host', optional 'slots=N'.")
@server_hosts_option("Hosts (same format as -H)", "the -H hosts")
@click.option("--remote-python", default=sys.executable, show_default=True,
              help="Interpreter on the hosts (for servers, the wrapper and a bare 'python').")
@click.option("--remote-dir", default=None,
              help="Working directory on the hosts [default: this directory's path].")
@click.option("--sync-dst-dir", default=None, metavar="DIR",
              help="First copy this directory to DIR on every host (rsync), and run there.")
@click.option("-F", "--ssh-config", type=click.Path(dir_okay=False), default=None,
              help="ssh configuration file (ssh -F).")
@click.option("-i", "--identity", type=click.Path(dir_okay=False), default=None,
              help="ssh private key (ssh -i).")
@click.option("-o", "--ssh-option", multiple=True, metavar="KEY=VALUE",
              help="Extra ssh option (ssh -o), repeatable.")
@click.option("--connect-timeout", type=click.FloatRange(min=1), default=10.0, show_default=True,
              help="Seconds to wait for each ssh connection.")
@click.option("--oversubscribe", is_flag=True,
              help="Allow more processes than the slots of the host file.")
@elastic_options
@restart_servers_option
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def main(num_workers, num_servers, env_all, env_worker, env_server, host_ip, log_dir, kill_grace,
         dry_run, hostfile_path, server_hosts_path, remote_python, remote_dir, sync_dst_dir, ssh_config, identity,
         ssh_option, connect_timeout, oversubscribe, max_restarts, restart_servers, command):
    """Run COMMAND as NUM_WORKERS workers plus servers on the hosts of a host
    file, over ssh, with the scheduler on this machine."""
    command = check_command(command)
    setup_logging()
    num_servers = num_servers or num_workers
    choice = env_choice(env_all, env_worker, env_server)
    try:
        worker_hosts = hostfile.read(hostfile_path)
        server_hosts = hostfile.read(server_hosts_path, "--server-hosts") if server_hosts_path else []
        if server_hosts:
            placed = hostfile.place_apart(
                worker_hosts, server_hosts, num_servers, num_workers, oversubscribe,
                (f"-H {hostfile_path}", f"--server-hosts {server_hosts_path}"))
        else:
            placed = hostfile.place(worker_hosts, num_servers, num_workers, oversubscribe)
    except hostfile.HostfileError as e:
        fail(str(e))
    hosts = worker_hosts + server_hosts
    how = (f"servers round-robin over the {plural(len(server_hosts), 'server host')}, workers "
           f"over the {plural(len(worker_hosts), 'worker host')}" if server_hosts
           else "round-robin, servers first")
    addresses = {h: resolve(h) for h in hosts}
    try:
        sched_host = scheduler_address(host_ip, [(h.is_loopback, addresses[h]) for h in hosts])
    except ValueError as e:
        fail(f"--host-ip: {e}")
    directory = sync_dst_dir or remote_dir or os.getcwd()
    if not os.path.isabs(directory):
        fail(f"the remote working directory must be an absolute path, not {directory!r}")
    spec = job_spec(num_workers=num_workers, num_servers=num_servers, command=command,
                    python=remote_python, choice=choice, scheduler_host=sched_host,
                    kill_grace=kill_grace, multi_host=not all(h.is_loopback for h in hosts))
    check_elastic(spec.settings, num_workers)
    spec = dataclasses.replace(spec, max_restarts=max_restarts, restart_servers=restart_servers)
    # threads per process: a host's cores (its slots= if given, else this
    # machine's count) // the processes placed on it
    spec = default_threads(spec, [h.name for h in placed], {h.name: h.slots for h in hosts})
    ssh = SshOptions(ssh_config, identity, tuple(ssh_option), connect_timeout)
    job = uuid.uuid4().hex[:12]
    host_of = {(p.role, p.rank): h for p, h in zip(spec.processes(0), placed)}
    host_names = [env.BY_NAME["KVSTORE_NODE_HOST"].name, *env.BY_NAME["KVSTORE_NODE_HOST"].aliases]

    def plan(procs, commands: bool = True) -> str:
        lines = [f"job {job}: scheduler on {sched_host} (this machine); "
                 f"{plural(num_servers, 'server')} and {plural(num_workers, 'worker')} over "
                 f"{plural(len(hosts), 'host')}, in {directory} (placement: {how}):",
                 hostfile.describe([p.label for p in procs], placed)]
        if sync_dst_dir:
            lines.append(f"copy {os.getcwd()}/ to {sync_dst_dir} on every host first (rsync)")
        for proc in procs if commands else ():
            host = host_of[proc.role, proc.rank]
            remote = remote_command(remote_python, directory, job, proc, list(proc.argv))
            lines.append(f"{proc.label} on {host.name}: {shlex.join(ssh.argv(host, '')[:-1])} "
                         f"REMOTE\n    REMOTE = {remote}\n"
                         f"    environment via stdin: {', '.join(sorted(proc.env))}")
        return "\n".join(lines)

    if dry_run:
        sys.exit(run_cli(spec, dry_run=True, show=plan))
    click.echo(plan(spec.processes(0), commands=False), err=True)
    timeout = connect_timeout + 60
    if sync_dst_dir:
        errors = on_each(hosts, lambda h: sync_dir(ssh, h, os.getcwd(), sync_dst_dir, timeout))
        if errors:
            fail("\n       ".join(errors))
    module = spec.server_command[2] if spec.server_command[1:2] == ("-m",) else None
    errors = on_each(hosts, lambda h: check_host(ssh, h, remote_python, directory, module, timeout))
    if errors:
        fail("\n       ".join(errors))
    source = wrapper_source()
    sink = Sink(log_dir=log_dir)

    def spawn(proc):
        # (a replacement server, --restart-servers, goes on the dead one's host)
        host = host_of[proc.role, proc.rank if proc.replaces is None else proc.replaces]
        wanted = proc.env.get("KVSTORE_NODE_HOST") if "KVSTORE_NODE_HOST" in choice.for_role(
            proc.role) else addresses[host]
        if wanted and ":" in wanted:   # an IPv6 host: its IPv4 address on the route to the scheduler
            wanted = None
        header = {"env": proc.env, "label": host.name, "node_host": wanted,
                  "scheduler": [sched_host, int(proc.env["KVSTORE_SCHEDULER_PORT"])],
                  "grace": kill_grace, "host_names": host_names}
        argv = ssh.argv(host, remote_command(remote_python, directory, job, proc,
                                             list(proc.argv), source))
        return RemoteChild(proc, host, argv, header, sink)

    try:
        code = run_cli(spec, spawn=spawn)
    finally:
        sink.close()
    sys.exit(code)


if __name__ == "__main__":
    main()
