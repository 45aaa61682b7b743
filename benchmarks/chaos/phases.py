"""Chaos in the phases of a job's life around its rounds: start-up and
registration, a checkpoint save, a resume, and teardown. benchmarks/chaos/run.py runs
these with ``--phases`` (its own faults strike mid-run).

    python -m benchmarks.chaos --phases startup,save,resume,teardown --runs 40 --seed 1

Every job runs benchmarks/chaos/train.py: W in 1-4 workers (dist_sync, SGD with
momentum on the servers) train 30 steps, saving a checkpoint every 5 steps
(``kv.save_checkpoint``) or, in a third of the runs, automatically every 0.1 s
(``KVSTORE_CHECKPOINT_INTERVAL``), and print a digest of the final weights that an
uninterrupted run reproduces bit for bit (computed once per W, cached). Server R
(random) holds a big ballast: its checkpoint is the slow one to write and the one
a small disk cannot take. One fault per run, by phase:

- startup: SIGKILL, SIGTERM or SIGSTOP to a worker or a server as soon as its
  process exists (``spawned``: before it registers with the scheduler) or once it
  has registered (``registered``: a server's "serving on" line; a worker's first
  line after ``kvstore.create``, while its first ``init`` runs); or a worker's
  exit(1) or uncaught exception before ``kvstore.create`` or before ``init``.
- save: during the K-th save (K random), as soon as a file of server R's part of
  it appears in KVSTORE_CHECKPOINT_DIR (polled; if none shows, at server R's first
  log line about a checkpoint): SIGKILL of server R (mid-write) or of a worker.
  Or, as root, disk full on server R: the directory is a tmpfs, shrunk after a
  save (or at the start) to leave room for the other servers' files but not for
  R's; skipped without root.
- resume: a job is crashed (SIGKILL of a server after a save), then the same
  command with ``--resume`` gets the fault: SIGKILL or SIGTERM to a worker or a
  server as soon as its process exists (``spawned``), when the first server
  serves (``restoring``: the restore follows), after the workers resumed
  (``resumed``), or after the resumed job's first save (``saved``: a second crash
  after a resume); or a worker's exit(1) or exception before ``kvstore.create``
  or before ``init``.
- teardown: the job runs to its end; SIGKILL or SIGTERM to a worker after its
  last round (its digest line) or after its ``kv.close()``, or to a server after
  the workers' last round or once the launcher shuts the servers down; or a
  worker's exit(1) or exception after its last round, before ``kv.close()``.

A run passes when:

- the job with the fault ends within 10 s of it (15 s for a full disk: the
  failing save comes up to 5 steps later; SIGSTOP at start-up: 30 s, the
  heartbeat bound), non-zero, with the faulty process marked ``<- root cause`` (a
  full disk: with an error naming a server and "No space left"). At teardown a
  status of 0 passes too when every worker's digest is the uninterrupted run's
  (the fault came after the process's work was done);
- after a save or resume fault, the same command with ``--resume`` (as a user
  would run it; after a full disk, with the disk freed) either ends with status 0
  and every worker's digest equal to the uninterrupted run's (``resumed``), or
  ends non-zero with an error that says "cannot resume" and names a server and a
  file (``refused``), within 60 s. Status 0 with other weights is a wrong value;
- no process of any of its jobs is left, and no worker printed a wrong value or
  a digest other than the uninterrupted run's.

Correctness never depends on the checkpoint files' names: they only time the
mid-write kill (any new name that starts with ``server-R.ckpt`` or
``.server-R.ckpt`` and is not ``server-R.ckpt`` itself: a temporary or a part).
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import shutil
import subprocess
import tempfile
import time
import uuid
from typing import Any

from benchmarks.chaos.jobs import (DEFAULT_BOUND, ROOT, WRONG, Job, await_pid, ended, finish,
                                   job_env, launcher_argv, line_of, marked_root_cause, strike)

PHASES = ("startup", "save", "resume", "teardown")
FAULTS = {"startup": ("SIGKILL", "SIGTERM", "SIGSTOP", "exit", "raise"),
          "save": ("SIGKILL", "disk-full"),
          "resume": ("SIGKILL", "SIGTERM", "exit", "raise"),
          "teardown": ("SIGKILL", "SIGTERM", "exit", "raise")}
IN_PROCESS = ("exit", "raise")
STEPS, SAVE_EVERY, AUTO_SHARE = 30, 5, 1 / 3
SAVES = (STEPS - 1) // SAVE_EVERY           # explicit saves after steps 5, 10, ... 25
INTERVAL = "0.1"                            # seconds between automatic checkpoints
LAST_AUTO = STEPS - 12                      # automatic: the last step a fault waits for (a save should follow)
BALLAST_MB = 16.0                           # server R's: ~60 ms to write here, 17 MB on disk
CHUNK_BYTES = str(32 << 20)                 # above the ballast: it stays on one server
ROOM = 4 << 20                              # a full disk's free bytes: the others' parts fit, R's not
DISK = 256 << 20                            # the tmpfs before it is full, and after (for the resume)
# a process stopped before it registers is found at the registration deadline
# (KVSTORE_TIMEOUT), not by heartbeats: 20 s here (ENV's 60 s would make such runs slow)
KV_TIMEOUT = "20"
BOUND = {"SIGSTOP": 30.0, "disk-full": 15.0}
RESUME_BOUND = 60.0                         # seconds for a whole job started with --resume
START_TIMEOUT = 60.0                        # seconds for a job to reach the fault's moment
SCRIPT = os.path.join(ROOT, "benchmarks", "chaos", "train.py")


@dataclasses.dataclass(frozen=True)
class Case:
    """One run's choices. ``moment``: when the fault strikes (the module's docstring
    lists them by phase); ``at``: the save struck or after which the first job
    crashes (explicit saves), or the step (automatic ones; 0: at the start);
    ``save_every``: 0 for automatic checkpoints; ``big_rank``: the server with the
    ballast; ``crash_rank``: the server the resume phase's first crash kills."""
    phase: str
    fault: str
    role: str
    rank: int
    moment: str
    workers: int
    servers: int
    save_every: int
    big_rank: int
    at: int = 0
    crash_rank: int = 0


def pick(rng: random.Random, phase: str, disk_full: bool) -> Case:
    """A case of ``phase`` with every choice random (``disk_full``: whether that
    fault can be made here: root)."""
    workers, servers = rng.randint(1, 4), rng.randint(2, 3) if phase in ("save", "resume") else rng.randint(1, 3)
    save_every = 0 if rng.random() < AUTO_SHARE else SAVE_EVERY
    big_rank = rng.randrange(servers)
    fault = rng.choice([f for f in FAULTS[phase] if disk_full or f != "disk-full"])
    if fault in IN_PROCESS:
        role, rank = "worker", rng.randrange(workers)
    elif phase == "save":
        role = "server" if fault == "disk-full" else rng.choice(("server", "worker"))
        rank = big_rank if role == "server" else rng.randrange(workers)
    else:
        role = rng.choice(("worker", "server"))
        rank = rng.randrange(workers if role == "worker" else servers)
    moment = rng.choice(moments(phase, fault, role))
    if phase == "save" and fault == "disk-full":    # the disk fills after save K (0: at the start)
        at = rng.randint(0, SAVES - 1) if save_every else rng.randint(0, LAST_AUTO)
    elif phase == "save":                           # the kill strikes save K
        at = rng.randint(1, SAVES) if save_every else rng.randint(2, LAST_AUTO)
    else:                                           # the first job crashes after save K
        at = rng.randint(1, SAVES - 1) if save_every else rng.randint(8, LAST_AUTO)
    return Case(phase, fault, role, rank, moment, workers, servers, save_every, big_rank, at,
                crash_rank=rng.randrange(servers))


def moments(phase: str, fault: str, role: str) -> tuple[str, ...]:
    """When a fault of ``phase`` may strike."""
    if fault in IN_PROCESS:
        return ("teardown",) if phase == "teardown" else ("create", "init")
    if phase == "startup":
        return ("spawned", "registered")
    if phase == "save":
        return ("disk full",) if fault == "disk-full" else ("mid-write",)
    if phase == "resume":
        return ("spawned", "restoring", "resumed", "saved")
    return ("last round", "closed") if role == "worker" else ("last round", "shutdown")


class References:
    """The digests of uninterrupted runs, by number of workers (they do not depend
    on the servers or the checkpoints: benchmarks/chaos/train.py), each computed
    once by a job without faults."""

    def __init__(self):
        self._digests: dict[int, str] = {}

    def digest(self, workers: int) -> str:
        """The digest; RuntimeError if the uninterrupted job fails."""
        if workers not in self._digests:
            tag = uuid.uuid4().hex
            env = job_env(tag)
            script = [SCRIPT, "--servers", "1", "--ballast-mb", "0.01", "--steps", str(STEPS),
                      "--save-every", "0"]
            job = Job(launcher_argv(workers, 1, script, env), env)
            code = job.end(RESUME_BOUND)
            problems = finish([job], tag)
            got = set(digests(job).values())
            if code != 0 or len(got) != 1 or problems:
                raise RuntimeError(f"the uninterrupted run of {workers} workers failed (status {code}, "
                                   f"{problems}):\n{job.text[-3000:]}")
            self._digests[workers] = got.pop()
        return self._digests[workers]


def digests(job: Job) -> dict[int, str]:
    """The digests the job's workers printed, by rank."""
    return {int(m.group(1)): m.group(3) for m in
            re.finditer(r"^\[worker:(\d+)(@[^\]]*)?\] digest (\w+)$", job.text, re.M)}


def wrong_values(job: Job, want: str, what: str) -> list[str]:
    """The problems of a job (``what``) whose workers printed WRONG or a digest other
    than ``want``, the uninterrupted run's."""
    problems = [f"{what}: a worker saw a {WRONG}"] if "WRONG" in job.text else []
    other = {rank: d for rank, d in digests(job).items() if d != want}
    if other:
        problems.append(f"{what}: worker(s) {', '.join(map(str, sorted(other)))} ended with other "
                        f"weights than an uninterrupted run's ({WRONG}: {other[min(other)][:12]} "
                        f"instead of {want[:12]})")
    return problems


def refused_clearly(text: str) -> bool:
    """Whether a line says "cannot resume" and names a server and a file."""
    return any("cannot resume" in line and re.search(r"\bserver \d+", line)
               and re.search(r"\.ckpt|/\S+", line) for line in text.splitlines())


class Run:
    """One run: ``start`` a job of the case's command (plus ``--resume``), judge it
    (``failed_with_culprit``, ``resumes_right_or_refuses``), ``close`` it (leftovers,
    wrong values); ``record`` is the dict that goes to the JSON (``problems`` empty
    when the run passed), ``finished`` returns it and removes the checkpoints."""

    def __init__(self, case: Case, index: int, sshd, want: str):
        self.case, self.sshd, self.want = case, sshd, want
        self.record: dict[str, Any] = {"phase": case.phase, "run": index, "fault": case.fault,
                       "target": f"{case.role} {case.rank}", "moment": case.moment,
                       "workers": case.workers, "servers": case.servers,
                       "checkpoints": f"every {case.save_every} steps" if case.save_every else
                       f"every {INTERVAL} s", "ballast_on": f"server {case.big_rank}",
                       "at": case.at, "launcher": "ssh" if sshd else "local", "problems": []}
        self.problems: list[str] = self.record["problems"]
        self.directory = tempfile.mkdtemp(prefix="chaos-ckpt-")
        self.tails: list[str] = []

    def start(self, resume: bool = False, **fault_env: str) -> tuple[Job, str]:
        """A job of the case's command (plus ``--resume``); its tag."""
        c, tag = self.case, uuid.uuid4().hex
        extra = {"KVSTORE_CHECKPOINT_DIR": self.directory, "KVSTORE_CHUNK_BYTES": CHUNK_BYTES,
                 "KVSTORE_TIMEOUT": KV_TIMEOUT, **fault_env}
        if not c.save_every:
            extra["KVSTORE_CHECKPOINT_INTERVAL"] = INTERVAL
        env = job_env(tag, **extra)
        script = [SCRIPT, "--servers", str(c.servers), "--big-rank", str(c.big_rank), "--ballast-mb",
                  str(BALLAST_MB), "--steps", str(STEPS), "--save-every", str(c.save_every)]
        return Job(launcher_argv(c.workers, c.servers, script, env, self.sshd,
                                 ["--resume"] if resume else []), env), tag

    def close(self, job: Job, tag: str, what: str) -> None:
        """End ``job`` (``what`` it was) and note its leftovers and wrong values."""
        self.problems += [f"{what}: {p}" for p in finish([job], tag, self.sshd)]
        self.problems += wrong_values(job, self.want, what)
        self.tails.append(f"--- {what} (exit {job.proc.returncode})\n{job.text[-2500:]}")

    def failed_with_culprit(self, job: Job, fault_at: float, bound: float, role: str, rank: int,
                            what: str) -> int | None:
        """The job must end non-zero within ``bound`` of ``fault_at``, marking ``role``
        ``rank`` as the root cause; its status."""
        code, took, late = ended(job, fault_at, bound)
        self.record.setdefault("exits", []).append(code)
        self.record.setdefault("seconds", []).append(round(took, 2))
        self.problems += [f"{what}: {p}" for p in late]
        if code not in (None, 0) and not marked_root_cause(job, role, rank):
            self.problems.append(f"{what}: {role} {rank} is not marked as the root cause")
        return code

    def resumes_right_or_refuses(self) -> None:
        """The same command with --resume: status 0 and the uninterrupted run's
        weights, or a clear refusal."""
        job, tag = self.start(resume=True)
        try:
            code, took, late = ended(job, time.monotonic(), RESUME_BOUND, expect_failure=False)
            self.record.update(resume_exit=code, resume_seconds=round(took, 2))
            self.problems += [f"--resume: {p}" for p in late]
            got = digests(job)
            if code == 0 and sorted(got) == list(range(self.case.workers)) and set(got.values()) == {self.want}:
                self.record["resume"] = "resumed"
            elif code == 0 and set(got.values()) <= {self.want}:    # other weights: close() names them
                self.problems.append(f"--resume ended with status 0 but only workers {sorted(got)} printed "
                                     f"a digest ({WRONG})")
            elif code not in (None, 0) and refused_clearly(job.text):
                self.record["resume"] = "refused"
            elif code not in (None, 0):
                self.problems.append(f"--resume ended with status {code} without a clear refusal "
                                     "(\"cannot resume\", naming a server and a file)")
        finally:
            self.close(job, tag, "--resume")

    def finished(self) -> dict:
        """The record, with the jobs' output tails if the run failed."""
        shutil.rmtree(self.directory, ignore_errors=True)
        if self.problems:
            self.record["tail"] = "\n".join(self.tails)[-8000:]
        return self.record


def run_phase_case(case: Case, index: int, refs: References, sshd=None) -> dict:
    """Run ``case``; its record (``problems`` empty when it passed). With ``sshd``
    the jobs run through tracker.ssh."""
    try:
        want = refs.digest(case.workers)
    except RuntimeError as e:
        run = Run(case, index, sshd, "")
        run.problems.append(str(e))
        return run.finished()
    run = Run(case, index, sshd, want)
    try:
        {"startup": startup, "save": save, "resume": resume, "teardown": teardown}[case.phase](run)
    finally:
        record = run.finished()
    return record


def in_process(case: Case) -> dict[str, str]:
    """The environment of a worker's own exit or exception (benchmarks/chaos/train.py)."""
    if case.fault not in IN_PROCESS:
        return {}
    return {"CHAOS_FAULT": case.fault, "CHAOS_RANK": str(case.rank), "CHAOS_AT": case.moment}


def strike_at(run: Run, job: Job, tag: str, moment_pattern: str | None, gone_ok: bool = False) -> float | None:
    """Strike the case's target once ``moment_pattern`` shows in the job's output (a
    signal), or wait for its own fault's line (exit, exception); None for
    ``spawned`` means as soon as the process exists. The fault's time; None if the
    moment never came (the caller judges why). With ``gone_ok`` a target that has
    already ended is noted in the record, not as a problem (at teardown)."""
    c = run.case
    found: re.Match[str] | int | None
    if c.fault in IN_PROCESS:
        found = job.wait_for(line_of("worker", c.rank) + r".*chaos: ", START_TIMEOUT)
    elif c.moment == "spawned":
        found = await_pid(job, tag, c.role, c.rank, START_TIMEOUT)
    else:
        assert moment_pattern is not None, f"no pattern for the moment {c.moment!r}"
        found = job.wait_for(moment_pattern, START_TIMEOUT)
    if found is None:
        return None
    fault_at = time.monotonic()
    if c.fault not in IN_PROCESS:
        gone = strike(tag, c.role, c.rank, c.fault)
        if gone and gone_ok:
            run.record["target_gone"] = gone
        elif gone:
            run.problems.append(gone)
    return fault_at


def startup(run: Run) -> None:
    c = run.case
    job, tag = run.start(resume=False, **in_process(c))
    try:
        registered = (line_of("server", c.rank) + r".*serving on" if c.role == "server"
                      else line_of("worker", c.rank) + r"resumed (True|False) at step")
        fault_at = strike_at(run, job, tag, registered)
        if fault_at is None:
            run.problems.append(f"the job did not reach the fault's moment ({c.moment})")
        else:
            run.failed_with_culprit(job, fault_at, BOUND.get(c.fault, DEFAULT_BOUND), c.role, c.rank,
                                    "the job")
    finally:
        run.close(job, tag, "the job")


def save(run: Run) -> None:
    c = run.case
    mounted = c.fault == "disk-full" and mount_tmpfs(run.directory, DISK)
    try:
        job, tag = run.start()
        try:
            fault_at = fill_disk(run, job) if c.fault == "disk-full" else kill_mid_write(run, job, tag)
            if fault_at is not None and c.fault == "disk-full":
                # no save may come after the disk filled (automatic ones near the end):
                # then the job ends 0, and must have the right weights
                code, took, late = ended(job, fault_at, BOUND["disk-full"], expect_failure=False)
                run.record.update(exits=[code], seconds=[round(took, 2)])
                run.problems += [f"the job: {p}" for p in late]
                full = re.search(r"server (\d+)\b[^\n]*No space left", job.text)
                run.record["full"] = f"server {full.group(1)}" if full else None
                if code == 0:
                    missed(run, job, "no save came after the disk filled")
                elif code is not None and full is None:
                    run.problems.append("the job: no error names a server whose disk is full")
            elif fault_at is not None:
                run.failed_with_culprit(job, fault_at, DEFAULT_BOUND, c.role, c.rank, "the job")
                run.record["left_in_directory"] = sorted(writing(run.directory, c.big_rank))
        finally:
            run.close(job, tag, "the job")
        if mounted:
            resize_tmpfs(run.directory, DISK)        # the user frees the disk, then resumes
        run.resumes_right_or_refuses()
    finally:
        if mounted:
            subprocess.run(["umount", run.directory], check=False, capture_output=True)


def fill_disk(run: Run, job: Job) -> float | None:
    """Leave ROOM bytes free in the checkpoint tmpfs after the case's save (explicit
    saves: worker 0's ``saved K``; at the start for K = 0) or step (automatic); the
    time; None (a problem noted) if the job never got there."""
    c = run.case
    # K = 0: once the workers run (their first line), so that the bound counts from
    # there and not from the launcher's start
    pattern = (r"resumed False at step 0$" if not c.at else
               rf"saved {c.at}$" if c.save_every else rf"step {c.at} ok$")
    if job.wait_for(line_of("worker", 0) + pattern, START_TIMEOUT) is None:
        run.problems.append(f"the job did not reach the fault's moment ({pattern})")
        return None
    stat = os.statvfs(run.directory)
    used = (stat.f_blocks - stat.f_bfree) * stat.f_frsize
    resize_tmpfs(run.directory, used + ROOM)
    run.record["disk_bytes"] = used + ROOM
    return time.monotonic()


def kill_mid_write(run: Run, job: Job, tag: str) -> float | None:
    """SIGKILL the target once server R has started writing its part of the case's
    save; the time, and in the record what showed it; None (a problem noted) if no
    save came."""
    c = run.case
    me = line_of("worker", 0)
    if c.save_every:
        # names of earlier saves are no sign of this one: list them once the last ended
        if c.at > 1 and job.wait_for(me + rf"saved {c.at - 1}$", START_TIMEOUT) is None:
            run.problems.append(f"the job did not reach save {c.at - 1}")
            return None
        # (from the line after the last save's end: a fast job may print this save's start
        # before the line count is read here)
        before, since = writing(run.directory, c.big_rank), job.after(me + rf"saved {c.at - 1}$") if c.at > 1 else 0
        if job.wait_for(me + rf"saving {c.at}$", START_TIMEOUT, since) is None:
            run.problems.append(f"the job did not reach save {c.at}")
            return None
        since = job.count    # a server's log line about the save before comes before this
    else:
        if job.wait_for(me + rf"step {c.at} ok$", START_TIMEOUT) is None:
            run.problems.append(f"the job did not reach step {c.at}")
            return None
        before, since = writing(run.directory, c.big_rank), job.count
    shown = await_writing(job, run.directory, c.big_rank, before, since, START_TIMEOUT)
    if shown is None and job.end(0) == 0:
        missed(run, job, "the job ended before another save (automatic checkpoints)")
        return None
    if shown is None:
        run.problems.append(f"server {c.big_rank} wrote no checkpoint (no file, no log line)")
        return None
    fault_at = time.monotonic()
    gone = strike(tag, c.role, c.rank, "SIGKILL")
    if gone:
        run.problems.append(gone)
    run.record["struck_on"] = shown
    return fault_at


def missed(run: Run, job: Job, why: str) -> None:
    """Note a fault that never came because the job ended (status 0) first; every
    worker must then have printed the uninterrupted run's digest (``close``
    checks that any printed one is)."""
    run.record["fault_missed"] = why
    if sorted(digests(job)) != list(range(run.case.workers)):
        run.problems.append(f"the job ended with status 0 but not every worker printed its digest ({WRONG})")


def writing(directory: str, rank: int) -> set[str]:
    """Names in ``directory`` of server ``rank``'s checkpoint files other than the
    committed one (``server-R.ckpt``): temporaries and parts."""
    mine = re.compile(rf"^\.?server-{rank}\.ckpt.")
    try:
        return {name for name in os.listdir(directory) if mine.match(name)}
    except OSError:
        return set()


def await_writing(job: Job, directory: str, rank: int, before: set[str], since: int,
                  timeout: float) -> str | None:
    """What showed that server ``rank`` writes a checkpoint: a new name (not in
    ``before``) of its files, or else a line of its log about a checkpoint (from
    output line ``since`` on); None if the job ended or ``timeout`` passed first.
    Polled: a file's creation sends no event we could wait on without inotify."""
    logged = line_of("server", rank) + r".*checkpoint"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and job.proc.poll() is None:
        new = writing(directory, rank) - before
        if new:
            return f"file {min(new)}"
        if job.search(logged, since):
            return "log line"
        time.sleep(0.001)
    return None


def resume(run: Run) -> None:
    c = run.case
    # the first job: crashed after a save, so that there is something to resume from
    job, tag = run.start()
    try:
        pattern = rf"saved {c.at}$" if c.save_every else rf"step {c.at} ok$"
        if job.wait_for(line_of("worker", 0) + pattern, START_TIMEOUT) is None:
            run.problems.append(f"the first job did not reach its crash ({pattern})")
            return
        crash_at = time.monotonic()
        gone = strike(tag, "server", c.crash_rank, "SIGKILL")
        if gone:
            run.problems.append(f"the first job: {gone}")
        run.failed_with_culprit(job, crash_at, DEFAULT_BOUND, "server", c.crash_rank, "the first job")
    finally:
        run.close(job, tag, "the first job")
    # the resumed job, with the fault
    job, tag = run.start(resume=True, **in_process(c))
    try:
        moment_pattern = {
            "restoring": line_of("server", r"\d+") + r".*serving on",
            "resumed": line_of("worker", 0) + r"resumed True at step",
            "saved": (line_of("worker", 0) + r"saved \d+$" if c.save_every
                      else line_of("server", r"\d+") + r".*checkpoint.*(written|committed)")}.get(c.moment)
        fault_at = strike_at(run, job, tag, moment_pattern)
        status = job.end(0) if fault_at is None else None
        if status == 0:
            missed(run, job, "the resumed job ended before the fault's moment")
        elif status is not None and refused_clearly(job.text):   # nothing to resume from
            run.record["fault_missed"] = "the resumed job refused to resume before the fault's moment"
        elif fault_at is None:
            run.problems.append(f"the resumed job did not reach the fault's moment ({c.moment})")
        else:
            run.failed_with_culprit(job, fault_at, DEFAULT_BOUND, c.role, c.rank, "the resumed job")
    finally:
        run.close(job, tag, "the resumed job")
    run.resumes_right_or_refuses()


def teardown(run: Run) -> None:
    c = run.case
    job, tag = run.start(resume=False, **in_process(c))
    try:
        pattern = {"last round": line_of("worker", c.rank if c.role == "worker" else 0) + r"digest ",
                   "closed": line_of("worker", c.rank) + r"closed$",
                   "shutdown": r"shutting down the servers"}.get(c.moment)
        fault_at = strike_at(run, job, tag, pattern, gone_ok=True)
        if fault_at is None:
            run.problems.append(f"the job did not reach the fault's moment ({c.moment})")
            return
        code, took, late = ended(job, fault_at, DEFAULT_BOUND, expect_failure=False)
        run.record.update(exits=[code], seconds=[round(took, 2)])
        run.problems += [f"the job: {p}" for p in late]
        if code == 0:
            missed(run, job, "the job ended with status 0: the fault came after the target's work")
        elif code is not None and not marked_root_cause(job, c.role, c.rank):
            run.problems.append(f"the job: {c.role} {c.rank} is not marked as the root cause")
    finally:
        run.close(job, tag, "the job")


def mount_tmpfs(path: str, size: int) -> bool:
    """Mount a tmpfs of ``size`` bytes on ``path`` (needs root); True."""
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "chaos-checkpoints", path],
                   check=True, capture_output=True)
    return True


def resize_tmpfs(path: str, size: int) -> None:
    """Give the tmpfs on ``path`` ``size`` bytes (at least what it holds)."""
    subprocess.run(["mount", "-o", f"remount,size={size}", path], check=True, capture_output=True)


def can_fill_disks() -> bool:
    """Whether disk-full faults can be made here: root, with mount."""
    return os.geteuid() == 0 and shutil.which("mount") is not None
