"""A job-wide checkpoint as both ends see it: the servers' file names, one entry of
a server's inventory (and its wire form), the job id check, and the choice of the
set a resume restores.

The servers write and read the files (:mod:`kvstore.server.checkpoint`, which
explains the two phases of a save); the leading worker gathers every server's
inventory and chooses one complete set (:func:`choose`) for all
(:mod:`kvstore.worker.checkpoints`). Both import this module and neither imports
the other (tests/project/test_layering.py).

Example::

    inventories = [[Entry.from_wire(e) for e in reply] for reply in replies]   # index = server rank
    choice = choose(inventories, "/ckpt")    # Choice(id=7, step=1200, job="6f1c0a9e8d2b4c57")
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass

from .errors import CheckpointError

_JOB = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def is_job_id(value) -> bool:
    """Whether ``value`` can be a job id (what the scheduler makes: hex digits)."""
    return isinstance(value, str) and _JOB.match(value) is not None


def path_for(directory: str, rank: int) -> str:
    """The committed checkpoint file of server ``rank``."""
    return os.path.join(directory, f"server-{rank}.ckpt")


def part_path(directory: str, rank: int, ckpt_id: int) -> str:
    """Server ``rank``'s part of checkpoint ``ckpt_id``, before its commit."""
    return os.path.join(directory, f"server-{rank}.ckpt-{ckpt_id}.part")


@dataclass(frozen=True)
class Entry:
    """One file of a server's inventory: the checkpoint it holds, or why it is unusable."""
    file: str
    committed: bool
    id: int | None = None
    step: int | None = None
    error: str | None = None      # set when the file fails its checks
    job: str | None = None        # the job that wrote it (None with an error)

    def to_wire(self) -> dict:
        """The entry as a msgpack map (a server's ``checkpoint_inventory`` reply)."""
        return asdict(self)

    @classmethod
    def from_wire(cls, raw) -> Entry:
        """The entry :meth:`to_wire` made; CheckpointError for anything else."""
        if not isinstance(raw, dict) or not isinstance(raw.get("file"), str) \
                or not isinstance(raw.get("committed"), bool):
            raise CheckpointError(f"malformed checkpoint inventory entry {raw!r}")
        ckpt_id, step, error, job = raw.get("id"), raw.get("step"), raw.get("error"), raw.get("job")
        if error is None and not (is_count(ckpt_id) and is_count(step) and is_job_id(job)):
            raise CheckpointError(f"malformed checkpoint inventory entry {raw!r}")
        return cls(raw["file"], raw["committed"], ckpt_id, step, error, job)


def is_count(v) -> bool:
    """Whether ``v`` is an int >= 0 (not a bool): a checkpoint id, step or size."""
    return type(v) is int and v >= 0


@dataclass(frozen=True)
class Choice:
    """The set a resume restores: its id, step and job."""
    id: int
    step: int
    job: str


def choose(inventories: list[list[Entry]], directory: str = "KVSTORE_CHECKPOINT_DIR") -> Choice:
    """The newest complete checkpoint set, from every server's inventory (index =
    server rank): the newest id committed on any server, which every server must hold
    (committed or as a part) with a file that passed its checks and the same step,
    every such file of the same job. CheckpointError naming each server and file that
    stands in the way otherwise (for files of two jobs: each file and its job).

    Pure: the leading worker calls it with what the servers reported."""
    def usable(entries):
        return [e for e in entries if e.error is None]
    committed = [e.id for entries in inventories for e in usable(entries) if e.committed]
    if not committed:
        why = "; ".join(_describe(rank, entries, directory) for rank, entries in enumerate(inventories))
        raise CheckpointError(f"cannot resume: no complete checkpoint in {directory} ({why})")
    newest = max(committed)
    steps, problems, holders = set(), [], []
    for rank, entries in enumerate(inventories):
        held = [e for e in usable(entries) if e.id == newest]
        holders += held
        if held:
            steps.add(held[0].step)
            continue
        bad = [e for e in entries if e.error is not None]
        problems.append(f"server {rank} has no usable file of checkpoint {newest} "
                        f"({_describe(rank, entries, directory)})"
                        + ("" if bad else ": it was deleted or never written"))
    if problems:
        raise CheckpointError(f"cannot resume: checkpoint {newest} is committed but incomplete: "
                              + "; ".join(problems) + ". Refusing to combine checkpoints of "
                              "different saves")
    jobs = {e.job for e in holders}
    if len(jobs) != 1:
        raise CheckpointError(
            f"cannot resume: the files of checkpoint {newest} were written by different jobs: "
            + ", ".join(f"{e.file} (job {e.job})" for e in holders)
            + f". Refusing to combine checkpoints of different jobs (a file copied from another job's "
            f"directory, or two jobs that shared {directory})")
    if len(steps) != 1:
        raise CheckpointError(f"cannot resume: the files of checkpoint {newest} disagree on its step "
                              f"({sorted(steps)})")
    return Choice(newest, steps.pop(), str(jobs.pop()))


def _describe(rank: int, entries: list[Entry], directory: str) -> str:
    if not entries:
        return f"server {rank}: no checkpoint file ({path_for(directory, rank)} does not exist)"
    return f"server {rank}: " + ", ".join(
        f"{e.file}: {e.error}" if e.error else
        f"{e.file} holds checkpoint {e.id} (step {e.step}{'' if e.committed else ', uncommitted'}) "
        f"of job {e.job}"
        for e in entries)
