"""Chaos, replicated mode: jobs with replicated servers (``KVSTORE_REPLICAS=1``) that
must survive one fault of a server at a random moment, ending exactly as an
uninterrupted run.

    python -m benchmarks.chaos --replicated --runs 120 --seed 1
    python -m benchmarks.chaos --replicated --replay 1234567     # one run, by its seed

Each run draws its own seed from ``--seed`` and every choice from that seed, so
a failure is replayed with ``--replay SEED`` (the same modes: ``--modes``).
A run is a job of benchmarks/chaos/replicated_worker.py: W in 2-4 workers, S in
2-4 servers, ``dist_sync`` with ``KVSTORE_DETERMINISTIC=1`` (two thirds of the
runs, or what ``--modes`` allows) or ``dist_async``, or (only when ``--modes``
names it: ``--modes sync,async,ssp``) ``dist_ssp`` (staleness 2, drawn as evenly
as async); 60 rounds, a checkpoint
(``save_checkpoint``) every 10 rounds. Keys are cut into 4 KB chunks over every
server. One fault of a random **target** (:data:`TARGETS`) at a random **moment**:

- ``rounds``: after worker 0's round N (N random), a random delay of up to a
  round or so later;
- ``save``: once worker 0 prints ``saving K`` (K random), a random delay of up to
  5 ms later: while the servers write or commit checkpoint K;
- ``startup``: ``registered`` (the server's "serving on" line: it has
  registered), ``initialised`` (worker 0's ``init`` returned: between ``init``
  and ``set_optimizer``), or ``spawned`` (as soon as the process exists,
  before it registers).

With ``--elastic`` every job runs with ``--elastic 1:W`` (replicated servers in an
elastic job, docs/reliability.md); the faults and the judgement are the same (no
worker leaves, so the weights are still the uninterrupted run's). With
``--host-reduce`` every job runs with ``KVSTORE_HOST_REDUCE=1``: the workers
(all on this host) form one host group in ``dist_sync``, whose leader pushes
their sum (the other modes have no host sums); the judgement is the same, and a
``dist_sync`` job must have formed the group.

The ``second-server`` target is a second failure after a replacement: the job
runs with ``--restart-servers 1`` and 300 rounds; after worker 0's round 3 a
random server is killed (SIGKILL), the launcher starts a replacement, and once
the scheduler reported both replicas it lacked rebuilt on it, the fault strikes
another server (the replacement among them) a random number of rounds (1-20) or
saves (1-3) later. It passes as the others, with both losses reported survived.

Faults: SIGKILL (the launcher sees the exit), SIGSTOP (the heartbeats see the
silence; the launcher then kills the stopped process) and, as root, a network
partition: the job runs on two emulated machines (network namespaces,
benchmarks.harness.netns), the target server alone on B, everything else (the
scheduler standalone, ``python -m tracker.scheduler``, as without a launcher) on A,
and B's link goes down; the cut-off server must end by itself (it loses the
scheduler). Heartbeats: ``KVSTORE_HEARTBEAT_TIMEOUT=2`` (interval 0.4 s), the
setting under which a silent server's pause can meet issue 42's 3 s.

A run passes when, within 60 s of the fault:

- the job ends with status 0 (partition: the scheduler and every worker 0);
- ``dist_sync``: every worker's final weights equal an uninterrupted run's of the
  same W without replicas (computed once per W), bit for bit;
  ``dist_async``: every worker printed ``exact`` (every acknowledged push applied
  exactly once) and none saw a wrong value; ``dist_ssp``: the same, and no
  ``pushpull`` read broke the bound (every worker's first c - s pushes in what a
  worker read at its clock c);
- the failover was reported (the launcher's or the scheduler's "its chunks are
  served by their backups");
- no process of the job is left (by the CHAOS_TAG in their environment).

Measured for each run: the **pause**, worker 0's longest wait for a round among
the first three that end after the fault (benchmarks.failover's :func:`pause`:
from the later of the fault and the round's start to its end). The summary gives
its median, 90th percentile and maximum by fault and moment, and lists every
failure with its seed. A server struck at ``spawned`` (before it registered:
nothing to fail over yet) passes when its launcher started it again in place and
said so (:data:`STARTED_AGAIN`; tracker.control.start_again): a SIGKILL at once,
a SIGSTOP at the registration deadline (``KVSTORE_TIMEOUT``, 20 s here).
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from typing import Callable

from benchmarks.chaos.jobs import (LATE, ROOT, WRONG, Job, await_pid, end_jobs, finish, job_env,
                                   launcher_argv, line_of, pid_of)
from benchmarks.harness.pause import pause

SCRIPT = os.path.join(ROOT, "benchmarks", "chaos", "replicated_worker.py")
MODES = ("sync", "async", "ssp")
DEFAULT_MODES = ("sync", "async")   # what --modes draws from unless told (old seeds replay as they did)
FAULTS = ("SIGKILL", "SIGSTOP", "partition")
MOMENTS = ("rounds", "save", "startup")
STARTUP = ("registered", "initialised", "spawned")
ROUNDS, SAVE_EVERY = 60, 10
SAVES = (ROUNDS - 1) // SAVE_EVERY
SYNC_SHARE = 2 / 3
ROUND_DELAY_S, SAVE_DELAY_S = 0.04, 0.005    # the random delay's bound after the moment's line
BOUND_S = 60.0          # from the fault to the job's end
START_S = 60.0          # from the launch to the fault's moment
REPLICATED = {"KVSTORE_REPLICAS": "1", "KVSTORE_CHUNK_BYTES": "4096", "KVSTORE_HEARTBEAT_TIMEOUT": "2",
              "KVSTORE_HEARTBEAT_INTERVAL": "0.4", "KVSTORE_ABORT_GRACE": "2"}
FAILED_OVER = "served by their backups"
STARTED_AGAIN = "before the job formed: its launcher starts it again in place"   # the scheduler's line
# a server stopped before it registers is found at the registration deadline
# (KVSTORE_TIMEOUT), not by heartbeats: 20 s, as benchmarks/chaos/phases.py
TIMEOUT = "20"


@dataclasses.dataclass(frozen=True)
class Target:
    """What a fault strikes: processes of ``role`` (KVSTORE_ROLE), one of ``ranks``
    (given the job's servers) drawn at random, in a job of ``rounds`` rounds started
    with ``flags`` (launcher options). ``first``: a first server is killed once the
    job runs, and the fault waits until its replacement's replicas are rebuilt."""
    name: str
    role: str
    ranks: Callable[[int], range | tuple]
    flags: tuple[str, ...] = ()
    first: bool = False
    rounds: int = ROUNDS
    faults: tuple[str, ...] = FAULTS      # the faults it is meant to survive
    moments: tuple[str, ...] = MOMENTS
    survived: str = FAILED_OVER       # the line that says it was survived


# The scheduler survives SIGKILL and SIGSTOP (its launcher restarts it, killing a stopped
# one that answers no ping: docs/reliability.md; its partition is the whole job's), after start-up.
SCHEDULER = Target("scheduler", "scheduler", lambda servers: (0,), faults=("SIGKILL", "SIGSTOP"),
                   moments=("rounds", "save"), survived="the restarted scheduler rebuilt the job")
# A second server after a replacement: any server of the job or the replacement (rank S).
SECOND = Target("second-server", "server", lambda servers: range(servers + 1), flags=("--restart-servers", "1"),
                first=True, rounds=300, faults=("SIGKILL", "SIGSTOP"), moments=("rounds", "save"))
TARGETS = (Target("server", "server", range), SCHEDULER, SECOND)
FIRST_ROUND = 3            # second-server: the first server is killed after this round
REBUILT = r"rebuilt the replica of server \d+'s share on server \d+"   # the scheduler's line, once per share
REBUILDS = 2               # one death leaves two shares without a backup: the dead one's and the one it backed
DEFAULT_TARGETS = ("server",)     # what --targets draws from unless told (old seeds replay as they did)


@dataclasses.dataclass(frozen=True)
class Case:
    """One run's choices, all drawn from ``seed`` (:func:`pick`). ``at``: the round
    after which (``rounds``) or the save during which (``save``) the fault strikes;
    ``startup``: which start-up moment; ``delay_s``: after the moment's line."""
    seed: int
    mode: str
    workers: int
    servers: int
    fault: str
    target: str
    rank: int
    moment: str
    at: int = 0
    startup: str = ""
    delay_s: float = 0.0
    first: int = -1          # second-server: the server killed first (-1: none)
    rounds: int = ROUNDS
    elastic: bool = False    # the job runs with --elastic 1:W (workers may leave and join)
    host_reduce: bool = False   # KVSTORE_HOST_REDUCE=1: dist_sync's workers push their host's sum

    def describe(self) -> str:
        when = {"rounds": f"after round {self.at} + {1e3 * self.delay_s:.0f} ms",
                "save": f"in save {self.at} + {1e3 * self.delay_s:.1f} ms",
                "startup": f"at start-up ({self.startup})"}[self.moment]
        if self.first >= 0:
            when = f"{when.replace('round ', 'round +').replace('save ', 'save +')} of the replicas rebuilt " \
                   f"after server {self.first}'s SIGKILL"
        return (f"seed {self.seed}: {self.fault} -> {self.target} {self.rank} {when} "
                f"(dist_{self.mode}{', elastic' if self.elastic else ''}"
                f"{', host groups' if self.host_reduce else ''}, W={self.workers} S={self.servers})")


def draw_mode(rng: random.Random, modes) -> str:
    """One of ``modes``: ``dist_sync`` in :data:`SYNC_SHARE` of the runs (where it is
    one of them), the others evenly; one random number whatever the modes, so the
    later draws of a seed are the same (sync and async: as before ssp existed)."""
    if len(modes) == 1:
        return modes[0]
    r, others = rng.random(), [m for m in MODES if m in modes and m != "sync"]
    if "sync" in modes:
        if r < SYNC_SHARE:
            return "sync"
        r = (r - SYNC_SHARE) / (1 - SYNC_SHARE)
    return others[min(int(r * len(others)), len(others) - 1)]


def pick(seed: int, modes=DEFAULT_MODES, partitions: bool = True,
         targets: tuple[str, ...] = DEFAULT_TARGETS, elastic: bool = False, host_reduce: bool = False) -> Case:
    """The case of run ``seed``: every choice random, from that seed alone
    (``partitions``: whether network partitions can be made here; ``targets``: the
    names of the :data:`TARGETS` drawn from; ``elastic``: every job elastic, and
    ``host_reduce``: every job with host groups, which draw nothing, so a seed is
    the same case either way)."""
    return dataclasses.replace(_pick(seed, modes, partitions, targets), elastic=elastic, host_reduce=host_reduce)


def _pick(seed: int, modes, partitions: bool, targets: tuple[str, ...]) -> Case:
    rng = random.Random(seed)
    mode = draw_mode(rng, modes)
    workers, servers = rng.randint(2, 4), rng.randint(2, 4)
    fault = rng.choice(FAULTS if partitions else FAULTS[:-1])
    target = rng.choice([t for t in TARGETS if t.name in targets])
    if fault not in target.faults:
        fault = rng.choice(target.faults)
    rank = rng.choice(list(target.ranks(servers)))
    moment = rng.choice(MOMENTS)
    if moment not in target.moments:
        moment = rng.choice(target.moments)
    if target.first:   # (drawn after the others: the other targets' seeds replay as before)
        first = rng.randrange(servers)
        if rank == first:
            rank = rng.choice([r for r in target.ranks(servers) if r != first])
        at = rng.randint(1, 20) if moment == "rounds" else rng.randint(1, 3)   # after the rebuild
        bound = ROUND_DELAY_S if moment == "rounds" else SAVE_DELAY_S
        return Case(seed, mode, workers, servers, fault, target.name, rank, moment, at=at,
                    delay_s=round(rng.uniform(0, bound), 4), first=first, rounds=target.rounds)
    if moment == "rounds":
        return Case(seed, mode, workers, servers, fault, target.name, rank, moment,
                    at=rng.randint(3, ROUNDS - 15), delay_s=round(rng.uniform(0, ROUND_DELAY_S), 4))
    if moment == "save":
        return Case(seed, mode, workers, servers, fault, target.name, rank, moment,
                    at=rng.randint(1, SAVES), delay_s=round(rng.uniform(0, SAVE_DELAY_S), 4))
    startup = rng.choice(STARTUP if fault != "partition" else ("initialised",))
    return Case(seed, mode, workers, servers, fault, target.name, rank, moment, startup=startup)


class References:
    """The final weights of uninterrupted ``dist_sync`` runs without replicas, by W
    and the rounds (they depend on these only), each computed once."""

    def __init__(self) -> None:
        self._digests: dict[tuple[int, int], str] = {}

    def digest(self, workers: int, rounds: int = ROUNDS) -> str:
        """The digest; RuntimeError if the uninterrupted job fails."""
        if (workers, rounds) not in self._digests:
            tag = uuid.uuid4().hex
            env = job_env(tag, KVSTORE_DETERMINISTIC="1", KVSTORE_CHUNK_BYTES=REPLICATED["KVSTORE_CHUNK_BYTES"])
            job = Job(launcher_argv(workers, 2, [SCRIPT, "--mode", "sync", "--rounds", str(rounds)], env), env)
            code = job.end(BOUND_S)
            problems = finish([job], tag)
            got = set(re.findall(r"^\[worker:\d+\] digest (\w+)$", job.text, re.M))
            if code != 0 or len(got) != 1 or problems:
                raise RuntimeError(f"the uninterrupted run of {workers} workers failed (status {code}, "
                                   f"{problems}):\n{job.text[-3000:]}")
            self._digests[(workers, rounds)] = got.pop()
        return self._digests[(workers, rounds)]


class Launched:
    """A job through ``python -m tracker.local``: one output, lines prefixed by role and rank."""

    def __init__(self, case: Case, env: dict[str, str], flags: tuple[str, ...]):
        script = [SCRIPT, "--mode", case.mode, "--rounds", str(case.rounds), "--save-every", str(SAVE_EVERY)]
        self.tag = env["CHAOS_TAG"]
        elastic = ("--elastic", f"1:{case.workers}") if case.elastic else ()
        self.job = Job(launcher_argv(case.workers, case.servers, script, env,
                                     flags=("--kill-grace", "1", *elastic, *flags)), env)

    def wait_for(self, role: str, rank: int, pattern: str, timeout: float) -> re.Match | None:
        return self.job.wait_for(line_of(role, rank) + pattern, timeout)

    def lines(self, role: str, rank: int) -> list[str]:
        return [m.group("line") for m in re.finditer(rf"^{line_of(role, rank)}(?P<line>.*)$", self.job.text, re.M)]

    def spawned(self, role: str, rank: int) -> bool:
        return await_pid(self.job, self.tag, role, rank, START_S) is not None

    def end(self, timeout: float) -> int | None:
        return self.job.end(timeout)

    @property
    def text(self) -> str:
        return self.job.text

    def close(self) -> list[str]:
        return finish([self.job], self.tag)


class Placed:
    """A job on two emulated machines (benchmarks.harness.netns.HostPair), one process
    per Job (lines unprefixed): the target server alone on B, everything else on A,
    the scheduler standalone. ``cut()`` takes B's link down."""

    def __init__(self, case: Case, env: dict[str, str]):
        from benchmarks.harness import netns
        self.netns, self.tag = netns, env["CHAOS_TAG"]
        self.link = netns.HostPair()
        self.jobs: dict[str, Job] = {}
        self.link.up()
        hosts = ["B" if r == case.rank else "A" for r in range(case.servers)]
        extra = {k: v for k, v in env.items() if k.startswith(("KVSTORE_", "CHAOS_"))}
        if case.elastic:      # the standalone scheduler reads it (a launcher takes --elastic)
            extra["KVSTORE_ELASTIC"] = f"1:{case.workers}"
        procs = netns.ps_job(self.link, case.workers, case.servers, [sys.executable, "-m", "kvstore.server"],
                             [sys.executable, SCRIPT, "--mode", case.mode, "--rounds", str(ROUNDS),
                              "--save-every", str(SAVE_EVERY)], extra,
                             server_hosts=hosts, worker_hosts=["A"] * case.workers)
        for label, argv, penv in procs:
            self.jobs[label] = Job(argv, {**os.environ, **penv})

    def wait_for(self, role: str, rank: int, pattern: str, timeout: float) -> re.Match | None:
        return self.jobs[f"{role} {rank}"].wait_for(pattern, timeout)

    def lines(self, role: str, rank: int) -> list[str]:
        return [line.rstrip("\n") for line in self.jobs[f"{role} {rank}"].lines]

    def cut(self) -> None:
        self.netns.run_checked(["ip", "-n", self.link.ns["B"], "link", "set", self.link.dev["B"], "down"],
                               "partition")

    def end(self, timeout: float) -> int | None:
        """The scheduler's and the workers' worst status (the cut-off server's is not
        counted: it ends by losing the scheduler); None if one still runs."""
        deadline, codes = time.monotonic() + timeout, []
        for label, job in self.jobs.items():
            if not label.startswith("server"):
                code = job.end(max(0.1, deadline - time.monotonic()))
                if code is None:
                    return None
                codes.append(code)
        return max(codes, key=abs)

    def server_ended(self, timeout: float) -> list[str]:
        """The problem if a server (the cut-off one) still runs ``timeout`` s from now."""
        deadline = time.monotonic() + timeout
        return [f"{label} did not end within {timeout:.0f} s of the job ({LATE})"
                for label, job in self.jobs.items() if label.startswith("server")
                and job.end(max(0.1, deadline - time.monotonic())) is None]

    @property
    def text(self) -> str:
        return "".join(f"--- {label}\n{job.text}" for label, job in self.jobs.items())

    def close(self) -> list[str]:
        try:
            return end_jobs(list(self.jobs.values()), self.tag)
        finally:
            self.link.down()


def run_case(case: Case, refs: References) -> dict:
    """Run ``case``; its record (``problems`` empty when it passed)."""
    record: dict = {**dataclasses.asdict(case), "problems": []}
    problems: list[str] = record["problems"]
    want = refs.digest(case.workers, case.rounds) if case.mode == "sync" else None
    target = next(t for t in TARGETS if t.name == case.target)
    directory = tempfile.mkdtemp(prefix="chaos-replicated-")
    env = job_env(uuid.uuid4().hex, **REPLICATED, KVSTORE_CHECKPOINT_DIR=directory, KVSTORE_TIMEOUT=TIMEOUT,
                  **({"KVSTORE_DETERMINISTIC": "1"} if case.mode == "sync" else {}),
                  **({"KVSTORE_HOST_REDUCE": "1"} if case.host_reduce else {}))
    job: Launched | Placed | None = None
    started = time.monotonic()
    try:
        job = Placed(case, env) if case.fault == "partition" else Launched(case, env, target.flags)
        if case.first >= 0:
            assert isinstance(job, Launched)    # (no partitions for this target)
            rebuilt = first_failure(job, case)
            if rebuilt is None:
                problems.append(f"server {case.first}'s replacement did not get its {REBUILDS} replicas rebuilt")
                return record
            case = rebuilt
        if not reach_moment(job, case, target.role):
            problems.append(f"the job did not reach the fault's moment ({case.moment} {case.at or case.startup})")
            return record
        # the target's pid is looked up first (a scan of /proc: 20 ms and more under load),
        # so that the fault's time is the signal's, not the scan's start; a cut's is when
        # `ip` returned (the link is down by then)
        if isinstance(job, Placed):
            job.cut()
            fault_at = time.time()
        else:
            pid = pid_of(job.tag, target.role, None if target is SCHEDULER else case.rank)
            fault_at = time.time()
            if pid is None:
                problems.append(f"no pid for {target.role} {case.rank}")
            else:
                try:
                    os.kill(pid, getattr(signal, case.fault))
                except ProcessLookupError:
                    problems.append(f"{target.role} {case.rank} (pid {pid}) was gone before the {case.fault}")
        code = job.end(BOUND_S)
        record.update(exit=code, seconds=round(time.time() - fault_at, 2))
        if code is None:
            problems.append(f"the job did not end within {BOUND_S:.0f} s of the fault ({LATE})")
        elif code != 0:
            problems.append(f"the job ended with status {code}")
        if isinstance(job, Placed) and code is not None:
            problems += job.server_ended(10.0)
        problems += judge(job, case, want, record, ended_ok=code == 0)
        ends = [float(m.group(2)) for m in map(re.compile(r"^round (\d+) (\d+\.\d+)$").match,
                                                job.lines("worker", 0)) if m]
        if any(end > fault_at for end in ends):
            record["pause_s"] = round(pause(ends, fault_at), 4)
        survived = STARTED_AGAIN if case.startup == "spawned" else target.survived
        if job.text.count(survived) < (2 if case.first >= 0 else 1):
            problems.append(f"the {target.name}'s loss was not reported survived ({survived!r})")
    except Exception as e:   # noqa: BLE001  (a broken run is recorded, the next one runs)
        problems.append(f"the runner failed: {type(e).__name__}: {e}")
    finally:
        if job is not None:
            problems += job.close()
            if problems:
                record["tail"] = job.text[-6000:]
                record["worker0"] = "\n".join(job.lines("worker", 0)[-80:])
        shutil.rmtree(directory, ignore_errors=True)
        record["wall_s"] = round(time.monotonic() - started, 1)
    return record


def first_failure(job: Launched, case: Case) -> Case | None:
    """(second-server) SIGKILL of ``case.first`` after worker 0's round FIRST_ROUND,
    then wait until the scheduler reported the replicas rebuilt on the replacement.
    Returns the case with its moment made absolute (``at`` rounds or saves after the
    last round worker 0 finished by then), or None if that did not happen."""
    if job.wait_for("worker", 0, rf"round {FIRST_ROUND} ", START_S) is None:
        return None
    pid = pid_of(job.tag, "server", case.first)
    if pid is None:
        return None
    os.kill(pid, signal.SIGKILL)
    if not job.job.wait_count(REBUILT, REBUILDS, START_S):
        return None
    done = max((int(m.group(1)) for m in map(re.compile(r"^round (\d+) ").match, job.lines("worker", 0)) if m),
               default=FIRST_ROUND)
    at = done + case.at if case.moment == "rounds" else done // SAVE_EVERY + case.at
    return dataclasses.replace(case, at=at)


def reach_moment(job: Launched | Placed, case: Case, role: str) -> bool:
    """Wait for the case's moment (and its delay); whether it came."""
    if case.moment == "rounds":
        found = job.wait_for("worker", 0, rf"round {case.at} ", START_S) is not None
    elif case.moment == "save":
        found = job.wait_for("worker", 0, rf"saving {case.at}$", START_S) is not None
    elif case.startup == "spawned":
        assert isinstance(job, Launched)    # partitions strike after start-up
        return job.spawned(role, case.rank)
    elif case.startup == "registered":
        found = job.wait_for(role, case.rank, r".*serving on", START_S) is not None
    else:
        found = job.wait_for("worker", 0, r"initialised$", START_S) is not None
    if found and case.delay_s:
        time.sleep(case.delay_s)    # the fault's random moment inside the round or save, not a synchronisation
    return found


def judge(job: Launched | Placed, case: Case, want: str | None, record: dict, ended_ok: bool) -> list[str]:
    """The problems of the job's results: wrong values, other weights, pushes not
    exact. A result missing counts only where the job ended with status 0 (a
    failed job's missing results are its status's problem, not a wrong value)."""
    problems = []
    outputs = {r: job.lines("worker", r) for r in range(case.workers)}
    group = f"host group {list(range(case.workers))}"
    if case.host_reduce and case.mode == "sync" and ended_ok and group not in outputs[0]:
        problems.append(f"worker 0 did not report {group!r} (KVSTORE_HOST_REDUCE=1)")
    if any("WRONG" in line for lines in outputs.values() for line in lines):
        problems.append(f"a worker saw a {WRONG}")
    if case.mode == "sync":
        got = {r: next((line.split()[1] for line in lines if line.startswith("digest ")), None)
               for r, lines in outputs.items()}
        other = {r: d for r, d in got.items() if d != want and (d is not None or ended_ok)}
        if other:
            problems.append(f"worker(s) {sorted(other)} ended with other weights than an uninterrupted run's "
                            f"({WRONG}: {str(other[min(other)])[:12]} instead of {str(want)[:12]})")
    else:
        missing = [r for r, lines in outputs.items() if "exact" not in lines]
        if missing and ended_ok:
            problems.append(f"worker(s) {missing} did not print exact: a push lost or applied twice ({WRONG})")
    record["saves_failed"] = sum(1 for line in outputs[0] if re.match(r"save \d+ failed", line))
    return problems


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) by linear interpolation between the sorted values."""
    s = sorted(values)
    i = q * (len(s) - 1)
    lo = int(i)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (i - lo)


def pauses(runs: list[dict]) -> str:
    """``median / p90 / max (n)`` of the runs' pauses; ``-`` without any."""
    got = [r["pause_s"] for r in runs if "pause_s" in r]
    if not got:
        return "-"
    return (f"{statistics.median(got):.3f} / {percentile(got, 0.9):.3f} / {max(got):.3f} "
            f"({len(got)})")


def summary(runs: list[dict]) -> str:
    """The table: runs, passes and failures by mode, fault and moment, with the
    pause's distribution; a line per failure with its seed."""
    lines = ["| mode | fault | moment | runs | passed | failed | pause (s): median / p90 / max (runs) |",
             "|---|---|---|---:|---:|---:|---|"]

    def row(mode: str, fault: str, moment: str, mine: list[dict]) -> None:
        if mine:
            bad = sum(1 for r in mine if r["problems"])
            lines.append(f"| {mode} | {fault} | {moment} | {len(mine)} | {len(mine) - bad} | {bad} | "
                         f"{pauses(mine)} |")

    def moment_of(r: dict) -> str:
        return r["moment"] if r["moment"] != "startup" else f"startup ({r['startup']})"

    for mode in MODES:
        of_mode = [r for r in runs if r["mode"] == mode]
        for fault in FAULTS:
            mine = [r for r in of_mode if r["fault"] == fault]
            for moment in dict.fromkeys(map(moment_of, sorted(mine, key=lambda r: MOMENTS.index(r["moment"])))):
                row(f"dist_{mode}", fault, moment, [r for r in mine if moment_of(r) == moment])
            row(f"dist_{mode}", fault, "**all**", mine)
        row(f"dist_{mode}", "**all**", "", of_mode)
    for fault in FAULTS:
        row("**all**", fault, "", [r for r in runs if r["fault"] == fault])
    for target in TARGETS:
        if any(r["target"] != target.name for r in runs):      # several targets: each one's own line
            row("**all**", f"{target.name} (any fault)", "", [r for r in runs if r["target"] == target.name])
    row("**all**", "**all**", "", runs)
    failed = [r for r in runs if r["problems"]]
    if failed:
        lines += ["", "Failures (replay one with `python -m benchmarks.chaos --replicated --replay SEED`, and the run's `--modes` and `--targets`):", ""]
        lines += [f"- {describe(r)}" for r in failed]
    return "\n".join(lines)


def describe(run: dict) -> str:
    """One line about a run, for the progress output and the list of failures."""
    case = Case(**{f.name: run[f.name] for f in dataclasses.fields(Case) if f.name in run})
    status = "ok" if not run["problems"] else "FAILED: " + "; ".join(run["problems"])
    shown = f", pause {run['pause_s']:.3f} s" if "pause_s" in run else ""
    return f"{case.describe()}: exit {run.get('exit')}{shown} ({run['wall_s']} s), {status}"


def can_partition() -> bool:
    """Whether network partitions can be made here: root and iproute2."""
    return os.geteuid() == 0 and shutil.which("ip") is not None

