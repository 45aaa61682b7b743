"""One launch of our gradient exchange on emulated hosts (:mod:`benchmarks.harness.netns`):
a kvstore job placed by :func:`benchmarks.harness.placement.ps_job`, its workers the
pushpull contender's (``contenders/ours_worker.py``, which verifies every sum exactly), its
servers ``contenders/server_wrapper.py`` (kvstore's server plus its CPU time). What
benchmarks.link times per layout and benchmarks.host_reduce with several workers per host.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from typing import Protocol

from tracker.control import env

from benchmarks.harness import common
from benchmarks.harness.contenders.base import Failed, read_result
from benchmarks.harness.contenders.ours import SERVER, WORKER as OURS_WORKER
from benchmarks.harness.netns import Cluster
from benchmarks.harness.placement import expected_transports, ps_job, server_urls
from benchmarks.harness.procs import GroupFailed, run_group


class JobLayout(Protocol):
    """What :func:`run_ours` reads of a layout: a :class:`benchmarks.harness.layouts.Layout`,
    or benchmarks.host_reduce's ``Job`` (several workers on one host)."""

    @property
    def kind(self) -> str: ...
    @property
    def workers(self) -> int: ...
    @property
    def servers(self) -> int: ...
    @property
    def worker_hosts(self) -> Sequence[str]: ...
    @property
    def server_hosts(self) -> Sequence[str]: ...


def modes_of(layout: JobLayout, cfg: dict) -> tuple[str, ...]:
    """The exchange's variants for this kind of layout (``cfg["modes"]``, by ``layout.kind``)."""
    return cfg["modes"][layout.kind]


def run_ours(cluster: Cluster, layout: JobLayout, cfg: dict, tag: str) -> dict:
    """One job of ours over ``layout``'s hosts; returns worker 0's result plus the
    servers' usage. ``cfg``: work (a directory), model, modes, iters, warmup, timeout,
    env (extra variables for our processes). Failed when a process fails or a
    check does not hold: a sum, the transports used, the servers' addresses."""
    work = cfg["work"]
    out = os.path.join(work, f"{tag}.json")
    stats_dir = os.path.join(work, f"{tag}-servers")
    os.makedirs(stats_dir, exist_ok=True)
    worker = [sys.executable, OURS_WORKER, "--task", "sync", "--model", cfg["model"],
              "--modes", ",".join(modes_of(layout, cfg)), "--iters", str(cfg["iters"]),
              "--warmup", str(cfg["warmup"]), "--latency-iters", "0", "--out", out]
    procs = ps_job(cluster, layout.workers, layout.servers, [sys.executable, SERVER], worker,
                   {"KVSTORE_LOG_LEVEL": "WARNING", "BENCH_SERVER_STATS": stats_dir,
                    **cfg.get("env", {})},
                   server_hosts=layout.server_hosts, worker_hosts=layout.worker_hosts)
    try:
        run_group(procs, os.path.join(work, f"{tag}.log"), cfg["timeout"])
    except GroupFailed as e:
        raise Failed(f"ours ({tag}): {e}") from None
    res = read_result(out, f"ours ({tag})")
    kinds, urls = res.get("transports"), res.get("server_urls") or []
    want = expected_transports(layout.servers, layout.server_hosts, layout.worker_hosts[0])
    if kinds is not None and list(kinds) != want:
        raise Failed(f"ours ({tag}): worker 0 used {kinds}, not {want}")
    where = server_urls(cluster, layout.servers, layout.server_hosts)
    if len(urls) != len(where) or not all(u.startswith(w) for u, w in zip(urls, where)):
        raise Failed(f"ours ({tag}): servers at {urls}; expected {where} (tcp, each on its host)")
    res["servers_usage"] = {f[:-5]: read_result(os.path.join(stats_dir, f), "server stats")
                            for f in sorted(os.listdir(stats_dir)) if f.endswith(".json")}
    return res


def effective_settings(extra: dict) -> dict:
    """The message and chunk sizes our processes run with: ``extra`` (``--env``) over
    the defaults (they get no other KVSTORE_ variable: placement.child_env)."""
    settings = env.read(extra)
    return {"pipeline_bytes": settings.pipeline_bytes, "chunk_bytes": settings.chunk_bytes}


def versions() -> dict:
    """The versions a result of the emulated links records: Python, the kernel, ours,
    pyzmq/libzmq, numpy, torch (gloo) and iproute2 (tc, netns)."""
    v = {"python": platform.python_version(), "kernel": platform.release(),
         "ours": common.kvstore_version()}
    try:
        import zmq
        v["pyzmq"] = f"pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()})"
    except ImportError:
        pass
    import numpy
    v["numpy"] = numpy.__version__
    try:
        import torch
        v["gloo"] = f"torch {torch.__version__}"
    except ImportError:
        pass
    try:
        v["iproute2"] = subprocess.run(["ip", "-V"], capture_output=True, text=True,
                                       timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return v
