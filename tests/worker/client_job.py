"""Shared by the tests of tests/worker/ (not collected): worker clients made the way
:class:`kvstore.worker.dist.DistStore` makes them, against in-process servers as
tests/cluster.py builds them (real ServerNodes and scheduler, ZeroMQ on 127.0.0.1,
random ports).

``Job(cluster, client_settings)`` registers one :class:`~kvstore.worker.job.JobMember`
per worker of ``cluster`` (at once: registration returns when every node has
registered) and makes each a :class:`~kvstore.worker.client.Client` from its
registration; ``close`` leaves as kvstore.worker.leaving does. ``jobs`` is the body
of a fixture that starts them (first worker configures the servers in sync mode)
and closes every one at the end.
"""

from __future__ import annotations

import threading

from kvstore.protocol import ops
from kvstore.worker.client import Client
from kvstore.worker.job import JobMember


class Job:
    """The clients of a job's workers (``clients[rank]``), one per worker of ``cluster``."""

    def __init__(self, cluster, client_settings: dict):
        self.cluster = cluster
        self.members = [JobMember(cluster.config("worker", r)) for r in range(cluster.num_workers)]
        regs: list = [None] * cluster.num_workers

        def register(rank):              # registration returns once every node registered
            regs[rank] = self.members[rank].register()
        threads = [threading.Thread(target=register, args=(r,)) for r in range(cluster.num_workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert all(regs), "a worker did not register"
        self.servers = regs[0].servers
        self.configs = [cluster.config("worker", r).replace(**client_settings) for r in range(cluster.num_workers)]
        self.clients = [Client(config, m.membership, reg.servers, reg.rank)
                        for config, m, reg in zip(self.configs, self.members, regs)]
        self.failed: set = set()

    def fail(self, rank: int, reason: str) -> None:
        """Worker ``rank`` reports a failure (the scheduler aborts the job), as a store does."""
        self.failed.add(rank)
        self.members[rank].membership.fail(reason)

    def close(self) -> None:
        """Leave as kvstore.worker.leaving does: finish unless the job aborted or the worker failed."""
        for rank, (member, client) in enumerate(zip(self.members, self.clients)):
            client.close()
            if rank not in self.failed and not member.membership.aborted.is_set():
                member.finish()
            member.membership.close()


def jobs(make_cluster):
    """A fixture's body: ``start(workers, servers, client={...}, **cluster settings)``
    (tcp without data channels unless the settings say otherwise) -> a configured
    :class:`Job`; every job started is closed at the end."""
    started: list = []

    def start(workers: int = 1, servers: int = 2, client: dict | None = None, **settings) -> Job:
        settings.setdefault("transport", "tcp")
        settings.setdefault("data_channel", False)
        j = Job(make_cluster(workers, servers, **settings), client or {})
        started.append(j)
        j.clients[0].request_all(ops.CONFIGURE, "configuring the servers", mode="sync", num_workers=workers)
        return j
    yield start
    for j in started:
        j.close()
