"""Joining a job that torch's launchers started: ``torchrun`` (standalone or several
nodes) and Kubernetes' PyTorchJob, which set ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` (torchrun also ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``) instead of our ``KVSTORE_*`` variables.

When a worker's environment has torch's variables and none of ours,
``kvstore.create("dist_...")`` calls :func:`join`, which forms the job from them:

- workers: ``RANK`` is the worker rank, ``WORLD_SIZE`` the number of workers;
- the scheduler runs in rank 0's process: under torchrun on a free port that the
  others learn through torchrun's store, elsewhere on ``MASTER_ADDR:MASTER_PORT + 1``
  (``KVSTORE_SCHEDULER_PORT`` sets the port in both cases);
- each host's local rank 0 starts ``KVSTORE_SERVERS_PER_HOST`` server processes
  (1 by default), tied to it by ``PR_SET_PDEATHSIG``: when torchrun tears a worker
  group down, its servers go too. Server ranks follow the node rank
  (``GROUP_RANK``, else ``RANK // LOCAL_WORLD_SIZE``);
- the job's secret: ``KVSTORE_SECRET`` when set (e.g. from a Kubernetes Secret);
  else, under torchrun, rank 0 makes one and hands it to the others through
  torchrun's own store (``TORCHELASTIC_USE_AGENT_STORE``); else the job runs
  without authentication, and says so in its log.

Processes tied to their parents cannot outlive it; rank 0's process waits at exit
until every node of the job has finished (the scheduler lives there), and local
rank 0's until its servers have.

Example (what kvstore.create does)::

    job = detect(os.environ)
    if job is not None:
        environ = {**os.environ, **join(job, os.environ)}
"""

from __future__ import annotations

import atexit
import ipaddress
import logging
import subprocess
import sys
import dataclasses
from dataclasses import dataclass
from typing import Mapping

import zmq

from .control import env
from .control.rendezvous import Scheduler
from .control.security import Security, new_secret
from .wrapper import parent_death_signal, route_address

log = logging.getLogger(__name__)

TORCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
OURS = ("KVSTORE_ROLE", "DMLC_ROLE", "KVSTORE_SCHEDULER_HOST", "DMLC_PS_ROOT_URI")


@dataclass(frozen=True)
class TorchJob:
    """The job as torch's variables describe it."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    scheduler_port: int
    servers_per_host: int

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def num_servers(self) -> int:
        return self.servers_per_host * self.num_nodes

    def server_ranks(self) -> range:
        """The ranks of the servers this node's local rank 0 starts."""
        return range(self.node_rank * self.servers_per_host, (self.node_rank + 1) * self.servers_per_host)


def detect(environ: Mapping[str, str]) -> TorchJob | None:
    """The job torch's launcher formed, when ``environ`` has its variables and none of
    ours (a process our launchers started is theirs); None otherwise. Raises
    env.EnvError naming the variable when one is malformed or they disagree."""
    if any(environ.get(name) for name in OURS) or not all(environ.get(name) for name in TORCH_VARS):
        return None

    def number(name: str, fallback: int | None = None, least: int = 0) -> int:
        text = environ.get(name)
        if not text:
            if fallback is None:
                raise env.EnvError(f"{name} is not set")
            return fallback
        try:
            value = int(text)
        except ValueError:
            raise env.EnvError(f"{name}={text!r}: must be an integer") from None
        if value < least:
            raise env.EnvError(f"{name}={text!r}: must be >= {least}")
        return value

    rank, world = number("RANK"), number("WORLD_SIZE", least=1)
    local_world = number("LOCAL_WORLD_SIZE", 1, least=1)
    local_rank = number("LOCAL_RANK", 0)
    if rank >= world or local_rank >= local_world or world % local_world:
        raise env.EnvError(f"torch's variables disagree: RANK={rank}, WORLD_SIZE={world}, LOCAL_RANK="
                           f"{local_rank}, LOCAL_WORLD_SIZE={local_world} (every node must run "
                           "LOCAL_WORLD_SIZE workers)")
    settings = env.read(environ)
    master_port = number("MASTER_PORT", least=1)
    port = settings.scheduler_port or master_port + 1
    if port > 65535:
        raise env.EnvError(f"MASTER_PORT={master_port}: the scheduler's port MASTER_PORT + 1 is not a "
                           "TCP port; set KVSTORE_SCHEDULER_PORT")
    node = number("GROUP_RANK", rank // local_world)
    if node >= world // local_world:
        raise env.EnvError(f"GROUP_RANK={node}: this job has {world // local_world} nodes")
    return TorchJob(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                    node_rank=node, master_addr=environ["MASTER_ADDR"], scheduler_port=port,
                    servers_per_host=settings.servers_per_host)


def join(job: TorchJob, environ: Mapping[str, str]) -> dict[str, str]:
    """Start what this process hosts (rank 0: the scheduler; local rank 0: this
    node's servers) and return the variables that make it this job's worker.

    Under torchrun (its store reachable), rank 0's scheduler takes a free port and
    hands it, with the job's secret, to the others through that store; elsewhere
    the scheduler is on ``MASTER_PORT + 1`` (or ``KVSTORE_SCHEDULER_PORT``)."""
    settings = env.read(environ)
    store = _RunStore.of(environ, settings.timeout)
    if store is None and not settings.secret:
        log.warning("no KVSTORE_SECRET and no torchrun store: this job's connections are not "
                    "authenticated (set KVSTORE_SECRET for every process to authenticate them)")
    secret = settings.secret or (store.shared("secret", job.rank == 0, new_secret) if store else None)
    # the store through which rank 0 hands its scheduler's free port to the others
    # (None: the port is known, MASTER_PORT + 1 or KVSTORE_SCHEDULER_PORT)
    port_store = store if not settings.scheduler_port else None
    if job.rank == 0:
        port = _host_scheduler(job, settings, secret, 0 if port_store is not None else job.scheduler_port)
    if port_store is not None:
        job = dataclasses.replace(job, scheduler_port=int(port_store.shared("scheduler_port", job.rank == 0,
                                                                               lambda: str(port))))
    node_host = _node_host(job.master_addr, job.scheduler_port)
    common = {"KVSTORE_SECRET": secret} if secret else {}
    if job.local_rank == 0:
        _start_servers(job, environ, node_host, common, settings.timeout)
    return env.for_process(role="worker", rank=job.rank, scheduler_host=job.master_addr,
                           scheduler_port=job.scheduler_port, num_workers=job.world_size,
                           num_servers=job.num_servers, node_host=node_host, extra=common)


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def _node_host(master_addr: str, port: int) -> str:
    """The address this node's processes bind and advertise: loopback for a job on
    one machine, else this machine's address on the route to the master."""
    if _is_loopback(master_addr):
        return "127.0.0.1"
    return route_address(master_addr, port) or "127.0.0.1"


def _host_scheduler(job: TorchJob, settings: env.Settings, secret: str | None, port: int) -> int:
    """Start the job's scheduler in this process on ``port`` (0: a free one); its port."""
    host = job.master_addr if _is_loopback(job.master_addr) else "0.0.0.0"
    try:
        scheduler = Scheduler(job.world_size, job.num_servers, host=host, port=port,
                              timeout=settings.timeout, heartbeat_interval=settings.heartbeat_interval,
                              heartbeat_timeout=settings.heartbeat_timeout,
                              security=Security(secret, settings.secure)).start()
    except zmq.ZMQError as e:
        which = ("KVSTORE_SCHEDULER_PORT" if settings.scheduler_port else
                 f"MASTER_PORT + 1 (MASTER_PORT={port - 1}); choose a MASTER_PORT whose next port is free, "
                 "or set KVSTORE_SCHEDULER_PORT")
        raise env.EnvError(f"rank 0 cannot host the job's scheduler on {host}:{port} ({e.strerror}): "
                           f"that port is {which}") from None
    log.info("scheduler for %d workers and %d servers on %s:%d (torch's launcher)", job.world_size,
             job.num_servers, host, scheduler.port)

    def finish() -> None:
        # the job's other processes still need the scheduler: wait for them (bounded)
        scheduler.wait(settings.timeout)
        scheduler.close()
    atexit.register(finish)
    return scheduler.port


def _start_servers(job: TorchJob, environ: Mapping[str, str], node_host: str, common: dict,
                   timeout: float) -> None:
    torch_only = {"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK"}   # theirs describe the worker
    base = {k: v for k, v in environ.items() if k not in torch_only}
    procs = []
    for rank in job.server_ranks():
        child_env = {**base, **env.for_process(
            role="server", rank=rank, scheduler_host=job.master_addr, scheduler_port=job.scheduler_port,
            num_workers=job.world_size, num_servers=job.num_servers, node_host=node_host, extra=common)}
        procs.append(subprocess.Popen([sys.executable, "-m", "kvstore.server"], env=child_env,
                                      stdin=subprocess.DEVNULL, preexec_fn=parent_death_signal))
    log.info("node %d: started servers %s (pids %s)", job.node_rank, list(job.server_ranks()),
             ", ".join(str(p.pid) for p in procs))

    def reap() -> None:
        # servers end when every worker has finished; a server that does not is stopped
        for p in procs:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    atexit.register(reap)


class _RunStore:
    """torchrun's own store (``TORCHELASTIC_USE_AGENT_STORE``), which every worker
    of the run reaches as torch.distributed's rendezvous does: where rank 0 hands
    the others what it made (keys scoped by the run and its restart)."""

    def __init__(self, store, prefix: str):
        self._store, self._prefix = store, prefix

    @classmethod
    def of(cls, environ: Mapping[str, str], timeout: float) -> "_RunStore | None":
        if environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
            return None
        import datetime

        from torch.distributed import TCPStore    # torchrun runs torch programs: torch is there
        store = TCPStore(environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=float(timeout)))
        return cls(store, f"kvstore/{environ.get('TORCHELASTIC_RUN_ID', 'run')}/"
                          f"{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/")

    def shared(self, name: str, maker: bool, make) -> str:
        """``make()`` on the one process that is ``maker``; everyone gets its value
        (waiting for it up to the store's timeout)."""
        if maker:
            self._store.set(self._prefix + name, make())
        return self._store.get(self._prefix + name).decode()
