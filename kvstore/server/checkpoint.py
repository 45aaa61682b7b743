"""A server's checkpoint files, and how a set of them across servers becomes a
job-wide checkpoint that cannot resume wrong.

A checkpoint is a *set*: one part per server, all with the same checkpoint id
and step. It is taken in two phases, driven by the leading worker
(kvstore/worker/checkpoints.py):

1. ``write_part(id, ...)``: every server writes ``server-R.ckpt-ID.part``
   (temporary file, fsync, rename, fsync of the directory) and acknowledges.
2. Once every server acknowledged, ``commit(id)`` on every server renames its part
   over ``server-R.ckpt`` (the committed file) and deletes its other parts.

A committed file anywhere therefore proves that every server's part of that id
was durable: a server that crashed before its commit still holds its part. The
previous committed file stays until the next commit replaces it. Resuming
(:func:`kvstore.checkpoint_sets.choose`, which the leading worker runs) takes the newest id committed on any server, and every server
restores that id from its committed file or its part; when one lacks it, or a
file fails its checks (id, step, server, size, checksum), or the files of that id
name different jobs, the resume is refused naming the server and the file; sets
are never mixed.

Every file names its *job*: an id the scheduler makes when a job first starts
(:attr:`tracker.control.membership.Registration.job`); a resumed job takes the id
of the set it restored, so its later saves carry the first start's id. Two jobs
never write in one directory at once: each server holds
:class:`kvstore.server.checkpoint_lock.DirLock` while it lives.

A save killed while it wrote leaves a temporary file of :func:`kvstore.fileio.atomic_write`
(``.server-R.ckpt-ID.part-XXXXXXXX``); the next commit of this server, and a
resume's restore, delete them (:meth:`CheckpointDir.remove_temporaries`).

File layout (msgpack, no pickle): a small header map, then the payload bytes::

    {"format": "kvstore.server_checkpoint", "version": 3, "job": "6f1c0a9e8d2b4c57",
     "checkpoint": 7, "step": 1200, "server": 0, "num_servers": 2, "bytes": N,
     "sha256": "..."}
    <N bytes: msgpack of ServerState.snapshot() plus "num_servers">

Version 2 files (before the job id) are refused, saying so: nothing in them tells
which job wrote them.

Example::

    d = CheckpointDir("/ckpt", rank=0, num_servers=2, job="6f1c0a9e8d2b4c57")
    d.write_part(7, 1200, snapshot)      # phase 1
    d.commit(7)                          # phase 2, after every server's phase 1
    snap = d.load(7, "6f1c0a9e8d2b4c57")  # resume: verified, or CheckpointError
"""

from __future__ import annotations

import hashlib
import logging
import os
import re

import msgpack

from ..checkpoint_sets import Choice, Entry, choose, is_count, is_job_id, part_path, path_for
from ..errors import CheckpointError
from ..fileio import atomic_write, check_format, fsync_directory

# the names both ends share (kvstore/checkpoint_sets.py), importable from here as before
__all__ = ["FORMAT", "VERSION", "CheckpointDir", "Choice", "Entry", "choose", "is_job_id", "load", "part_path",
           "path_for", "read_header", "save"]

log = logging.getLogger(__name__)

FORMAT = "kvstore.server_checkpoint"
VERSION = 3
_PART = re.compile(r"^server-(\d+)\.ckpt-(\d+)\.part$")
# atomic_write's temporary of a file NAME is ".NAME-" plus mkstemp's random letters
_TEMPORARY = re.compile(r"^\.server-(\d+)\.ckpt-.+$")
def save(path: str, ckpt_id: int, step: int, rank: int, num_servers: int, job: str, snapshot: dict) -> None:
    """Write one checkpoint file of job ``job`` atomically (temporary file, fsync,
    rename, directory fsync)."""
    payload = msgpack.packb({**snapshot, "num_servers": num_servers}, use_bin_type=True)
    header = {"format": FORMAT, "version": VERSION, "job": job, "checkpoint": ckpt_id, "step": step,
              "server": rank, "num_servers": num_servers, "bytes": len(payload),
              "sha256": hashlib.sha256(payload).hexdigest()}
    with atomic_write(path) as f:
        msgpack.pack(header, f, use_bin_type=True)
        f.write(payload)


def read_header(path: str) -> tuple[dict, int]:
    """The header of a checkpoint file and the offset of its payload; CheckpointError
    naming ``path`` when it is missing, unreadable, not a checkpoint or of another version."""
    try:
        with open(path, "rb") as f:
            unpacker = msgpack.Unpacker(f, raw=False, strict_map_key=False, read_size=4096,
                                        max_buffer_size=1 << 20)
            header = unpacker.unpack()
            offset = unpacker.tell()
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    except (OSError, ValueError, msgpack.UnpackException, msgpack.OutOfData) as e:
        raise CheckpointError(f"{path} cannot be read as a checkpoint: {type(e).__name__}: {e}") from e
    if isinstance(header, dict) and header.get("format") == FORMAT and header.get("version") == 2:
        raise CheckpointError(f"{path} has server checkpoint version 2, which does not name the job that "
                              f"wrote it; this kvstore reads version {VERSION} and refuses it rather than "
                              "guess: resume it with the kvstore that wrote it, or start without --resume")
    check_format(header, path, FORMAT, VERSION, "server checkpoint", CheckpointError)
    if not is_job_id(header.get("job")):
        raise CheckpointError(f"{path}: its header's 'job' is {header.get('job')!r}")
    for field in ("checkpoint", "step", "server", "num_servers", "bytes"):
        if not is_count(header.get(field)):
            raise CheckpointError(f"{path}: its header's {field!r} is {header.get(field)!r}")
    if not isinstance(header.get("sha256"), str):
        raise CheckpointError(f"{path}: its header has no checksum")
    return header, offset


def load(path: str) -> dict:
    """Read and verify a whole checkpoint file: the snapshot, with the header's
    ``checkpoint`` id and ``step`` added. CheckpointError naming ``path`` when the
    size or the checksum differs from its header's (a torn or corrupted file)."""
    header, offset = read_header(path)
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            payload = f.read()
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read: {e}") from e
    if len(payload) != header["bytes"]:
        raise CheckpointError(f"{path} is truncated or has trailing bytes: {len(payload)} bytes of "
                              f"payload, its header says {header['bytes']}")
    if hashlib.sha256(payload).hexdigest() != header["sha256"]:
        raise CheckpointError(f"{path} is corrupt: its checksum does not match its header's")
    try:
        snap = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise CheckpointError(f"{path} is corrupt: {e}") from e
    if not isinstance(snap, dict):
        raise CheckpointError(f"{path} is corrupt: its payload is not a map")
    return {**snap, "checkpoint": header["checkpoint"], "step": header["step"],
            "num_servers": header["num_servers"], "server": header["server"], "job": header["job"]}


class CheckpointDir:
    """One server's checkpoint files in ``directory``. Owns nothing but the files:
    what goes into a snapshot is the state machine's (ServerState.snapshot).
    ``job``: the id written into new files (a resume sets the restored set's)."""

    def __init__(self, directory: str, rank: int, num_servers: int, job: str):
        if not is_job_id(job):
            raise CheckpointError(f"server {rank} cannot write checkpoints: the job id {job!r} is not "
                                  "one the scheduler makes (a scheduler of another kvstore version?)")
        self.directory, self.rank, self.num_servers, self.job = directory, rank, num_servers, job
        self.max_id = 0     # the highest checkpoint id seen on disk or asked to write

    def committed(self) -> str:
        return path_for(self.directory, self.rank)

    def write_part(self, ckpt_id: int, step: int, snapshot: dict) -> str:
        """Phase 1: this server's part of checkpoint ``ckpt_id``. CheckpointError when
        ``ckpt_id`` is not newer than every id this server has seen (two leaders, or
        a stale one); OSError when writing fails (the committed file is untouched)."""
        self.inventory()        # max_id from the disk too (a fresh job in an old directory)
        if ckpt_id <= self.max_id:
            raise CheckpointError(f"checkpoint id {ckpt_id} is not newer than {self.max_id}, "
                                  f"which server {self.rank} has already seen")
        self.max_id = ckpt_id
        path = part_path(self.directory, self.rank, ckpt_id)
        save(path, ckpt_id, step, self.rank, self.num_servers, self.job, snapshot)
        return path

    def commit(self, ckpt_id: int) -> str:
        """Phase 2: every server's part of ``ckpt_id`` is durable, so this one becomes
        the committed file; other parts and the temporaries of unfinished saves go.
        Idempotent: a second commit of the committed id changes nothing.
        CheckpointError if the part is missing or not this job's."""
        part, final = part_path(self.directory, self.rank, ckpt_id), self.committed()
        if os.path.exists(part):
            header, _ = read_header(part)
            if header["checkpoint"] != ckpt_id or header["server"] != self.rank or header["job"] != self.job:
                raise CheckpointError(f"{part} holds checkpoint {header['checkpoint']} of server "
                                      f"{header['server']} of job {header['job']}, not checkpoint {ckpt_id} "
                                      f"of server {self.rank} of job {self.job}")
            os.replace(part, final)
            fsync_directory(self.directory)
        elif not (os.path.exists(final) and read_header(final)[0]["checkpoint"] == ckpt_id):
            raise CheckpointError(f"server {self.rank} has no part of checkpoint {ckpt_id} to commit "
                                  f"({part} does not exist)")
        for name in self._parts():
            os.unlink(os.path.join(self.directory, name))
        self.remove_temporaries()
        return final

    def remove_temporaries(self) -> list[str]:
        """Delete this server's temporaries of saves that never finished (a process
        killed inside :func:`~kvstore.fileio.atomic_write`); their paths. Safe
        only while no save of this server runs: called by the server's own commit
        and restore, and no other process writes as this rank in this directory
        (:class:`~kvstore.server.checkpoint_lock.DirLock`)."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        removed = []
        for name in sorted(names):
            named = _TEMPORARY.match(name)
            if named is None or int(named.group(1)) != self.rank:
                continue
            path = os.path.join(self.directory, name)
            try:
                size = os.lstat(path).st_size
                os.unlink(path)
            except FileNotFoundError:
                continue
            log.info("server %d: removed %s (%d bytes), left by a save that never finished", self.rank,
                     path, size)
            removed.append(path)
        return removed

    def inventory(self, verify: bool = False) -> list[Entry]:
        """Every checkpoint file of this server: its committed file and its parts,
        each with its id and step, or the reason it is unusable (``verify``: the
        payload's size and checksum are checked too)."""
        files = ([self.committed()] if os.path.exists(self.committed()) else []) + \
            [os.path.join(self.directory, n) for n in self._parts()]
        entries = []
        for path in files:
            committed = path == self.committed()
            try:
                header = load(path) if verify else read_header(path)[0]
                ckpt_id, step, job = header["checkpoint"], header["step"], header["job"]
                self.max_id = max(self.max_id, ckpt_id)
                if header["server"] != self.rank:
                    raise CheckpointError(f"{path} was written by server {header['server']}")
                if header["num_servers"] != self.num_servers:
                    raise CheckpointError(f"{path} was written by a job of {header['num_servers']} "
                                          f"servers; this job has {self.num_servers}: resume with the "
                                          "same number of servers")
                named = _PART.match(os.path.basename(path))
                if not committed and named is not None and named.group(2) != str(ckpt_id):
                    raise CheckpointError(f"{path} holds checkpoint {ckpt_id}, not the one its name says")
                entries.append(Entry(path, committed, ckpt_id, step, job=job))
            except CheckpointError as e:
                entries.append(Entry(path, committed, error=str(e)))
        return entries

    def load(self, ckpt_id: int, job: str) -> dict:
        """The verified snapshot of checkpoint ``ckpt_id`` of job ``job`` (committed
        file or part). CheckpointError naming the file when it is another job's."""
        for entry in self.inventory():
            if entry.id == ckpt_id:
                snap = load(entry.file)
                if snap["checkpoint"] != ckpt_id:    # changed under us
                    raise CheckpointError(f"{entry.file} now holds checkpoint {snap['checkpoint']}")
                if snap["job"] != job:
                    raise CheckpointError(f"{entry.file} holds checkpoint {ckpt_id} of job {snap['job']}, "
                                          f"not of job {job}, whose set the resume chose")
                return snap
        raise CheckpointError(f"server {self.rank} has no file of checkpoint {ckpt_id} in "
                              f"{self.directory} (expected {self.committed()} or "
                              f"{part_path(self.directory, self.rank, ckpt_id)})")

    def _parts(self) -> list[str]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return sorted(n for n in names if (m := _PART.match(n)) and int(m.group(1)) == self.rank)
