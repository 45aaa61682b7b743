"""The contenders of benchmarks.trainer and how one launch of each is started: ours
through tracker.launcher.launch (the real launcher), DDP as W gloo ranks, the floor
(and the reference) as one process; with --link, every process placed on an emulated
host of benchmarks/harness/netns.py instead (:class:`Emulated`: the two machines A and B, or
the hosts of a --layout). Each launch's processes run benchmarks/trainer/worker.py
and leave their results in ``<work>/<tag>-rank<r>.*``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

from benchmarks.harness import netns
from benchmarks.harness.layouts import Layout, hosts_for
from benchmarks.harness.placement import (child_env, expected_transports, gloo_ranks, ps_job, server_urls,
                                  side_of)
from benchmarks.harness.procs import GroupFailed, free_port, run_group, tail
from benchmarks.trainer.worker import THIS as WORKER

class Contender(NamedTuple):
    kind: str                         # ours, ddp or floor
    overlap: bool | None              # ours: the Trainer's overlap=
    update_on_kvstore: bool | None    # ours: servers update (torch SGD's twin) or workers (torch SGD)
    shown: str                        # its name in the report
    flat: bool = False                # ours: the Trainer's flat_buckets=


CONTENDERS = {
    "ours-overlap-server": Contender("ours", True, True, "ours, overlap, servers update (torch SGD's twin)"),
    "ours-overlap-worker": Contender("ours", True, False, "ours, overlap, workers update (torch SGD)"),
    "ours-nooverlap-server": Contender("ours", False, True, "ours, no overlap, servers update"),
    "ours-nooverlap-worker": Contender("ours", False, False, "ours, no overlap, workers update"),
    "ours-flat-server": Contender("ours", True, True, "ours, flat buckets, overlap, servers update", flat=True),
    "ours-flat-worker": Contender("ours", True, False, "ours, flat buckets, overlap, workers update", flat=True),
    "ddp": Contender("ddp", None, None, "torch DDP over gloo (25 MB buckets)"),
    "floor": Contender("floor", None, None, "one process, batch W*b, no communication"),
}
# what runs without --contenders: the flat-bucket Trainer is a comparison asked for by name
DEFAULT_CONTENDERS = tuple(name for name, c in CONTENDERS.items() if not c.flat)


class Failed(RuntimeError):
    pass


@dataclass(frozen=True)
class Emulated:
    """Where --link places every process: the emulated hosts (``cluster``), the host
    of worker / DDP rank r (``worker_hosts[r]``) and of server s (``server_hosts[s]``).
    The scheduler, the floor and the reference run on worker 0's host, A.

    Without a layout, the two machines A and B, rank r on placement.side_of(r) (A: even,
    B: odd); with one (benchmarks/harness/layouts.py: ``colo:W``, ``dedicated:WxS``) its hosts:
    worker r on worker host r (A, B, C, ...), server s on server host S<s> (dedicated)
    or on worker host s (colo), DDP's ring over the worker hosts."""
    cluster: netns.Cluster
    worker_hosts: tuple[str, ...]
    server_hosts: tuple[str, ...]
    layout: Layout | None = None

    @classmethod
    def build(cls, workers: int, servers: int, layout: Layout | None = None) -> "Emulated":
        """The placement and its (not yet created) cluster; ``layout`` fixes W and S."""
        if layout is None:
            return cls(netns.Cluster(("A", "B")), tuple(side_of(r) for r in range(workers)),
                       tuple(side_of(r) for r in range(servers)))
        return cls(netns.Cluster(hosts_for([layout])), tuple(layout.worker_hosts),
                   tuple(layout.server_hosts), layout)

    @property
    def home(self) -> str:
        return self.worker_hosts[0]

    def info(self) -> dict:
        """The placement as the result files record it (``sides``: what runs where)."""
        c, layout = self.cluster, self.layout
        return {"layout": layout and layout.key, "layout_described": layout and layout.describe(),
                "namespaces": dict(c.ns), "addresses": dict(c.addr), "devices": dict(c.dev),
                "sides": self.roles(), "worker_hosts": list(self.worker_hosts),
                "server_hosts": list(self.server_hosts)}

    def roles(self) -> dict[str, str]:
        """{host: what runs there}, for the report."""
        out: dict[str, list[str]] = {h: [] for h in self.cluster.hosts}
        out[self.home].append("the scheduler")
        for what, hosts in (("server", self.server_hosts), ("worker", self.worker_hosts),
                            ("DDP rank", self.worker_hosts)):
            for h in out:
                ranks = [str(r) for r, x in enumerate(hosts) if x == h]
                if ranks:
                    out[h].append(f"{what}{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}")
        out[self.home].append("the floor and the reference")
        return {h: ", ".join(v) or "nothing" for h, v in out.items()}


def _worker_argv(cfg: dict, role: str, prefix: str, **flags) -> list[str]:
    argv = [sys.executable, WORKER, "--role", role, "--config", json.dumps(cfg),
            "--out-prefix", prefix]
    for k, v in flags.items():
        argv += [f"--{k.replace('_', '-')}", str(int(v))]
    return argv


def _clean(prefix: str, ranks: int) -> None:
    for r in range(ranks):
        for ext in ("json", "npy"):
            path = f"{prefix}-rank{r}.{ext}"
            if os.path.exists(path):
                os.remove(path)


def _collect(prefix: str, ranks: int, what: str) -> list[dict]:
    """Every rank's result JSON (their parameters stay in ``prefix-rank<r>.npy``)."""
    out = []
    for r in range(ranks):
        try:
            with open(f"{prefix}-rank{r}.json") as f:
                out.append(json.load(f))
            if not os.path.exists(f"{prefix}-rank{r}.npy"):
                raise OSError(f"no {prefix}-rank{r}.npy")
        except (OSError, ValueError) as e:
            raise Failed(f"{what}: rank {r} finished but wrote no result: {e}") from None
    return out


def run_contender(name: str, tag: str, cfg: dict, work: str, timeout: float, corrupt: bool,
                  ref_prefix: str, emulated: Emulated | None = None) -> list[dict]:
    """One launch of contender ``name``, its files under ``<work>/<tag>``: every rank's
    result (rank 0 first). A floor launch also trains the reference (to ``ref_prefix``)
    if there is none yet."""
    c = CONTENDERS[name]
    kind = c.kind
    if kind == "ours":
        assert c.overlap is not None and c.update_on_kvstore is not None   # set for every "ours" contender
        return run_ours(cfg, work, tag, c.overlap, c.update_on_kvstore, corrupt, timeout, emulated, c.flat)
    if kind == "ddp":
        return run_plain(cfg, work, tag, "ddp", cfg["workers"], timeout, emulated=emulated)
    return run_plain(cfg, work, tag, "floor", 1, timeout,
                     reference_prefix=None if os.path.exists(f"{ref_prefix}-rank0.npy")
                     else ref_prefix, emulated=emulated)


def run_ours(cfg: dict, work: str, tag: str, overlap: bool, update_on_kvstore: bool,
             corrupt: bool, timeout: float, emulated: Emulated | None = None, flat: bool = False) -> list[dict]:
    from tracker.control import env as tracker_env
    from tracker.launcher import JobSpec, cpu_count, launch, with_default_threads
    prefix = os.path.join(work, tag)
    _clean(prefix, cfg["workers"])
    argv = _worker_argv(cfg, "ours", prefix, overlap=overlap, update_on_kvstore=update_on_kvstore,
                        corrupt=corrupt, flat_buckets=flat)
    extra = {"KVSTORE_LOG_LEVEL": "WARNING", "KVSTORE_TIMEOUT": str(int(timeout)), **cfg["env"]}
    if emulated is not None:
        return _run_ours_emulated(cfg, prefix, tag, argv, extra, timeout, emulated)
    spec = JobSpec(num_workers=cfg["workers"], num_servers=cfg["servers"], command=tuple(argv),
                   env=extra, settings=tracker_env.read({**os.environ, **extra}))
    # the threads python -m tracker.local gives every process (OMP_NUM_THREADS = cores //
    # processes, unless set): without it the servers' torch (torch.optim twins) runs
    # one OpenMP thread per core, whose spinning between operations cost ~90 ms of CPU
    # per ResNet-20 step on this 2-core machine, taken from the workers
    total = cfg["workers"] + cfg["servers"]
    spec = with_default_threads(spec, ["this machine"] * total, {"this machine": cpu_count()},
                                {**os.environ, **extra})
    log_path = f"{prefix}.log"
    with open(log_path, "w") as log:
        outcome = launch(spec, out=log)
    if outcome.returncode != 0:
        raise Failed(f"{tag}: {outcome.root_cause}\n{outcome.table()}\n{tail(log_path)}")
    return _collect(prefix, cfg["workers"], tag)


def _run_ours_emulated(cfg: dict, prefix: str, tag: str, argv: list[str], extra: dict,
                       timeout: float, emulated: Emulated) -> list[dict]:
    """Ours over the emulated hosts, each process started as benchmarks.link starts
    them (placement.ps_job: ``ip netns exec NS ...``, the launcher's environment, the
    job secret in the environment only). Every worker must have reached every server
    at its host's address, by shared memory within its own host and tcp across."""
    w, s = cfg["workers"], cfg["servers"]
    procs = ps_job(emulated.cluster, w, s, [sys.executable, "-m", "kvstore.server"], argv, extra,
                   server_hosts=list(emulated.server_hosts), worker_hosts=list(emulated.worker_hosts))
    try:
        run_group(procs, f"{prefix}.log", timeout)
    except GroupFailed as e:
        raise Failed(f"{tag}: {e}") from None
    got = _collect(prefix, w, tag)
    where = server_urls(emulated.cluster, s, list(emulated.server_hosts))
    for r, res in enumerate(got):
        kinds, urls = res.get("transports"), res.get("server_urls") or []
        want = expected_transports(s, list(emulated.server_hosts), emulated.worker_hosts[r])
        if not kinds or list(kinds) != want:
            raise Failed(f"{tag}: worker {r} (host {emulated.worker_hosts[r]}) used {kinds}, "
                         f"not {want}")
        if len(urls) != s or not all(u.startswith(x) for u, x in zip(urls, where)):
            raise Failed(f"{tag}: worker {r} reached the servers at {urls}; expected {where}")
    return got


def run_plain(cfg: dict, work: str, tag: str, role: str, ranks: int, timeout: float,
              reference_prefix: str | None = None, emulated: Emulated | None = None) -> list[dict]:
    prefix = os.path.join(work, tag)
    _clean(prefix, ranks)
    argv = _worker_argv(cfg, role, prefix)
    if reference_prefix:
        _clean(reference_prefix, 1)
        _clean(f"{reference_prefix}-kvsgd", 1)
        argv += ["--reference-prefix", reference_prefix]
    if role == "ddp" and emulated is not None:
        # as benchmarks.link runs gloo: the rendezvous on rank 0's host, each rank's
        # gloo on the interface of its own host
        procs = gloo_ranks(emulated.cluster, argv, ranks, "ddp rank", cfg["env"],
                           hosts=list(emulated.worker_hosts))
    elif role == "ddp":
        init = f"tcp://127.0.0.1:{free_port()}"
        procs = [(f"ddp rank {r}", argv, {"RANK": str(r), "WORLD_SIZE": str(ranks),
                                          "BENCH_INIT_METHOD": init, **cfg["env"]})
                 for r in range(ranks)]
    elif emulated is not None:   # the floor (and the reference): one process on A
        procs = [(role, emulated.cluster.exec_argv(emulated.home, argv),
                  child_env(dict(cfg["env"])))]
    else:
        procs = [(role, argv, dict(cfg["env"]))]
    try:
        run_group(procs, f"{prefix}.log", timeout)
    except GroupFailed as e:
        raise Failed(f"{tag}: {e}") from None
    return _collect(prefix, ranks, tag)


def link_ready(cluster: netns.Cluster, rate: str, check_seconds: float, say) -> dict:
    """--link: the rate limit on every host's link (both ends), then benchmarks/harness/netns.py's
    raw TCP check between A and B (a bulk transfer both ways at once). A failed check is
    reported, not fatal."""
    out: dict[str, Any] = {"qdisc": cluster.set_rate(rate)}
    try:
        out["raw"] = raw = netns.raw_check(cluster, rate, check_seconds)
        say(f"link: {cluster.ns['A']} ({cluster.addr['A']}) <-> {cluster.ns['B']} "
            f"({cluster.addr['B']}), tbf {rate} on all {len(cluster.hosts)} hosts; raw TCP both "
            f"ways at once: A->B {raw['a_to_b_gbit']:.3f}, B->A {raw['b_to_a_gbit']:.3f} Gbit/s")
    except netns.Failed as e:
        out["raw_error"] = str(e)
        say(f"link: raw TCP check failed (the prediction uses the nominal rate only): {e}")
    return out


def phases(wall0: float, wall1: float, stamps: dict) -> dict:
    """Where a launch's wall time went (rank 0's view): start-up (process start,
    imports, model), rendezvous (store or process group, Trainer/DDP construction),
    the steps, and closing down."""
    if not {"start", "imported", "ready", "trained", "closed"} <= set(stamps):
        return {}
    return {"spawn": stamps["start"] - wall0, "startup": stamps["imported"] - stamps["start"],
            "rendezvous": stamps["ready"] - stamps["imported"],
            "steps": stamps["trained"] - stamps["ready"], "close": stamps["closed"] - stamps["trained"],
            "after": wall1 - stamps["closed"], "total": wall1 - wall0}


def row(name: str, launch_no: int, got: list[dict], load, load_after, wall0: float) -> dict:
    """The result row of one launch (rank 0's times, every rank's times and losses)."""
    res0 = got[0]
    return {"contender": name, "launch": launch_no, "times": res0["times"],
            "cpu_s": res0["cpu_s"], "minor_faults": res0["minor_faults"],
            "loadavg_before": load[0], "loadavg_before_1_5_15": list(load),
            "loadavg_after_1_5_15": list(load_after),
            "rank_times": [r["times"] for r in got],
            "losses": [r["losses"] for r in got],
            "transports": res0.get("transports"),
            "server_urls": res0.get("server_urls"),
            "servers_cpu_s": res0.get("servers_cpu_s"),
            "bucket_bytes": res0.get("bucket_bytes"),
            "parts": res0.get("parts"),
            "phases_s": phases(wall0, time.time(), res0.get("stamps", {}))}
