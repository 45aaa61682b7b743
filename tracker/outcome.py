"""How a job ended: its exit status, the root cause and a per-process table.

:func:`tracker.launcher.launch` collects what every process did; :func:`conclude`
decides who caused a failure (the first process to fail, or the node a failure
the scheduler found is about, or a worker that report blames) and :func:`report`
prints it, as torchrun's ChildFailedError does.
"""

from __future__ import annotations

import re
import signal
import sys
from dataclasses import dataclass
from typing import IO

from .control import disagreement
from .control.records import absent_at_barrier, absent_at_registration, describe_exit

# how the scheduler names a node in its messages: "worker 1 (pid 4242 on node2)"
_NODE_NAME = re.compile(r"\b(worker|server) (\d+) \(pid \d+ on ")
_WORKER = re.compile(r"\bworker (\d+)\b")


def plural(count: int, word: str, many: str | None = None) -> str:
    """'1 server', '2 servers' ('1 process', '2 processes' with ``many``)."""
    return f"{count} {word if count == 1 else (many or word + 's')}"


@dataclass
class Outcome:
    """How a job ended: the exit status to return and a per-process table."""
    returncode: int
    root_cause: str | None
    rows: list[tuple]  # label, pid, code (int, None, or a status text), note[, host]
    num_workers: int = 0
    num_servers: int = 0
    elapsed: float = 0.0

    def table(self) -> str:
        hosts = any(len(row) > 4 for row in self.rows)
        width = max([len(row[4]) for row in self.rows if len(row) > 4] + [4])
        head = f"{'host':<{width}}  " if hosts else ""
        lines = [f"{'process':<12} {'pid':>8}  {head}status"]
        for label, pid, code, note, *host in self.rows:
            if isinstance(code, str):
                status = code
            else:
                status = "running (killed by launcher)" if code is None else describe_exit(code)
            where = f"{(host or [''])[0]:<{width}}  " if hosts else ""
            pid = "-" if pid is None else pid
            lines.append(f"{label:<12} {pid:>8}  {where}{status}{'  <- ' + note if note else ''}")
        return "\n".join(lines)

    def summary(self) -> str:
        """The one line a successful job ends with."""
        return (f"job finished: {plural(self.num_workers, 'worker')}, "
                f"{plural(self.num_servers, 'server')}, {self.elapsed:.1f} s, "
                f"exit {self.returncode}")


def named_nodes(text: str | None) -> list[str]:
    """The nodes a failure the scheduler found names: first the node it is about
    (the one that reported it, went silent, ...), then the workers its message
    mentions after that, the deepest cause last (``worker 2 (...) failed: push of
    key 0: server 0 rejected the request: ...: worker 1 closed its store``: worker
    2, then worker 1). Servers mentioned inside a report only passed an error on."""
    text = text or ""
    first = _NODE_NAME.search(text)
    if first is None:
        return []
    found = [f"{first[1]} {first[2]}"]
    for m in _WORKER.finditer(text, first.end()):
        label = f"worker {m[1]}"
        if label in found[1:]:
            found.remove(label)
        if label != found[0]:
            found.append(label)
    return found


def _culprits(failure: str | None, codes: dict, labels: set) -> tuple[list[str], str]:
    """Who caused a failure the scheduler found: (labels, how they were found:
    ``named`` a process the report mentions, ``disagreed`` the worker a
    disagreement at a collective call blames (:mod:`tracker.control.disagreement`),
    ``absent`` the workers a barrier timeout names, ``about`` the node the failure
    is about). A worker the
    report blames (``barrier cannot complete: worker 1 (...) already finished``,
    ``worker 1 closed its store while ...``) that ended with a non-zero status by
    itself is the real cause, the report only its consequence; the deepest
    such mention wins; before that, the workers a barrier that timed out waited
    for (the waiter that reported it only noticed), and before that any process
    the report mentions that died by a signal on its own. Otherwise the node the
    failure is about."""
    # a process that died by a signal on its own (SIGKILL from outside, the OOM
    # killer) and that the report mentions (a worker's "data channel to server 0
    # broke") is the cause, whoever noticed first
    for label in sorted(labels):
        if (codes.get(label) or 0) < 0 and re.search(rf"\b{label}\b", failure or ""):
            return [label], "named"
    # workers that disagreed at a collective call all fail at once, each reporting the
    # same error: the worker it blames (the same every run), whoever reported first
    odd = [label for label in disagreement.blamed(failure) if label in labels]
    if odd:
        return odd, "disagreed"
    absent = [label for label in absent_at_barrier(failure) if label in labels]
    if absent:
        return absent, "absent"
    # a process that never registered (e.g. stopped before it could): the rest only waited
    unregistered = [label for label in absent_at_registration(failure) if label in labels]
    if unregistered:
        return unregistered, "unregistered"
    named = [label for label in named_nodes(failure) if label in labels]
    for label in reversed(named[1:]):
        if codes.get(label):
            return [label], "named"
    return named[:1], "about"


def _describe(child, code, exception: bool = False) -> str:
    """``worker 1 on h exited with status 1 (detail)``; with ``exception`` (a failure
    the scheduler did not hear of, e.g. before the process registered) followed by
    the last exception its output showed (``: ValueError: ...``)."""
    label = child.spec.label
    text = f"{label} {describe_exit(code)}"
    if getattr(child, "host", None):
        text = f"{label} on {child.host} {describe_exit(code)}"
    if getattr(child, "detail", None):
        text += f" ({child.detail})"
    if exception and code and getattr(child, "exception", None):
        text += f": {child.exception}"
    return text


def _first_of_twins(children, first, code: int) -> str:
    """The label of the root cause among processes that failed alike: ``first``
    failed first as the launcher saw it, but processes of its role that ended by
    themselves with its status and the same last exception (every worker's
    ``create()`` refusing the store type) failed in a race the launcher's polling
    decides; the first of them in launch order is reported, the same every run."""
    exception = getattr(first, "exception", None)
    if not exception:
        return first.spec.label
    for child in children:
        if child.spec.role == first.spec.role and getattr(child, "exception", None) == exception \
                and child.poll() == code:
            return child.spec.label
    return first.spec.label


def _status(code: int) -> int:
    return 128 - code if code < 0 else code


def conclude(children, codes, first_failure, interrupted, scheduler_failure, late=()) -> Outcome:
    """The job's :class:`Outcome`. ``late``: (label, status) of elastic workers that
    failed after they finished (called close()): the job went on without them, and
    the first is its root cause unless something else failed."""
    root = None
    culprits: list[str] = []
    returncode = 0
    by_label = {c.spec.label: c for c in children}
    if first_failure is not None:
        label, code = first_failure
        if label == "scheduler":
            culprits, found = _culprits(scheduler_failure, codes, set(by_label))
            if found == "named":
                code = codes[culprits[0]]
                root = f"{_describe(by_label[culprits[0]], code)}; the scheduler reported: {scheduler_failure}"
                returncode = _status(code)
            elif found == "disagreed":
                root = (f"{culprits[0]} differs from the other workers at a collective call; "
                        f"the scheduler reported: {scheduler_failure}")
                returncode = 1
            elif found in ("absent", "unregistered"):
                what = "arrive at a barrier" if found == "absent" else "register with the scheduler"
                root = (f"{' and '.join(culprits)} did not {what} in time; "
                        f"the scheduler reported: {scheduler_failure}")
                returncode = 1
            else:
                root = f"the scheduler aborted the job: {scheduler_failure}"
                returncode = 1
        elif getattr(by_label[label], "blame", None):   # the command meant to start it failed
            root = by_label[label].blame
            returncode = _status(code)
        else:
            label = _first_of_twins(children, by_label[label], code)
            culprits = [label]
            root = _describe(by_label[label], code, exception=True)
            returncode = _status(code)
    elif interrupted is not None:
        root = f"the launcher was interrupted by {signal.Signals(interrupted).name}"
        returncode = 128 + interrupted
    elif late:
        label, code = late[0]
        culprits = [label]
        root = (f"{_describe(by_label[label], code, exception=True)} after it finished its part (called "
                "close()); the elastic job went on without it")
        returncode = _status(code)
    rows = []
    for child in children:
        label = child.spec.label
        code = codes[label] if label in codes else child.poll()
        if getattr(child, "blame", None):
            code = f"not started ({child.blame.split(' ', 1)[0]} failed)"
        note = ""
        if label in culprits:
            note = "root cause"
            if label not in codes:   # it failed, then the teardown ended it: say the former
                code = "failed (see above), then stopped by the launcher"
        rows.append(row(child, code, note))
    return Outcome(returncode, root, rows)


def row(child, code, note) -> tuple:
    host = getattr(child, "host", None)
    row = (child.spec.label, child.pid, code, note)
    return row if host is None else (*row, host)


def report(outcome: Outcome, stream: IO[str] = sys.stderr) -> None:
    """Print one summary line for a successful job; else the root cause and the
    per-process table. Output that cannot be written (a closed terminal) is dropped."""
    if outcome.root_cause is None and outcome.returncode == 0:
        text = outcome.summary() + "\n"
    else:
        text = f"\njob failed: {outcome.root_cause}\n{outcome.table()}\n"
    try:
        stream.write(text)
        stream.flush()
    except (OSError, ValueError):
        pass
