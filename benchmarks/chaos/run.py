"""Chaos: many short jobs, each with one random fault at a random moment of one
phase of a job's life.

    python -m benchmarks.chaos --runs 200            # ~25-35 minutes on 2 cores
    python -m benchmarks.chaos --runs 12 --seed 7    # a quick look
    python -m benchmarks.chaos --runs 200 --ssh      # half the jobs through tracker.ssh
    python -m benchmarks.chaos --phases save,resume  # only faults around checkpoints
    python -m benchmarks.chaos --elastic --runs 40   # elastic jobs (below)
    python -m benchmarks.chaos --replicated --runs 120   # replicated servers: benchmarks/chaos/replicated.py

The runs take turns in the phases of ``--phases`` (default all): ``run`` (mid-run,
below), and ``startup``, ``save``, ``resume`` and ``teardown``, whose faults, and
what a run of them must show (after a save or resume fault: the same command
with ``--resume`` ends with an uninterrupted run's weights bit for bit, or
refuses clearly), benchmarks/chaos/phases.py describes. One table counts runs,
passes, wrong values, leftovers and jobs not ended in bound by phase and fault.

A mid-run (``run``) fault: each run starts ``python -m tracker.local -n W -s S`` (W in 1-4, S in 1-3, sync or
async, chosen at random) on benchmarks/chaos/worker.py, which checks exact sums
every round, waits until the workers have done a random number of rounds, then
injects one fault into one random process: SIGKILL, SIGTERM or SIGSTOP (a worker
or a server), exit(1) or an uncaught exception (a worker). A run passes when:

- the job ends within 10 s of the fault (30 s for SIGSTOP: the heartbeat bound),
  with a non-zero status;
- the final table marks the faulty process as the root cause;
- no process of the job is left (looked up by a tag in every process's environment);
- no worker saw a wrong value.

Prints the table and writes it with every run (markdown and JSON) to --out-dir
(default: a new scratch directory; ``--record``: benchmarks/results/chaos/). With root, a sixth fault is a network partition: the
job runs on two emulated machines (network namespaces, benchmarks.harness.netns) and one
machine's link goes down.

With ``--elastic`` every job is elastic (docs/elastic.md): W in 2-4 workers run
``--elastic MIN:W`` with MIN = 1 or W - 1, half the jobs with ``--max-restarts 1``.
The workers run 40 rounds past the fault's (600 where a replacement should join,
1500 over ssh) and pass a barrier every 10, where a replacement joins (it takes
the round from kv.progress). Where one should join, the workers then go on to
the first barrier where the job has W members again, for at most 45 s
(``--await-members``): a replacement that starts slowly still finds the job. One fault goes into one worker (SIGKILL, SIGTERM,
SIGSTOP, exit or an exception), or in a fifth of the runs a signal into a server.
A worker's fault passes when:

- the job ends with status 0 within 60 s of the fault (SIGSTOP: the heartbeat
  timeout removes the stopped worker, and the launcher stops it once the job is over);
- the launcher's log reports the faulty worker (by its pid) as having left the job;
- with ``--max-restarts 1`` a replacement started and joined the running job
  (a stopped worker never exits while the job runs: nothing replaces it);
- no process is left and no worker saw a wrong value (in sync mode a round then
  holds the pushes of some of the workers: benchmarks/chaos/worker.py checks which).

A server's fault must still end the job as in the default mode. The table and
its runs go to chaos-elastic.md and chaos-elastic.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import sys
import time
import uuid

from benchmarks.chaos import phases as chaos_phases, replicated as chaos_replicated
from benchmarks.harness.output import ResultsDir
from benchmarks.chaos.jobs import (DEFAULT_BOUND, ENV, LATE, ROOT, WRONG, Job, end_jobs, ended,
                                   finish, job_env, kind_of, launcher_argv, marked_root_cause, pid_of)

OUTPUT = ResultsDir("chaos", "chaos")
FAULTS = ("SIGKILL", "SIGTERM", "SIGSTOP", "exit", "raise", "partition")
BOUND = {"SIGSTOP": 30.0, "partition": 30.0}   # seconds from the fault to the job's end
ELASTIC_FAULTS = FAULTS[:-1]
ELASTIC_BOUND = 60.0   # seconds from a worker's fault to an elastic job's end (status 0)
EVERY = 10             # elastic: rounds between the workers' barriers (where a replacement joins)
# elastic: rounds after the fault's; where a replacement should join, enough for it to
# start (a process; over ssh a new session, seconds) and reach a barrier: 40 rounds
# take well under a second
TAIL, JOIN_TAIL, SSH_JOIN_TAIL = 40, 600, 1500
SERVER_SHARE = 0.2     # elastic: the share of runs whose fault goes into a server


@dataclasses.dataclass(frozen=True)
class Elastic:
    """An elastic job's choices: ``--elastic MINIMUM:W`` and ``--max-restarts RESTARTS``."""
    minimum: int
    restarts: int


def one_run(rng: random.Random, index: int, partitions: bool = True, sshd=None) -> dict:
    """A run with every choice random (partitions only where namespaces can be made;
    the launcher local, or ssh when ``sshd`` is given)."""
    workers, servers = rng.randint(1, 4), rng.randint(1, 3)
    mode, fault = rng.choice(("sync", "async")), rng.choice(FAULTS if partitions else FAULTS[:-1])
    if fault == "partition":
        return partition_case(index, max(workers, 2), servers, mode, after=rng.randint(2, 30))
    role = "worker" if fault in ("exit", "raise") else rng.choice(("worker", "server"))
    rank = rng.randrange(workers if role == "worker" else servers)
    via = sshd if sshd is not None and rng.random() < 0.5 else None
    return run_case(index, workers, servers, mode, fault, role, rank, after=rng.randint(2, 30), sshd=via)


def one_elastic_run(rng: random.Random, index: int, sshd=None) -> dict:
    """An elastic run with every choice random (the module's docstring says which)."""
    workers, servers = rng.randint(2, 4), rng.randint(1, 3)
    mode, fault = rng.choice(("sync", "async")), rng.choice(ELASTIC_FAULTS)
    role = "server" if fault.startswith("SIG") and rng.random() < SERVER_SHARE else "worker"
    rank = rng.randrange(workers if role == "worker" else servers)
    elastic = Elastic(minimum=rng.choice((1, workers - 1)), restarts=rng.choice((0, 1)))
    via = sshd if sshd is not None and rng.random() < 0.5 else None
    return run_case(index, workers, servers, mode, fault, role, rank, after=rng.randint(2, 30), sshd=via,
                    elastic=elastic)


def run_case(index: int, workers: int, servers: int, mode: str, fault: str, role: str, rank: int,
             after: int, sshd=None, elastic: Elastic | None = None) -> dict:
    """One job with the given fault; the run's record, ``problems`` empty when it passed.
    With ``sshd`` (tests/services.py's loopback sshd) the job runs through
    ``tracker.ssh`` on 127.0.0.2 and 127.0.0.3. With ``elastic`` the job is elastic,
    and a worker's fault must leave it running to its end (:func:`left_and_joined`)."""
    tag = uuid.uuid4().hex
    env = job_env(tag)
    if fault in ("exit", "raise"):
        env.update(CHAOS_FAULT=fault, CHAOS_RANK=str(rank), CHAOS_AFTER=str(after))
    run = {"phase": "run", "run": index, "workers": workers, "servers": servers, "mode": mode,
           "fault": fault, "target": f"{role} {rank}", "after_rounds": after,
           "launcher": "ssh" if sshd else "local"}
    script, flags = [os.path.join(ROOT, "benchmarks", "chaos", "worker.py"), "--mode", mode], []
    if elastic is not None:
        joins = role == "worker" and elastic.restarts and fault != "SIGSTOP"
        tail = (SSH_JOIN_TAIL if sshd else JOIN_TAIL) if joins else TAIL
        script += ["--rounds", str(after + tail), "--every", str(EVERY)]
        if joins:
            script += ["--await-members", str(workers)]
        flags = ["--elastic", f"{elastic.minimum}:{workers}", "--max-restarts", str(elastic.restarts)]
        run.update(elastic=f"{elastic.minimum}:{workers}", max_restarts=elastic.restarts)
    job = Job(launcher_argv(workers, servers, script, env, sshd, flags), env)
    problems = []
    try:
        # signals come once the target's side has done `after` rounds; a worker's own
        # exit or exception comes right after its round `after - 1`: time from there
        seen = after - 1 if fault in ("exit", "raise") else after
        watched = rank if role == "worker" else 0      # ssh prefixes carry the host: [worker:0@...]
        ready = None if elastic is None else \
            job.wait_for(rf"\[worker:{watched}(@[^\]]*)?\] ready rank {watched} pid (\d+)", 60)
        if job.wait_for(rf"\[worker:{watched}(@[^\]]*)?\] round {seen} ok", 60) is None:
            problems.append("the job did not reach the fault's round")
        fault_at = time.monotonic()
        if fault.startswith("SIG"):
            pid = pid_of(tag, role, rank)
            if pid is None:
                problems.append(f"no pid for {role} {rank} in the output")
            else:
                os.kill(pid, getattr(signal, fault))
        survives = elastic is not None and role == "worker"   # the job goes on without it
        bound = ELASTIC_BOUND if survives else BOUND.get(fault, DEFAULT_BOUND)
        code, took, late = ended(job, fault_at, bound, expect_failure=not survives)
        run.update(exit=code, seconds=round(took, 2))
        problems += late
        if survives and code not in (None, 0):
            problems.append(f"the job ended with status {code}")
        if "WRONG" in job.text:
            problems.append(f"a worker saw a {WRONG}")
        if code is not None and survives:
            assert elastic is not None   # only a worker of an elastic job survives
            pid = int(ready.group(2)) if ready else None
            problems += left_and_joined(job, run, rank, pid, fault, elastic.restarts)
        elif code is not None and not marked_root_cause(job, role, rank):
            problems.append(f"{role} {rank} is not marked as the root cause")
    finally:
        problems += finish([job], tag, sshd)
    run["problems"] = problems
    if problems:
        run["tail"] = job.text[-4000:]
    return run


def left_and_joined(job: Job, run: dict, rank: int, pid: int | None, fault: str,
                    restarts: int) -> list[str]:
    """The problems of an elastic job that ended after a fault of worker ``rank``
    (process ``pid``): the launcher's log must report it as having left; with
    ``restarts`` a replacement must start and join the running job (the others
    wait for it: ``--await-members``). Records in ``run`` whether one joined."""
    problems = []
    if not re.search(rf"worker {rank} \(pid {pid} on [^)]*\) left the job", job.text):
        problems.append(f"worker {rank} (pid {pid}) is not reported as having left the job")
    if not restarts or fault == "SIGSTOP":     # a stopped worker never exits while the job runs
        return problems
    joined = re.search(rf"^\[worker:{rank}(@[^\]]*)?\] joined the running job at round (\d+)",
                       job.text, re.M)
    run["replaced"] = bool(joined)
    if joined:
        run["joined_at_round"] = int(joined.group(2))
    if f"started worker {rank} #1 in place of worker {rank}" not in job.text:
        problems.append(f"no replacement of worker {rank} was started")
    elif not run["replaced"]:
        problems.append(f"the replacement of worker {rank} did not join the running job")
    return problems


def partition_case(index: int, workers: int, servers: int, mode: str, after: int) -> dict:
    """Two emulated machines (network namespaces joined by a veth pair,
    benchmarks.harness.netns): the scheduler, server 0 and worker 0 on A, rank 1 on B, and so
    on; after ``after`` rounds B's link goes down. The standalone scheduler must end
    non-zero within the heartbeat bound naming a process on B, every process must
    end, and no worker may have seen a wrong value. Needs root."""
    from benchmarks.harness import netns
    tag = uuid.uuid4().hex
    run = {"phase": "run", "run": index, "workers": workers, "servers": servers, "mode": mode,
           "fault": "partition", "target": "machine B", "after_rounds": after}
    link, problems, jobs = netns.HostPair(), [], []
    try:
        link.up()
        procs = netns.ps_job(link, workers, servers, [sys.executable, "-m", "kvstore.server"],
                             [sys.executable, os.path.join(ROOT, "benchmarks", "chaos", "worker.py"),
                              "--mode", mode], {**ENV, "CHAOS_TAG": tag})
        jobs = [(label, Job(argv, {**os.environ, **env})) for label, argv, env in procs]
        by_label = dict(jobs)
        if by_label["worker 0"].wait_for(rf"round {after} ok", 60) is None:
            problems.append("the job did not reach the fault's round")
        fault_at = time.monotonic()
        netns.run_checked(["ip", "-n", link.ns["B"], "link", "set", link.dev["B"], "down"], "partition")
        code, took, late = ended(by_label["scheduler"], fault_at, BOUND["partition"])
        run.update(exit=code, seconds=round(took, 2))
        problems += [f"the scheduler: {p}" for p in late]
        on_b = [label for label, _ in jobs if label != "scheduler" and netns.side_of(int(label.split()[1])) == "B"]
        named = re.search(r"job failed: .*?(server|worker) (\d+)", by_label["scheduler"].text)
        if not named or f"{named.group(1)} {named.group(2)}" not in on_b:
            problems.append(f"the scheduler did not name a process on B ({', '.join(on_b)})")
        deadline = time.monotonic() + BOUND["partition"]
        for label, job in jobs:
            if job.end(max(0.1, deadline - time.monotonic())) is None:
                problems.append(f"{label} did not end within {BOUND['partition']:.0f} s of the scheduler "
                                f"({LATE})")
        if any("WRONG" in job.text for _, job in jobs):
            problems.append(f"a worker saw a {WRONG}")
    except netns.SetupFailed as e:
        problems.append(f"no emulated machines: {e}")
    finally:
        problems += end_jobs([job for _, job in jobs], tag)
        link.down()
    run["problems"] = problems
    if problems:
        run["tail"] = "\n".join(f"--- {label}\n{job.text[-1500:]}" for label, job in jobs)
    return run


def table(runs: list[dict], elastic: bool = False) -> str:
    """Counts by fault; elastic runs by fault and target role, with how many
    replacements joined the running job of how many runs that started one."""
    if elastic:
        pairs = [(fault, role) for role in ("worker", "server") for fault in ELASTIC_FAULTS
                 if role == "worker" or fault.startswith("SIG")]
        groups = [(f"{fault} -> {role}",
                   [r for r in runs if r["fault"] == fault and r["target"].startswith(role)])
                  for fault, role in pairs]
    else:
        groups = [(fault, [r for r in runs if r["fault"] == fault]) for fault in FAULTS]
    lines = ["| fault | runs | passed | failed |" + (" replacement joined |" if elastic else ""),
             "|---|---:|---:|---:|" + ("---:|" if elastic else "")]
    for label, mine in groups + [("all", runs)]:
        bad = sum(1 for r in mine if r["problems"])
        started = [r for r in mine if "replaced" in r]
        joined = f" {sum(1 for r in started if r['replaced'])} of {len(started)} |" if elastic else ""
        lines.append(f"| {label} | {len(mine)} | {len(mine) - bad} | {bad} |{joined}")
    return "\n".join(lines)


def phase_table(runs: list[dict]) -> str:
    """Counts by phase and fault (mid-run faults by fault, the other phases' by fault
    and target role): runs, passed, failed, and of the problems the wrong values,
    the runs with processes left and the jobs not ended in bound; after a save or
    resume fault, how the job started with --resume ended (resumed with the
    uninterrupted run's weights, or refused clearly)."""
    lines = ["| phase | fault | runs | passed | failed | wrong values | leftovers | not ended in bound "
             "| resumed | refused |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def row(phase: str, label: str, mine: list[dict]) -> str:
        kinds = [{kind_of(p) for p in r["problems"]} for r in mine]
        count = [sum(1 for k in kinds if kind in k) for kind in ("wrong", "leftover", "late")]
        bad = sum(1 for r in mine if r["problems"])
        resumed = "-" if phase in ("run", "startup", "teardown") else \
            " | ".join(str(sum(1 for r in mine if r.get("resume") == how)) for how in ("resumed", "refused"))
        return (f"| {phase} | {label} | {len(mine)} | {len(mine) - bad} | {bad} | "
                f"{' | '.join(map(str, count))} | {resumed if resumed != '-' else '- | -'} |")

    for phase in ("run", *chaos_phases.PHASES):
        mine = [r for r in runs if r.get("phase", "run") == phase]
        if not mine:
            continue
        if phase == "run":
            groups = [(fault, [r for r in mine if r["fault"] == fault]) for fault in FAULTS]
        else:
            groups = [(f"{fault} -> {role}", [r for r in mine if r["fault"] == fault
                                              and r["target"].startswith(role)])
                      for fault in chaos_phases.FAULTS[phase] for role in ("worker", "server")]
        lines += [row(phase, label, group) for label, group in groups if group]
        lines.append(row(phase, "all", mine))
    lines.append(row("all", "all", runs).replace("| all | all |", "| **all** | |"))
    return "\n".join(lines)


def describe(run: dict) -> str:
    """One line about a run, for the progress output."""
    status = "ok" if not run["problems"] else "FAILED: " + "; ".join(run["problems"])
    if run.get("phase", "run") == "run":
        elastic = f" --elastic {run['elastic']} --max-restarts {run['max_restarts']}" if "elastic" in run else ""
        return (f"{run['fault']} -> {run['target']} ({run.get('launcher', 'local')}, "
                f"W={run['workers']} S={run['servers']}{elastic} {run['mode']}): exit {run.get('exit')} "
                f"after {run.get('seconds')} s ({run['wall_s']} s in all), {status}")
    resumed = f", --resume: exit {run['resume_exit']} {run.get('resume', '')}" if "resume_exit" in run else ""
    return (f"[{run['phase']}] {run['fault']} -> {run['target']} at {run['moment']} ({run['launcher']}, "
            f"W={run['workers']} S={run['servers']}, checkpoints {run['checkpoints']}): exits "
            f"{run.get('exits')} after {run.get('seconds')} s{resumed} ({run['wall_s']} s in all), {status}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--seed", type=int, default=None, help="random seed [default: from the clock, printed]")
    OUTPUT.add_arguments(p)
    p.add_argument("--ssh", action="store_true",
                   help="half the runs through tracker.ssh, on a loopback sshd started here "
                        "(127.0.0.2-3; needs openssh-server, as the tests)")
    p.add_argument("--elastic", action="store_true",
                   help="elastic jobs (--elastic MIN:W, --max-restarts): a worker's fault must not end them; "
                        "with --replicated: every replicated job elastic (--elastic 1:W)")
    p.add_argument("--host-reduce", action="store_true",
                   help="with --replicated: every job with host groups (KVSTORE_HOST_REDUCE=1; dist_sync forms them)")
    p.add_argument("--replicated", action="store_true",
                   help="replicated servers (KVSTORE_REPLICAS=1): a server's fault must not end the job "
                        "(benchmarks/chaos/replicated.py)")
    p.add_argument("--modes", default=",".join(chaos_replicated.DEFAULT_MODES),
                   help="--replicated: the consistency modes the runs draw from, of "
                        f"{', '.join(chaos_replicated.MODES)} [default: %(default)s]")
    p.add_argument("--targets", default=",".join(chaos_replicated.DEFAULT_TARGETS),
                   help="--replicated: what the faults strike, of "
                        f"{', '.join(t.name for t in chaos_replicated.TARGETS)} (the scheduler: SIGKILL "
                        "during rounds or a save) [default: %(default)s]")
    p.add_argument("--replay", type=int, default=None, metavar="SEED",
                   help="--replicated: run only the run of this seed (as a failure lists it)")
    every = ("run", *chaos_phases.PHASES)
    p.add_argument("--phases", default=None,
                   help=f"comma-separated phases the runs take turns in: {', '.join(every)} [default: all; "
                        "with --elastic: run]")
    args = p.parse_args(argv)
    if args.replicated:
        return replicated_main(p, args)
    if args.host_reduce:
        p.error("--host-reduce goes with --replicated")
    phases = tuple(args.phases.split(",")) if args.phases else ("run",) if args.elastic else every
    if not phases or set(phases) - set(every) or len(set(phases)) != len(phases):
        p.error(f"--phases: a comma-separated list of distinct phases of {', '.join(every)}")
    if args.elastic and phases != ("run",):
        p.error("--elastic strikes mid-run only (--phases run)")
    out_dir = OUTPUT.chosen(p, args)
    seed = args.seed if args.seed is not None else int(time.time())
    print(f"seed {seed}, phases {', '.join(phases)}", flush=True)
    rng = random.Random(seed)
    partitions = os.geteuid() == 0 and shutil.which("ip") is not None
    if not partitions and "run" in phases and not args.elastic:
        print("no network partitions: they need root and iproute2 (ip)", flush=True)
    disks = chaos_phases.can_fill_disks()
    if not disks and "save" in phases:
        print("no disk-full faults: they mount a tmpfs, which needs root", flush=True)
    sshd = None
    if args.ssh:
        import tempfile
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from services import start_sshd
        sshd, why = start_sshd(tempfile.mkdtemp(prefix="chaos-sshd-"))
        if sshd is None:
            p.error(f"--ssh: {why}")
    runs, t0, refs = [], time.time(), chaos_phases.References()
    for i in range(args.runs):
        started, phase = time.monotonic(), phases[i % len(phases)]   # turns: no draw, same seeds as before
        if args.elastic:
            run = one_elastic_run(rng, i, sshd)
        elif phase == "run":
            run = one_run(rng, i, partitions, sshd)
        else:
            case = chaos_phases.pick(rng, phase, disks)
            via = sshd if sshd is not None and rng.random() < 0.5 else None
            run = chaos_phases.run_phase_case(case, i, refs, via)
        run["wall_s"] = round(time.monotonic() - started, 1)
        runs.append(run)
        print(f"run {i}: {describe(run)}", flush=True)
    if sshd is not None:
        sshd.stop()
    summary = table(runs, elastic=True) if args.elastic else phase_table(runs)
    print(summary)
    name = "chaos-elastic" if args.elastic else "chaos"
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump({"seed": seed, "phases": list(phases), "runs": runs, "seconds": round(time.time() - t0)},
                  f, indent=1)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(f"# Chaos{' (elastic jobs)' if args.elastic else ''}: {len(runs)} runs (seed {seed}, "
                f"phases {', '.join(phases)}, {time.strftime('%Y-%m-%d')}, "
                f"{round(time.time() - t0)} s)\n\n{summary}\n")
        for r in runs:
            if r["problems"]:
                where = f"[{r['phase']}] " if r.get("phase", "run") != "run" else ""
                f.write(f"\n- run {r['run']}: {where}{r['fault']} -> {r['target']}: {'; '.join(r['problems'])}\n")
    return 1 if any(r["problems"] for r in runs) else 0


def replicated_main(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--replicated``: runs of benchmarks/chaos/replicated.py, each with its own seed
    drawn from ``--seed`` (or only ``--replay``'s); the table and every run to
    chaos-replicated.md and .json."""
    modes = tuple(args.modes.split(","))
    if not modes or set(modes) - set(chaos_replicated.MODES) or len(set(modes)) != len(modes):
        p.error(f"--modes: a comma-separated list of {', '.join(chaos_replicated.MODES)}")
    if args.ssh or args.phases:
        p.error("--replicated runs its own jobs: no --ssh or --phases (--elastic: every job elastic)")
    if args.host_reduce and args.elastic:
        p.error("--host-reduce and --elastic: elastic jobs form no host groups")
    targets = tuple(args.targets.split(","))
    names = [t.name for t in chaos_replicated.TARGETS]
    if not targets or set(targets) - set(names) or len(set(targets)) != len(targets):
        p.error(f"--targets: a comma-separated list of {', '.join(names)}")
    out_dir = OUTPUT.chosen(p, args)
    seed = args.seed if args.seed is not None else int(time.time())
    rng = random.Random(seed)
    seeds = [args.replay] if args.replay is not None else [rng.randrange(1 << 31) for _ in range(args.runs)]
    partitions = chaos_replicated.can_partition()
    print(f"replicated, seed {seed}, modes {', '.join(modes)}, targets {', '.join(targets)}" +
          (", elastic jobs" if args.elastic else "") + (", host groups" if args.host_reduce else "") +
          ("" if partitions else "; no network partitions: they need root and iproute2 (ip)"), flush=True)
    runs, t0, refs = [], time.time(), chaos_replicated.References()
    for i, run_seed in enumerate(seeds):
        run = chaos_replicated.run_case(chaos_replicated.pick(run_seed, modes, partitions, targets, args.elastic,
                                                              args.host_reduce), refs)
        run["run"] = i
        runs.append(run)
        print(f"run {i}: {chaos_replicated.describe(run)}", flush=True)
    summary = chaos_replicated.summary(runs)
    print(summary)
    load = os.getloadavg()
    with open(os.path.join(out_dir, "chaos-replicated.json"), "w") as f:
        json.dump({"seed": seed, "modes": list(modes), "targets": list(targets), "runs": runs, "seconds": round(time.time() - t0),
                   "loadavg_at_end": load}, f, indent=1)
    with open(os.path.join(out_dir, "chaos-replicated.md"), "w") as f:
        f.write(f"# Chaos, replicated servers: {len(runs)} runs (seed {seed}, modes {', '.join(modes)}, "
                f"{'elastic jobs (--elastic 1:W), ' if args.elastic else ''}"
                f"{'host groups (KVSTORE_HOST_REDUCE=1), ' if args.host_reduce else ''}"
                f"targets {', '.join(targets)}, "
                f"{time.strftime('%Y-%m-%d')}, {round(time.time() - t0)} s, load average at the end "
                f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f})\n\n{summary}\n")
    return 1 if any(r["problems"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
