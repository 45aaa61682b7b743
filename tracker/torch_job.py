"""Joining a job that torch's launchers started: ``torchrun`` (standalone or several
nodes) and Kubernetes' PyTorchJob, which set ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` (torchrun also ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``) instead of our ``KVSTORE_*`` variables.

When a worker's environment has torch's variables and none of ours,
``kvstore.create("dist_...")`` calls :func:`join`, which forms the job from them:

- workers: ``RANK`` is the worker rank, ``WORLD_SIZE`` the number of workers;
- the scheduler runs in rank 0's process, listening on the address ``MASTER_ADDR``
  names on that host (or that host's address on the route to it), never on every
  interface: under torchrun on a free port that the others learn through torchrun's
  store, elsewhere on ``MASTER_ADDR:MASTER_PORT + 1`` (``KVSTORE_SCHEDULER_PORT``
  sets the port in both cases);
- each host's local rank 0 starts ``KVSTORE_SERVERS_PER_HOST`` server processes
  (1 by default), tied to it by ``PR_SET_PDEATHSIG``: when torchrun tears a worker
  group down, its servers go too. Server ranks follow the node rank
  (``GROUP_RANK``, else ``RANK // LOCAL_WORLD_SIZE``);
- the job's secret: ``KVSTORE_SECRET`` or ``KVSTORE_SECRET_FILE`` (e.g. from a
  Kubernetes Secret), the same for every process; without one the job runs without
  authentication, and says so in its log. The secret never enters torchrun's store,
  which anyone who reaches its port may read and write without credentials; the
  scheduler's port travels there (it is no secret), signed with the secret when
  there is one (HMAC-SHA256), so that a port written by another process is refused
  instead of sending this job's credentials to whoever listens there.

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
import hashlib
import hmac
import ipaddress
import logging
import socket
import subprocess
import sys
import dataclasses
from dataclasses import dataclass
from typing import Mapping

import zmq

from .control import env
from .control.rendezvous import Scheduler
from .control.security import Security
from .wrapper import bindable, parent_death_signal, route_address

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
    hands it to the others through that store (signed with the job's secret);
    elsewhere the scheduler is on ``MASTER_PORT + 1`` (or ``KVSTORE_SCHEDULER_PORT``).
    The secret comes from this process's environment only (KVSTORE_SECRET,
    KVSTORE_SECRET_FILE)."""
    settings = env.read(environ)
    secret = settings.secret
    if not secret:
        log.warning("no KVSTORE_SECRET or KVSTORE_SECRET_FILE: this job's connections are not "
                    "authenticated (give every process the job's secret to authenticate them: "
                    "docs/launching.md, torchrun and PyTorchJob)")
    # the store through which rank 0 hands its scheduler's free port to the others
    # (None: the port is known, MASTER_PORT + 1 or KVSTORE_SCHEDULER_PORT)
    port_store = _RunStore.of(environ, settings.timeout) if not settings.scheduler_port else None
    if job.rank == 0:
        port = _host_scheduler(job, settings, secret, 0 if port_store is not None else job.scheduler_port)
    if port_store is not None:
        job = dataclasses.replace(job, scheduler_port=port_store.scheduler_port(
            port if job.rank == 0 else None, secret))
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


def _scheduler_host(master_addr: str, port: int) -> str:
    """Where rank 0's scheduler listens: the IPv4 address ``master_addr`` names here
    when it is one of this machine's (the others connect to that name), else this
    machine's address on the route to it (e.g. behind a Kubernetes Service's
    address). Never every interface (0.0.0.0)."""
    try:
        named = socket.getaddrinfo(master_addr, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError):
        named = None
    if named and bindable(named):
        if ipaddress.ip_address(named).is_loopback and not _is_loopback(master_addr):
            log.warning("MASTER_ADDR=%s names %s, a loopback address, on this host: rank 0's scheduler "
                        "listens there, which other hosts cannot reach; give MASTER_ADDR (torchrun's "
                        "--master-addr or --rdzv-endpoint) as an address of this host that they reach",
                        master_addr, named)
        return str(named)
    return _node_host(master_addr, port)


def _host_scheduler(job: TorchJob, settings: env.Settings, secret: str | None, port: int) -> int:
    """Start the job's scheduler in this process on ``port`` (0: a free one); its port."""
    host = _scheduler_host(job.master_addr, job.scheduler_port)
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
    the others its scheduler's port (keys scoped by the run and its restart).

    That store has no authentication (anyone who reaches its port reads and writes
    it) and listens on every interface: nothing that authenticates goes in it, and
    what comes out is checked. The port is signed with an HMAC of the job's secret."""

    PORT = "scheduler_port"

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

    def _tag(self, secret: str, port: str) -> str:
        # bound to this run and restart (the key's prefix) and the port: not replayable
        message = f"kvstore torchrun scheduler port {self._prefix}{self.PORT}={port}".encode()
        return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()

    def scheduler_port(self, port: int | None, secret: str | None) -> int:
        """Rank 0 (``port``: its scheduler's) writes it; everyone gets it, waiting up to
        the store's timeout. With a ``secret`` the value carries its HMAC, and a value
        without the right one (written by a process without the secret) is refused:
        raises env.EnvError naming the key."""
        key = self._prefix + self.PORT
        if port is not None:
            self._store.set(key, f"{port} {self._tag(secret, str(port))}" if secret else str(port))
        text = self._store.get(key).decode(errors="replace")
        value, _, tag = text.partition(" ")
        if secret and not hmac.compare_digest(tag, self._tag(secret, value)):
            raise env.EnvError(f"the scheduler's port in torchrun's store (key {key!r}) is not signed with "
                               "this process's secret: the job's processes were given different secrets "
                               "(KVSTORE_SECRET, KVSTORE_SECRET_FILE), or another process wrote that key")
        if not (value.isascii() and value.isdigit() and 0 < int(value) < 65536):
            raise env.EnvError(f"the scheduler's port in torchrun's store (key {key!r}) is not a TCP port: "
                               f"{value[:40]!r}")
        return int(value)
