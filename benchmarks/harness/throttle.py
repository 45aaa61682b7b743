"""Slow one process from outside: a duty cycle of SIGSTOP and SIGCONT.

A straggler for benchmarks/straggler/run.py without changing the program it slows
(the examples) and without root or cgroups: the process is stopped for ``stop``
seconds, then runs for ``run`` seconds, over and over, so it gets at most
``run / (stop + run)`` of the wall time (like a CFS CPU quota, which also stops
the whole group for the rest of a period once its share is used). Stops are kept
short (100 ms by default), far below KVSTORE_HEARTBEAT_TIMEOUT, so the scheduler
never takes the stopped worker for dead.

The process is found in /proc by its environment (e.g. KVSTORE_ROLE=worker,
KVSTORE_RANK=3 and a token only this job has, so another job's worker 3 on the
same machine is never touched) and signalled through a pidfd, so a pid reused
after the process ended is never signalled. Linux only.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time


class ThrottleError(RuntimeError):
    pass


def _environ(pid: str) -> dict:
    with open(f"/proc/{pid}/environ", "rb") as f:
        raw = f.read()
    pairs = (item.partition(b"=") for item in raw.split(b"\0") if item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, _, v in pairs}


def matching(env: dict) -> list[int]:
    """Pids of the live processes whose environment holds every pair of ``env``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            have = _environ(entry)
        except OSError:           # ended meanwhile, or not ours to read
            continue
        if all(have.get(k) == v for k, v in env.items()):
            found.append(int(entry))
    return found


def open_process(env: dict, deadline: float, done: threading.Event) -> int | None:
    """A pidfd of the one process whose environment holds ``env``, once it exists
    (polled until ``deadline``, a time.monotonic(); None if ``done`` is set first).
    Raises ThrottleError when none appears in time or when several match."""
    while not done.is_set():
        pids = matching(env)
        if len(pids) > 1:
            raise ThrottleError(f"{len(pids)} processes ({', '.join(map(str, pids))}) have {env}: "
                                "which one to slow is ambiguous")
        if pids:
            try:
                fd = os.pidfd_open(pids[0])
            except ProcessLookupError:
                continue
            try:   # the pid may have been reused between the scan and the open
                if all(_environ(str(pids[0])).get(k) == v for k, v in env.items()):
                    return fd
            except OSError:
                pass
            os.close(fd)
            continue
        if time.monotonic() > deadline:
            raise ThrottleError(f"no process with {env} appeared in time")
        done.wait(0.05)   # polling /proc for a process that is being started
    return None


class DutyCycle:
    """A thread that stops the process with ``env`` for ``stop`` s, lets it run for
    ``run`` s, and so on, from when it appears until it ends or :meth:`finish`.

    ``stops`` and ``stopped_s`` count what was done; ``active_s`` is the time from
    the first stop to the last resume; ``error`` is the exception that ended the
    thread early (None when it did its job), for the caller to raise."""

    def __init__(self, env: dict, stop: float, run: float, find_timeout: float):
        if stop <= 0 or run <= 0:
            raise ValueError(f"stop ({stop}) and run ({run}) must be positive")
        self.env, self.stop, self.run = dict(env), stop, run
        self.stops, self.stopped_s, self.active_s = 0, 0.0, 0.0
        self.error: BaseException | None = None
        self._deadline = time.monotonic() + find_timeout
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True, name="throttle")

    def start(self) -> DutyCycle:
        self._thread.start()
        return self

    def finish(self) -> dict:
        """Stop throttling (the process is resumed) and return what was done."""
        self._done.set()
        self._thread.join()
        return {"stop_s": self.stop, "run_s": self.run, "stops": self.stops,
                "stopped_s": self.stopped_s, "active_s": self.active_s,
                "stopped_fraction": self.stopped_s / self.active_s if self.active_s else 0.0}

    def _main(self) -> None:
        try:
            fd = open_process(self.env, self._deadline, self._done)
        except BaseException as e:   # handed to the caller by finish()
            self.error = e
            return
        if fd is None:
            return
        try:
            self._cycle(fd)
        except BaseException as e:
            self.error = e
        finally:
            try:   # never leave it stopped
                signal.pidfd_send_signal(fd, signal.SIGCONT)
            except ProcessLookupError:
                pass
            os.close(fd)

    def _cycle(self, fd: int) -> None:
        first = None
        while not self._done.is_set():
            if select.select([fd], [], [], 0)[0]:   # a pidfd is readable once the process ended
                return
            try:
                signal.pidfd_send_signal(fd, signal.SIGSTOP)
            except ProcessLookupError:   # it ended: done
                return
            t0 = time.monotonic()
            first = t0 if first is None else first
            self._done.wait(self.stop)
            try:
                signal.pidfd_send_signal(fd, signal.SIGCONT)
            except ProcessLookupError:
                return
            finally:
                t1 = time.monotonic()
                self.stops += 1
                self.stopped_s += t1 - t0
                self.active_s = t1 - first
            self._done.wait(self.run)
