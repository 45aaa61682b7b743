"""The contenders of benchmarks.trainer and how one launch of each is started: ours
through tracker.launcher.launch (the real launcher), DDP as W gloo ranks, the floor
(and the reference) as one process; with --link, every process placed on one of
the two emulated machines of benchmarks/netns.py instead. Each launch's processes
run benchmarks/trainer_worker.py and leave their results in ``<work>/<tag>-rank<r>.*``.
"""

from __future__ import annotations

import json
import os
import sys
import time

from benchmarks import netns
from benchmarks.procs import GroupFailed, free_port, run_group, tail
from benchmarks.trainer_worker import THIS as WORKER

# name -> (kind, overlap, update_on_kvstore, shown as)
CONTENDERS = {
    "ours-overlap-server": ("ours", True, True, "ours, overlap, servers update (kvstore SGD)"),
    "ours-overlap-worker": ("ours", True, False, "ours, overlap, workers update (torch SGD)"),
    "ours-nooverlap-server": ("ours", False, True, "ours, no overlap, servers update"),
    "ours-nooverlap-worker": ("ours", False, False, "ours, no overlap, workers update"),
    "ddp": ("ddp", None, None, "torch DDP over gloo (25 MB buckets)"),
    "floor": ("floor", None, None, "one process, batch W*b, no communication"),
}


class Failed(RuntimeError):
    pass


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
                  ref_prefix: str, link=None) -> list[dict]:
    """One launch of contender ``name``, its files under ``<work>/<tag>``: every rank's
    result (rank 0 first). A floor launch also trains the reference (to ``ref_prefix``)
    if there is none yet."""
    kind, overlap, ukv, _ = CONTENDERS[name]
    if kind == "ours":
        return run_ours(cfg, work, tag, overlap, ukv, corrupt, timeout, link=link)
    if kind == "ddp":
        return run_plain(cfg, work, tag, "ddp", cfg["workers"], timeout, link=link)
    return run_plain(cfg, work, tag, "floor", 1, timeout,
                     reference_prefix=None if os.path.exists(f"{ref_prefix}-rank0.npy")
                     else ref_prefix, link=link)


def run_ours(cfg: dict, work: str, tag: str, overlap: bool, update_on_kvstore: bool,
             corrupt: bool, timeout: float, link=None) -> list[dict]:
    from tracker.control import env as tracker_env
    from tracker.launcher import JobSpec, launch
    prefix = os.path.join(work, tag)
    _clean(prefix, cfg["workers"])
    argv = _worker_argv(cfg, "ours", prefix, overlap=overlap, update_on_kvstore=update_on_kvstore,
                        corrupt=corrupt)
    extra = {"KVSTORE_LOG_LEVEL": "WARNING", "KVSTORE_TIMEOUT": str(int(timeout)), **cfg["env"]}
    if link is not None:
        return _run_ours_link(cfg, prefix, tag, argv, extra, timeout, link)
    spec = JobSpec(num_workers=cfg["workers"], num_servers=cfg["servers"], command=tuple(argv),
                   env=extra, settings=tracker_env.read({**os.environ, **extra}))
    log_path = f"{prefix}.log"
    with open(log_path, "w") as log:
        outcome = launch(spec, out=log)
    if outcome.returncode != 0:
        raise Failed(f"{tag}: {outcome.root_cause}\n{outcome.table()}\n{tail(log_path)}")
    return _collect(prefix, cfg["workers"], tag)


def _run_ours_link(cfg: dict, prefix: str, tag: str, argv: list[str], extra: dict,
                   timeout: float, link) -> list[dict]:
    """Ours across the emulated link, each process started as benchmarks.link starts
    them (benchmarks/netns.py ``ps_job``: ``ip netns exec NS ...``, the launcher's
    environment, the job secret in the environment only): the scheduler on A, server r
    and worker r on side_of(r), shared memory within a machine, tcp across the link."""
    w, s = cfg["workers"], cfg["servers"]
    procs = netns.ps_job(link, w, s, [sys.executable, "-m", "kvstore.server"], argv, extra)
    try:
        run_group(procs, f"{prefix}.log", timeout)
    except GroupFailed as e:
        raise Failed(f"{tag}: {e}") from None
    got = _collect(prefix, w, tag)
    kinds, urls = got[0].get("transports"), got[0].get("server_urls") or []
    if not kinds or list(kinds) != netns.expected_transports(s):
        raise Failed(f"{tag}: the client used {kinds}, not {netns.expected_transports(s)}")
    want = netns.server_urls(link, s)
    if len(urls) != s or not all(u.startswith(x) for u, x in zip(urls, want)):
        raise Failed(f"{tag}: servers at {urls}; expected {want}")
    return got


def run_plain(cfg: dict, work: str, tag: str, role: str, ranks: int, timeout: float,
              reference_prefix: str | None = None, link=None) -> list[dict]:
    prefix = os.path.join(work, tag)
    _clean(prefix, ranks)
    argv = _worker_argv(cfg, role, prefix)
    if reference_prefix:
        _clean(reference_prefix, 1)
        _clean(f"{reference_prefix}-kvsgd", 1)
        argv += ["--reference-prefix", reference_prefix]
    if role == "ddp" and link is not None:
        # as benchmarks.link runs gloo: the rendezvous on A's address, each rank's
        # gloo on the veth of its own "machine"
        procs = netns.gloo_ranks(link, argv, ranks, "ddp rank", cfg["env"])
    elif role == "ddp":
        init = f"tcp://127.0.0.1:{free_port()}"
        procs = [(f"ddp rank {r}", argv, {"RANK": str(r), "WORLD_SIZE": str(ranks),
                                          "BENCH_INIT_METHOD": init, **cfg["env"]})
                 for r in range(ranks)]
    elif link is not None:   # the floor (and the reference): one process on A
        procs = [(role, link.exec_argv("A", argv), netns.child_env(dict(cfg["env"])))]
    else:
        procs = [(role, argv, dict(cfg["env"]))]
    try:
        run_group(procs, f"{prefix}.log", timeout)
    except GroupFailed as e:
        raise Failed(f"{tag}: {e}") from None
    return _collect(prefix, ranks, tag)


def link_ready(link, rate: str, check_seconds: float, say) -> dict:
    """--link: the rate limit on both veth ends, then benchmarks/netns.py's raw TCP
    check (a bulk transfer both ways at once). A failed check is reported, not fatal."""
    out = {"qdisc": link.set_rate(rate)}
    try:
        out["raw"] = raw = netns.raw_check(link, rate, check_seconds)
        say(f"link: {link.ns['A']} ({link.addr['A']}) <-> {link.ns['B']} ({link.addr['B']}), "
            f"tbf {rate}; raw TCP both ways at once: A->B {raw['a_to_b_gbit']:.3f}, "
            f"B->A {raw['b_to_a_gbit']:.3f} Gbit/s")
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
            "parts": res0.get("parts"),
            "phases_s": phases(wall0, time.time(), res0.get("stamps", {}))}
