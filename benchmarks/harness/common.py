"""What every contender shares: the values pushed, the check of the summed result,
timing statistics and the result-file format. numpy and the standard library only,
so the peers' virtual environments (MXNet, Ray) import it too.

Values: worker ``r`` pushes, for tensor ``k`` in iteration ``i``, a tensor filled
with ``(r + 1) + (k % 3) + (i % 4)``. Those are small integers, exact in fp32, so
the sum over workers is known exactly; it changes from one iteration to the next,
so a stale result (a previous round, or an output that was never written) fails.
"""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import statistics
import subprocess
import time

import numpy as np


class WrongResult(AssertionError):
    """A contender returned a sum that is not the expected one: the run fails."""


def grad_value(rank: int, key: int, it: int) -> float:
    return float((rank + 1) + (key % 3) + (it % 4))


def expected_sum(num_workers: int, key: int, it: int) -> float:
    return float(num_workers * (num_workers + 1) // 2 + num_workers * ((key % 3) + (it % 4)))


def fill_grads(arrays, rank: int, it: int) -> None:
    """Fill each (numpy-like, writable) array with this worker's value."""
    for k, a in enumerate(arrays):
        a.fill(grad_value(rank, k, it))


def verify(arrays, num_workers: int, it: int, what: str = "result", expected=expected_sum) -> None:
    """Check that ``arrays`` hold the sum over workers of iteration ``it``: the
    first, middle and last element of every tensor and the total sum (float64).
    ``expected(num_workers, key, it)`` is the value every element must have.
    Raises :class:`WrongResult` naming the first wrong tensor."""
    total = want_total = 0.0
    for k, a in enumerate(arrays):
        flat = np.asarray(a).reshape(-1)
        want = expected(num_workers, k, it)
        n = flat.size
        for idx in {0, n // 2, n - 1} if n else ():
            if flat[idx] != want:
                raise WrongResult(f"{what}: iteration {it}, tensor {k} (size {n}) element {idx} "
                                  f"is {flat[idx]!r}, expected {want!r}")
        total += float(flat.sum(dtype=np.float64))
        want_total += want * n
    if total != want_total:
        raise WrongResult(f"{what}: iteration {it}: total sum {total!r}, expected {want_total!r}")


def stats(samples) -> dict:
    """Median and spread of a list of seconds (or any numbers)."""
    xs = sorted(samples)
    if not xs:
        return {"n": 0}
    q = statistics.quantiles(xs, n=10, method="inclusive") if len(xs) > 1 else [xs[0]] * 9
    return {"n": len(xs), "median": statistics.median(xs), "p10": q[0], "p90": q[-1],
            "min": xs[0], "max": xs[-1], "mean": statistics.fmean(xs)}


class Usage:
    """CPU time and page faults of this process over a region (getrusage)."""

    def __init__(self):
        self.start = resource.getrusage(resource.RUSAGE_SELF)

    def since(self) -> dict:
        now = resource.getrusage(resource.RUSAGE_SELF)
        return {"cpu_s": (now.ru_utime - self.start.ru_utime) + (now.ru_stime - self.start.ru_stime),
                "user_s": now.ru_utime - self.start.ru_utime,
                "sys_s": now.ru_stime - self.start.ru_stime,
                "minor_faults": now.ru_minflt - self.start.ru_minflt,
                "major_faults": now.ru_majflt - self.start.ru_majflt,
                "vol_ctx_switches": now.ru_nvcsw - self.start.ru_nvcsw,
                "invol_ctx_switches": now.ru_nivcsw - self.start.ru_nivcsw,
                "max_rss_mb": now.ru_maxrss / 1024}        # the process's peak (Linux: KiB)


def timed_loop(step, prepare, check, iters: int, warmup: int, sync=None,
               profiler=None) -> tuple[list, dict]:
    """Run ``warmup + iters`` iterations: ``prepare(i)`` and ``sync()`` untimed, then
    ``step(i)`` timed, then ``check(i)`` untimed. Returns (timed seconds, usage of
    the timed steps per iteration). A ``profiler`` (cProfile) runs during the timed
    steps only."""
    times, cpu, faults = [], 0.0, 0
    for i in range(warmup + iters):
        prepare(i)
        if sync is not None:
            sync()
        u = Usage()
        timed = profiler is not None and i >= warmup
        if timed:
            profiler.enable()
        t0 = time.perf_counter()
        step(i)
        t1 = time.perf_counter()
        if timed:
            profiler.disable()
        used = u.since()
        check(i)
        if i >= warmup:
            times.append(t1 - t0)
            cpu += used["cpu_s"]
            faults += used["minor_faults"]
    per = {"cpu_s": cpu / max(1, iters), "minor_faults": faults / max(1, iters)}
    return times, per


def write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def write_results(out_dir: str, name: str, text: str, data: dict) -> None:
    """``<name>.md`` (``text``) and ``<name>.json`` (``data``) in ``out_dir``; prints
    the markdown and both paths."""
    import click   # here: the peers' virtual environments import this module without click
    paths = {"md": os.path.join(out_dir, f"{name}.md"), "json": os.path.join(out_dir, f"{name}.json")}
    with open(paths["md"], "w") as f:
        f.write(text)
    write_json(paths["json"], data)
    click.echo(text)
    for kind, path in paths.items():
        click.echo(f"{kind}: {os.path.relpath(path)}")


def machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "processor": platform.processor()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["mem_total"] = f.readline().split(":", 1)[1].strip()
    except OSError:
        pass
    return info


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(REPO, "benchmarks", "results")   # the runs of record (--record, output.py)


def kvstore_version() -> str:
    """``kvstore <commit>``, plus a mark when kvstore/ or tracker/ have uncommitted
    changes (so a result says which code produced it)."""
    try:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "kvstore", "tracker"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", ""
    return f"kvstore {commit or '?'}{' + uncommitted changes' if dirty else ''}"


_SS_FIELD = re.compile(r"\b(bytes_sent|bytes_received):(\d+)")


def tcp_bytes(pid: int) -> int:
    """TCP payload bytes sent plus received so far by every socket of ``pid`` (``ss``)."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=30, check=True).stdout
    total, mine = 0, False
    for line in out.splitlines():
        if not line.startswith(("\t", " ")):        # a socket's line; its details follow
            mine = f"pid={pid}," in line
        elif mine:
            total += sum(int(v) for _, v in _SS_FIELD.findall(line))
    return total
