"""The chaos runner's handle on jobs: start one through a launcher, read its output
as it comes, find its processes, strike one, and make sure nothing of it is left.

Every process of a job carries ``CHAOS_TAG=<tag>`` in its environment (the
launchers pass it on, over ssh too): that is how the runner finds a process by
role and rank, and the processes that outlived their job. benchmarks/chaos/run.py
(faults mid-run) and benchmarks/chaos/phases.py (faults in the other phases of a
job's life) share it.

Example::

    tag = uuid.uuid4().hex
    argv = launcher_argv(2, 2, [sys.executable, "benchmarks/chaos/worker.py"], env, sshd=None)
    job = Job(argv, {**os.environ, **ENV, "CHAOS_TAG": tag})
    job.wait_for(r"\\[worker:0\\] round 3 ok", 60)
    os.kill(pid_of(tag, "server", 1), signal.SIGKILL)
    problems = finish([job], tag, sshd=None)
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {"KVSTORE_HEARTBEAT_INTERVAL": "0.5", "KVSTORE_HEARTBEAT_TIMEOUT": "10",
       "KVSTORE_ABORT_GRACE": "3", "KVSTORE_TIMEOUT": "60", "PYTHONUNBUFFERED": "1"}
DEFAULT_BOUND = 10.0   # seconds from a fault to the job's end (signals, exits, exceptions)
TERMINATE_GRACE = 10.0  # seconds a launcher that overran its bound gets to end after SIGTERM

# What a run's problems say, by kind: the tables count each kind. Every problem
# text the runner writes contains exactly one of these phrases or none (other).
WRONG, LEFT, LATE = "wrong value", "left behind", "not ended in bound"


def kind_of(problem: str) -> str:
    """``wrong``, ``leftover``, ``late`` or ``other``: which count a problem goes to."""
    for phrase, kind in ((WRONG, "wrong"), (LEFT, "leftover"), (LATE, "late")):
        if phrase in problem:
            return kind
    return "other"


def tagged(tag: str) -> list[int]:
    """Live processes whose environment carries CHAOS_TAG=tag."""
    needle, found = f"CHAOS_TAG={tag}".encode(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        found.append(int(pid))
    return found


class Job:
    """One launcher process; its output is collected by a thread."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None   # stdout=PIPE
        for line in self.proc.stdout:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def wait_for(self, pattern: str, timeout: float, since: int = 0) -> re.Match | None:
        """The first line (from line ``since`` on) matching ``pattern``; None if the
        job ended, or ``timeout`` passed, without one."""
        deadline, regex, seen = time.monotonic() + timeout, re.compile(pattern), since
        with self.changed:
            while True:
                for line in self.lines[seen:]:
                    m = regex.search(line)
                    if m:
                        return m
                seen = max(seen, len(self.lines))
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and seen == len(self.lines)):
                    return None
                self.changed.wait(min(left, 0.5))

    def wait_count(self, pattern: str, count: int, timeout: float) -> bool:
        """Whether ``count`` lines matching ``pattern`` came within ``timeout`` (False:
        the job ended, or the time passed, with fewer)."""
        deadline, regex = time.monotonic() + timeout, re.compile(pattern)
        with self.changed:
            while True:
                if sum(1 for line in self.lines if regex.search(line)) >= count:
                    return True
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    return False
                self.changed.wait(min(left, 0.5))

    def search(self, pattern: str, since: int = 0) -> re.Match | None:
        """The first line so far (from line ``since`` on) matching ``pattern``."""
        regex = re.compile(pattern)
        with self.changed:
            lines = self.lines[since:]
        return next((m for m in map(regex.search, lines) if m), None)

    def after(self, pattern: str) -> int:
        """The number of the line after the last one so far matching ``pattern`` (0 if
        none): where to look for what followed it (``since`` of :meth:`wait_for`)."""
        regex = re.compile(pattern)
        with self.changed:
            return next((i + 1 for i in range(len(self.lines) - 1, -1, -1) if regex.search(self.lines[i])), 0)

    @property
    def count(self) -> int:
        """How many lines have come so far."""
        with self.changed:
            return len(self.lines)

    def end(self, timeout: float) -> int | None:
        """The launcher's exit status, or None if it still runs after ``timeout`` s."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    @property
    def text(self) -> str:
        with self.changed:
            return "".join(self.lines)


def line_of(role: str, rank: int | str) -> str:
    """A regex for the prefix of ``role`` ``rank``'s output lines (ssh adds ``@host``)."""
    return rf"\[{role}:{rank}(@[^\]]*)?\] "


def launcher_argv(workers: int, servers: int, script: list[str], env: dict[str, str], sshd=None,
                  flags: list[str] | tuple = ()) -> list[str]:
    """The launcher's argv for ``script`` (the worker's argv after the interpreter):
    ``tracker.local``, or ``tracker.ssh`` on 127.0.0.2 and 127.0.0.3 of ``sshd``
    (tests/services.py's loopback sshd), which passes the KVSTORE_* settings by
    itself and the CHAOS_* ones (and PYTHONPATH: the remote processes run this
    checkout, not another one installed) named with ``--env``. ``flags``: launcher options."""
    if sshd is None:
        return [sys.executable, "-m", "tracker.local", "-n", str(workers), "-s", str(servers), *flags,
                sys.executable, *script]
    passed = [arg for name in sorted(env) if name.startswith("CHAOS_") or name in ("PYTHONUNBUFFERED", "PYTHONPATH")
              for arg in ("--env", name)]
    hosts = sshd.hostfile("127.0.0.2:{port}", "127.0.0.3:{port}")
    return [sys.executable, "-m", "tracker.ssh", "-F", sshd.client_config, *passed,
            "-n", str(workers), "-s", str(servers), *flags, "-H", hosts, "python", *script]


def job_env(tag: str, **extra: str) -> dict[str, str]:
    """The environment of a chaos job: the runner's, ENV, the tag, the repository on
    PYTHONPATH, and ``extra``."""
    return {**os.environ, **ENV, "CHAOS_TAG": tag,
            "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p), **extra}


def pid_of(tag: str, role: str, rank: int | None) -> int | None:
    """The pid of this job's ``role`` ``rank`` (its environment says so; ``rank`` None:
    the one process of that role, the scheduler)."""
    want = {b"CHAOS_TAG=" + tag.encode(), b"KVSTORE_ROLE=" + role.encode()}
    if rank is not None:
        want.add(b"KVSTORE_RANK=" + str(rank).encode())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if want <= set(f.read().split(b"\0")):
                    return int(pid)
        except OSError:
            continue
    return None


def await_pid(job: Job, tag: str, role: str, rank: int, timeout: float) -> int | None:
    """The pid of ``role`` ``rank`` as soon as its process exists (polled: a process
    that another one starts sends us no event); None if the job ended first or
    ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and job.proc.poll() is None:
        pid = pid_of(tag, role, rank)
        if pid is not None:
            return pid
        time.sleep(0.002)
    return None


def strike(tag: str, role: str, rank: int, fault: str) -> str | None:
    """Send signal ``fault`` (``SIGKILL``...) to ``role`` ``rank``; the problem if there
    is no such process."""
    pid = pid_of(tag, role, rank)
    if pid is None:
        return f"no pid for {role} {rank}"
    try:
        os.kill(pid, getattr(signal, fault))
    except ProcessLookupError:
        return f"{role} {rank} (pid {pid}) was gone before the {fault}"
    return None


def marked_root_cause(job: Job, role: str, rank: int) -> bool:
    """Whether the launcher's final table marks ``role`` ``rank`` as the root cause."""
    return re.search(rf"^{role} {rank}\b.*<- root cause", job.text, re.M) is not None


def ended(job: Job, fault_at: float, bound: float, expect_failure: bool = True) -> tuple[int | None, float, list]:
    """Wait for the job's end, at most ``bound`` + 5 s from ``fault_at``: its status,
    the seconds from the fault, and the problems (not ended in bound; with
    ``expect_failure`` a status of 0)."""
    code = job.end(max(0.1, fault_at + bound + 5 - time.monotonic()))
    took = time.monotonic() - fault_at
    if code is None:
        return None, took, [f"the job did not end within {bound + 5:.0f} s of the fault ({LATE})"]
    if took > bound:
        return code, took, [f"the job ended {took:.1f} s after the fault, bound {bound:.0f} s ({LATE})"]
    if expect_failure and code == 0:
        return code, took, ["the job ended with status 0"]
    return code, took, []


def end_jobs(jobs: list, tag: str) -> list[str]:
    """Kill what is still running of ``jobs``; the problem (if any) of processes
    tagged ``tag`` that outlived them (those are killed too)."""
    for job in jobs:
        if job.proc.poll() is None:
            # as a user would stop it: the launcher then stops its processes; only
            # if it does not end, everything in its session is killed
            job.proc.terminate()
            if job.end(TERMINATE_GRACE) is None:
                os.killpg(job.proc.pid, signal.SIGKILL)
                job.proc.wait()
    left = leftovers(tag)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return [f"processes {LEFT}: {left}"] if left else []


def finish(jobs: list, tag: str, sshd=None) -> list[str]:
    """:func:`end_jobs`, and with ``sshd`` the problem of ssh sessions left open."""
    problems = end_jobs(jobs, tag)
    if sshd is not None:
        deadline = time.monotonic() + 5
        while sshd.sessions() and time.monotonic() < deadline:
            time.sleep(0.1)    # an ssh session's end sends no event we could wait on
        if sshd.sessions():
            problems.append(f"ssh sessions {LEFT}: {sshd.sessions()}")
    return problems


def leftovers(tag: str, grace: float = 5.0) -> list[int]:
    """Processes of the job still alive ``grace`` seconds after the launcher ended
    (polled: a process's end sends no event we could wait on from here)."""
    deadline = time.monotonic() + grace
    while True:
        left = tagged(tag)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)
