"""Which process runs on which emulated host (benchmarks/harness/netns.py): a kvstore job
(:func:`ps_job`) or torch.distributed gloo ranks (:func:`gloo_ranks`), as
run_group's ``[(label, argv, env)]``. Every process is started as ``ip netns exec
NS PYTHON ...`` (an argument list, never a shell string) with the environment a
launcher would set. ``cluster`` is a :class:`benchmarks.harness.netns.Cluster` (its
``addr``, ``dev`` and ``exec_argv`` per host).

Without explicit hosts the two-machine placement of benchmarks.trainer --link and
benchmarks.chaos holds: rank r on :func:`side_of` (r) (A: even, B: odd).
"""

from __future__ import annotations

import os
import random
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child_env(extra: dict) -> dict:
    """The environment of a process on any host: this repository importable,
    unbuffered output, and ``extra``."""
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": REPO + (os.pathsep + path if path else ""), "PYTHONUNBUFFERED": "1",
            **extra}


def side_of(rank: int) -> str:
    """The emulated machine of server/worker/gloo rank ``rank`` on a two-machine
    :class:`benchmarks.harness.netns.HostPair` (A: even, B: odd; W=2, S=2: server 0 and worker 0
    with the scheduler on A, server 1 and worker 1 on B)."""
    return "AB"[rank % 2]


def _two_sides(count: int) -> list[str]:
    return [side_of(r) for r in range(count)]


def expected_transports(num_servers: int, server_hosts=None, worker_host: str = "A") -> list[str]:
    """What a worker on ``worker_host`` must report per server (servers on
    ``server_hosts``, default :func:`side_of`): shared memory to the servers on its
    own host, tcp to the others."""
    hosts = server_hosts or _two_sides(num_servers)
    return ["shm" if h == worker_host else "tcp" for h in hosts]


def server_urls(cluster, num_servers: int, server_hosts=None) -> list[str]:
    """The URL prefix at which each server must be reached (tcp): its host's address."""
    return [f"tcp://{cluster.addr[h]}:" for h in server_hosts or _two_sides(num_servers)]


def ps_job(cluster, num_workers: int, num_servers: int, server_argv, worker_argv,
           extra: dict, server_hosts=None, worker_hosts=None) -> list[tuple]:
    """A kvstore job over the hosts: server r on ``server_hosts[r]``, worker r on
    ``worker_hosts[r]`` (default :func:`side_of`), the scheduler on worker 0's host;
    the default transport (shared memory within a host, since the host identity
    includes the network namespace; tcp between hosts, as between machines); each
    process with the environment a launcher would set (tracker/control/env.py
    ``for_process``), the job secret in the environment only."""
    from tracker.control import env as tracker_env
    from tracker.control.security import new_secret
    servers_on = server_hosts or _two_sides(num_servers)
    workers_on = worker_hosts or _two_sides(num_workers)
    home = workers_on[0]
    port = random.randint(20000, 60000)   # a fresh namespace: nothing else listens there
    shared = {"KVSTORE_SECRET": new_secret(),   # the environment, never argv
              "KVSTORE_SECURE": "0", **extra}

    def env(role, rank, host):
        return child_env(tracker_env.for_process(
            role=role, rank=rank, scheduler_host=cluster.addr[home], scheduler_port=port,
            num_workers=num_workers, num_servers=num_servers, node_host=cluster.addr[host],
            extra=shared))
    procs = [("scheduler", cluster.exec_argv(home, [sys.executable, "-m", "tracker.scheduler"]),
              env("scheduler", None, home))]
    procs += [(f"server {r}", cluster.exec_argv(h, server_argv), env("server", r, h))
              for r, h in enumerate(servers_on)]
    procs += [(f"worker {r}", cluster.exec_argv(h, worker_argv), env("worker", r, h))
              for r, h in enumerate(workers_on)]
    return procs


def gloo_ranks(cluster, argv, ranks: int, label: str, extra: dict, hosts=None) -> list[tuple]:
    """torch.distributed ranks over the hosts: rank r on ``hosts[r]`` (default
    :func:`side_of`), the rendezvous on rank 0's host, each rank's gloo on its own
    host's interface (not the host name's address)."""
    hosts = hosts or _two_sides(ranks)
    init = f"tcp://{cluster.addr[hosts[0]]}:{random.randint(20000, 60000)}"
    return [(f"{label} {r}", cluster.exec_argv(hosts[r], argv),
             child_env({"RANK": str(r), "WORLD_SIZE": str(ranks), "BENCH_INIT_METHOD": init,
                        "MASTER_ADDR": cluster.addr[hosts[0]],
                        "GLOO_SOCKET_IFNAME": cluster.dev[hosts[r]], **extra}))
            for r in range(ranks)]
