"""An in-process cluster for tests: the scheduler and servers run as threads,
workers are threads with their own store object. Real ZeroMQ tcp sockets on
127.0.0.1 with random ports; nothing is mocked."""

from __future__ import annotations

import threading
import traceback

import kvstore
from kvstore.config import Config
from kvstore.server import ServerNode
from tracker.control.rendezvous import Scheduler
from tracker.control.security import Security


class Cluster:
    def __init__(self, num_workers: int, num_servers: int, server_socket_wrapper=None, per_server=None,
                 **settings):
        """``settings``: Config fields of every node; ``per_server``: {rank: fields} of
        one server only (e.g. its own checkpoint directory, as on a host of its own)."""
        self.per_server = per_server or {}
        self.num_workers = num_workers
        self.num_servers = num_servers
        settings.setdefault("timeout", 30.0)
        settings.setdefault("heartbeat_interval", 0.2)
        settings.setdefault("heartbeat_timeout", 5.0)
        if server_socket_wrapper is not None:    # it wraps ZeroMQ: keep every message there
            settings.setdefault("data_channel", False)
        self.settings = settings
        self.scheduler = Scheduler(num_workers, num_servers, timeout=settings["timeout"],
                                   heartbeat_interval=settings["heartbeat_interval"],
                                   heartbeat_timeout=settings["heartbeat_timeout"],
                                   security=Security(settings.get("secret"),
                                                     settings.get("secure", False))).start()
        self.server_codes: list = [None] * num_servers
        self._threads = []
        self.nodes = []
        for rank in range(num_servers):
            node = ServerNode(self.config("server", rank))
            if server_socket_wrapper is not None:   # e.g. a fault-injecting transport
                node._sock = server_socket_wrapper(node._sock)
            self.nodes.append(node)
            t = threading.Thread(target=self._serve, args=(rank, node), daemon=True)
            t.start()
            self._threads.append(t)

    def config(self, role: str, rank: int | None) -> Config:
        own = self.per_server.get(rank, {}) if role == "server" else {}
        return Config(role=role, rank=rank, scheduler_host="127.0.0.1",
                      scheduler_port=self.scheduler.port, num_workers=self.num_workers,
                      num_servers=self.num_servers, exit_on_abort=False, **{**self.settings, **own})

    def _serve(self, rank, node):
        self.server_codes[rank] = node.run()

    def run(self, fn, store_type: str = "dist_sync", timeout: float = 60.0) -> list:
        """Run ``fn(kv)`` in every worker thread; return their results by rank.
        Re-raises the first worker exception (with its traceback text)."""
        results, errors = [None] * self.num_workers, [None] * self.num_workers

        def work(rank):
            try:
                with kvstore.create(store_type, config=self.config("worker", rank)) as kv:
                    results[rank] = fn(kv)
            except BaseException as e:  # reported to the test thread below
                errors[rank] = (e, traceback.format_exc())

        threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(self.num_workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
            if t.is_alive():
                raise TimeoutError(f"a worker did not finish within {timeout}s")
        for err in errors:
            if err is not None:
                raise err[0].with_traceback(err[0].__traceback__)
        return results

    def run_each(self, fn, timeout: float = 90.0) -> dict:
        """``fn(kv)`` in one thread per worker (dist_sync); {rank: result or the
        exception it raised}, for jobs expected to abort."""
        out = {}

        def work(rank):
            try:
                with kvstore.create("dist_sync", config=self.config("worker", rank)) as kv:
                    out[rank] = fn(kv)
            except Exception as e:     # handed back to the test
                out.setdefault(rank, e)
        threads = [threading.Thread(target=work, args=(r,)) for r in range(self.num_workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
            assert not t.is_alive(), "a worker hangs"
        return out

    def close(self, timeout: float = 10.0) -> None:
        self.scheduler.wait(timeout)
        for t in self._threads:
            t.join(timeout)
        self.scheduler.close()
