"""Our contender: dist_sync (and dist_async) jobs started through tracker's
launcher API (``tracker.launcher.launch``), one job per transport.

Transports are a registry: a name, the ``KVSTORE_TRANSPORT`` value that selects
it, and what rank 0's client must then report for every server (its transport
and the URL scheme it connected to; checked after the run, so a transport that
silently falls back to another cannot pass for it). ``shm`` is what a job on one
host gets by default (``auto``). Adding a transport = one entry here.

:func:`worktree` and :func:`run_in_tree` run this contender as another commit has
it (``pushpull --before REF``): that tree's own ``ours.run`` in a child Python
whose PYTHONPATH is the tree, so its launcher, scheduler, servers and workers
are all that commit's code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from tracker.control import env as tracker_env
from tracker.launcher import JobSpec, launch

from .base import Failed, RunConfig, Skip, read_result, rows_from
from ..common import REPO
from ..procs import tail
from ..resnet50_shapes import model_nbytes

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "ours_worker.py")
SERVER = os.path.join(HERE, "server_wrapper.py")
VARIANT_NAMES = {"push_pull": "push, then pull", "pushpull": "pushpull",
                 "pushpull_shared": "pushpull, gradients from kv.empty()",
                 **{f"pushpull_{c}": f"pushpull, {c} compression" for c in ("2bit", "1bit", "fp16")}}
COMPRESSED_ON = ("tcp", "shm")   # compression is about the network; shm shows its CPU cost


@dataclass(frozen=True)
class Transport:
    name: str
    env: dict = field(default_factory=dict)
    url_prefix: str | None = None     # what the servers' data-plane URLs must start with
    requires_var: str | None = None   # tracker.control.env must know this variable
    kind: str | None = None           # what the client must report as each server's transport
    hosts: int = 0                    # > 0: emulate this many hosts (JobSpec.emulate_hosts)

    def expected_kinds(self, servers: int) -> list[str] | None:
        """What rank 0's client must report for each server: with emulated hosts, shared
        memory to the servers on its own host (host 0: ranks 0, K, 2K...), tcp to the rest."""
        if self.hosts:
            return ["shm" if s % self.hosts == 0 else "tcp" for s in range(servers)]
        return [self.kind] * servers if self.kind else None

    def for_job(self, cfg: RunConfig) -> "Transport":
        """hosts=-1 means one emulated host per worker."""
        return dataclasses.replace(self, hosts=cfg.workers) if self.hosts < 0 else self

    def available(self) -> tuple[bool, str]:
        if self.requires_var and self.requires_var not in tracker_env.BY_NAME:
            return False, (f"kvstore has no {self.name} transport yet ({self.requires_var} is not "
                           "a variable of tracker/control/env.py)")
        return True, ""


TRANSPORTS = {
    "tcp": Transport("tcp", {"KVSTORE_TRANSPORT": "tcp"}, "tcp://", "KVSTORE_TRANSPORT", "tcp"),
    "ipc": Transport("ipc", {"KVSTORE_TRANSPORT": "ipc"}, "ipc://", "KVSTORE_TRANSPORT", "ipc"),
    "shm": Transport("shm", {"KVSTORE_TRANSPORT": "auto"}, "tcp://", "KVSTORE_TRANSPORT", "shm"),
    # W emulated machines, server r with worker r (what tracker.ssh does with one server per
    # host): tcp between hosts as between machines, shared memory within one. A ring's bytes
    # go through loopback tcp, as gloo's do.
    "hosts": Transport("hosts", {"KVSTORE_TRANSPORT": "auto"}, "tcp://", "KVSTORE_HOST_LABEL",
                       hosts=-1),
}


def available_transports(cfg: RunConfig) -> tuple[list[Transport], list[str]]:
    ok, skipped = [], []
    for name in cfg.transports:
        t = TRANSPORTS.get(name)
        if t is None:
            skipped.append(f"ours over {name}: unknown transport (known: {', '.join(TRANSPORTS)})")
            continue
        usable, why = t.available()
        (ok.append(t) if usable else skipped.append(f"ours over {name}: {why}"))
    return ok, skipped


def run_job(cfg: RunConfig, transport: Transport, worker_args: list[str], tag: str,
            profile: bool = False) -> dict:
    """One launcher job; returns rank 0's result (plus the servers' usage)."""
    out = cfg.path(f"{tag}.json")
    stats_dir = cfg.path(f"{tag}-servers")
    os.makedirs(stats_dir, exist_ok=True)
    for stale in [out] + [os.path.join(stats_dir, f) for f in os.listdir(stats_dir)]:
        if os.path.exists(stale):
            os.remove(stale)
    extra = {"KVSTORE_LOG_LEVEL": "WARNING", "BENCH_SERVER_STATS": stats_dir, **transport.env,
             **cfg.env}
    if profile:
        extra["BENCH_SERVER_PROFILE"] = "1"
    argv = [sys.executable, WORKER, *worker_args, "--out", out]
    if profile:
        argv += ["--profile", cfg.path(f"{tag}-worker0.prof")]
    transport = transport.for_job(cfg)
    spec = JobSpec(num_workers=cfg.workers, num_servers=cfg.servers, command=tuple(argv),
                   server_command=(sys.executable, SERVER), env=extra,
                   settings=tracker_env.read({**os.environ, **extra}), emulate_hosts=transport.hosts)
    log_path = cfg.path(f"{tag}.log")
    with open(log_path, "w") as log:
        outcome = launch(spec, out=log)
    if outcome.returncode != 0:
        raise Failed(f"ours ({tag}): {outcome.root_cause}\n{outcome.table()}\n{tail(log_path)}")
    result = read_result(out, f"ours ({tag})")
    servers = {}
    for f in sorted(os.listdir(stats_dir)):
        if f.endswith(".json"):
            servers[f[:-5]] = read_result(os.path.join(stats_dir, f), "server stats")
    result["servers_usage"] = servers
    urls = result.get("server_urls") or []
    if transport.url_prefix and urls and not all(u.startswith(transport.url_prefix) for u in urls):
        raise Failed(f"ours over {transport.name}: the servers listen on {urls}, not "
                     f"{transport.url_prefix}...: the transport setting was not honoured")
    kinds, expected = result.get("transports"), transport.expected_kinds(cfg.servers)
    if expected and kinds is not None and list(kinds) != expected:
        raise Failed(f"ours over {transport.name}: the client used {kinds}, not {expected}: the "
                     "transport setting was not honoured")
    return result


def run(cfg: RunConfig, launch_no: int) -> list[dict]:
    transports, skipped = available_transports(cfg)
    if not transports:
        raise Skip("; ".join(skipped))
    nbytes = model_nbytes(cfg.model)
    rows = []
    for t in transports:
        # kv.empty() differs from numpy memory only where servers share memory with us
        modes = ["push_pull", "pushpull"] + (["pushpull_shared"] if t.kind == "shm" or t.hosts else [])
        if t.name in COMPRESSED_ON:
            modes += [f"pushpull_{c}" for c in cfg.compression]
        modes = ["--modes", ",".join(modes)]
        res = run_job(cfg, t, cfg.worker_args() + modes, f"ours-{t.name}-{launch_no}")
        extra = {"transport": t.name, "servers": cfg.servers,
                 "server_usage_total": res.get("servers_usage"),
                 "worker_usage_total": res.get("usage_total")}
        got = rows_from(res, "ours", launch_no,
                        {m: f"{t.name}: {n}" for m, n in VARIANT_NAMES.items()}, nbytes, extra)
        for r in got:
            if r["kind"] == "latency":      # one latency row per transport
                r["contender"] = f"ours {t.name}"
            if "compression" in r["variant"]:   # lossy: not the same exchange, its own table
                r["kind"] = "compression"
        rows += got
        if not cfg.async_pushes:
            continue
        res = run_job(cfg, t, cfg.async_args(), f"ours-async-{t.name}-{launch_no}")
        rows += rows_from(res, "ours", launch_no, {}, nbytes, {"transport": t.name})
        for r in rows[-1:]:
            r["variant"] = f"{t.name}: dist_async, {r['variant']}"
    return rows


@contextlib.contextmanager
def worktree(ref: str):
    """A temporary detached ``git worktree`` of ``ref`` in this repository, removed
    afterwards: yields (its path, its short commit). Failed when ``ref`` names no
    commit or git cannot add the worktree."""
    repo = REPO

    def git(*args) -> str:
        p = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, timeout=120)
        if p.returncode != 0:
            raise Failed(f"git {' '.join(args)}: {p.stderr.strip() or p.stdout.strip()}")
        return p.stdout.strip()
    commit = git("rev-parse", "--short", "--verify", f"{ref}^{{commit}}")
    path = tempfile.mkdtemp(prefix="kvbench-before-")
    try:
        git("worktree", "add", "--detach", "--quiet", path, commit)
        yield path, commit
    finally:
        with contextlib.suppress(Failed):
            git("worktree", "remove", "--force", path)
        shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(Failed):
            git("worktree", "prune")


# Runs in the other tree (cwd and PYTHONPATH): its RunConfig may lack fields ours has
IN_TREE = """
import dataclasses, json, sys
tree, given, launch_no, out = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
import kvstore, tracker
try:                                   # this layout
    from benchmarks.harness import common
    from benchmarks.harness.contenders import base, ours
except ImportError:                    # a commit from before the harness (benchmarks/contenders)
    from benchmarks import common
    from benchmarks.contenders import base, ours
for module in (kvstore, tracker, ours):
    if not module.__file__.startswith(tree):
        sys.exit(f"{module.__name__} comes from {module.__file__}, not from {tree}")
known = {f.name for f in dataclasses.fields(base.RunConfig)}
cfg = base.RunConfig(**{k: tuple(v) if isinstance(v, list) else v
                        for k, v in given.items() if k in known})
try:
    result = {"rows": ours.run(cfg, launch_no)}
except base.Skip as e:
    result = {"skip": str(e)}
except (base.Failed, common.WrongResult) as e:
    result = {"failed": str(e)}
with open(out, "w") as f:
    json.dump(result, f)
"""


def run_in_tree(tree: str, label: str, cfg: RunConfig, launch_no: int) -> list[dict]:
    """:func:`run` as the source tree ``tree`` has it, its rows labelled ``label``
    (e.g. ``ours@HEAD``) instead of ``ours``. Raises Skip or Failed as that run did."""
    work = os.path.join(cfg.work_dir, re.sub(r"[^A-Za-z0-9._-]", "_", label))
    os.makedirs(work, exist_ok=True)
    out, log_path = os.path.join(work, f"result-{launch_no}.json"), os.path.join(work, f"run-{launch_no}.log")
    given = json.dumps(dataclasses.asdict(dataclasses.replace(cfg, work_dir=work)))
    jobs = 2 * len(cfg.transports) + 1          # sync and async jobs per transport
    with open(log_path, "w") as log:
        try:
            p = subprocess.run([sys.executable, "-c", IN_TREE, tree, given, str(launch_no), out],
                               cwd=tree, env={**os.environ, "PYTHONPATH": tree}, stdout=log,
                               stderr=subprocess.STDOUT, timeout=cfg.timeout * jobs)
        except subprocess.TimeoutExpired:
            raise Failed(f"{label}: no result within {cfg.timeout * jobs:g}s\n{tail(log_path)}") from None
    if p.returncode != 0:
        raise Failed(f"{label}: exited with status {p.returncode}\n{tail(log_path)}")
    result = read_result(out, label)
    if "skip" in result:
        raise Skip(result["skip"])
    if "failed" in result:
        raise Failed(f"{label}: {result['failed']}")
    rows = result["rows"]
    for r in rows:
        r["contender"] = label + r["contender"][len("ours"):]     # "ours shm" -> "ours@REF shm"
        if r["kind"] == "compression":   # that table has no contender column: say it by transport
            transport, _, rest = r["variant"].partition(": ")
            r["variant"] = f"{transport}{label[len('ours'):]}: {rest}"
    return rows
