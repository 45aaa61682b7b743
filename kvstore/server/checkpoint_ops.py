"""A server node's checkpoint ops: write its part of a set (phase 1), commit it
(phase 2), list its files, and restore the set a resume chose. The files and the
choice are kvstore.server.checkpoint's; what a snapshot holds is ServerState's;
the hold on the directory is kvstore.server.checkpoint_lock's.

A server started with ``--resume`` restores nothing by itself: it waits for the
leading worker, which gathers every server's inventory, chooses one complete set
for all (:func:`kvstore.checkpoint_sets.choose`) and asks each to restore it.
Until then it refuses every other op, so no request can reach a state that is
about to be replaced. The restore adopts the set's job id (later saves carry it)
and deletes the temporaries of saves that never finished.

After a restore the job's first ``set_optimizer`` keeps the restored optimizer
state only when it sets the same optimizer (kvstore.server.server_optimizer); when
it sets another one, :meth:`CheckpointOps.optimizer_set` logs a warning naming
what was dropped (both optimizers, the state of how many keys).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading

from ..errors import CheckpointError, KVStoreError, ProtocolError
from ..optimizer import Updater
from ..protocol import error_header, ops
from ..checkpoint_sets import is_job_id
from .checkpoint import CheckpointDir
from .checkpoint_lock import DirLock
from .state import ServerState

log = logging.getLogger(__name__)

WAITING_ALLOWED = frozenset({ops.CHECKPOINT_LIST, ops.CHECKPOINT_RESTORE})


class CheckpointOps:
    """Example (what ServerNode does)::

        cops = CheckpointOps(directory, rank, num_servers, state, resume=True, job=reg.job)
        cops.start(wait=config.heartbeat_timeout)   # CheckpointError: another job's directory
        if header["op"] in CheckpointOps.HANDLED:
            reply_header = cops.handle(header)
        elif (why := cops.refusal(header["op"])):
            ...answer with an error
        cops.optimizer_set(header, ok)    # after the state machine served a set_optimizer
        cops.close()
    """

    HANDLED = frozenset({ops.CHECKPOINT, ops.CHECKPOINT_COMMIT, ops.CHECKPOINT_LIST,
                         ops.CHECKPOINT_RESTORE})

    def __init__(self, directory: str, rank: int, num_servers: int, state: ServerState, resume: bool,
                 job: str):
        self.files = CheckpointDir(directory, rank, num_servers, job)
        self.lock = DirLock(directory, rank)
        self.state = state
        self.awaiting_restore = resume
        self._holder: dict = {}
        # after a restore, until the job sets its optimizer: the restored updater,
        # its config and how many keys / chunks hold its state
        self._restored: tuple[Updater, dict, int, int] | None = None
        self._handlers = {ops.CHECKPOINT: self._write_part, ops.CHECKPOINT_COMMIT: self._commit,
                          ops.CHECKPOINT_LIST: self._list, ops.CHECKPOINT_RESTORE: self._restore}

    def start(self, wait: float, stop: threading.Event | None = None) -> None:
        """Hold this server's lock on the directory (kvstore.server.checkpoint_lock),
        waiting up to ``wait`` seconds for a holder that is ending. CheckpointError
        naming the other job when it stays held: two live jobs never share files."""
        self._holder = {"job": self.files.job, "server": self.files.rank, "host": socket.gethostname(),
                        "pid": os.getpid(),
                        "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        self.lock.acquire(self._holder, wait, stop)
        log.info("%s: checkpoints of job %s in %s (lock %s)", self.state.name, self.files.job,
                 self.files.directory, self.lock.path)

    def close(self) -> None:
        self.lock.release()

    def refusal(self, op: str) -> str | None:
        """Why ``op`` cannot be served now (a resumed server before its restore), or None."""
        if self.awaiting_restore and op not in WAITING_ALLOWED and op not in ops.TRANSPORT | ops.NODE:
            return (f"{self.state.name} was started with --resume and has not restored a checkpoint "
                    f"yet (the leading worker chooses one at kvstore.create): {op!r} cannot be served")
        return None

    def handle(self, header: dict) -> dict:
        """Serve one checkpoint op; the reply header (ok, or an error naming this server)."""
        req_id = header["id"]
        try:
            refusal = self.refusal(header["op"])
            if refusal is not None:
                raise CheckpointError(refusal)
            return {"op": ops.OK, "id": req_id, **self._handlers[header["op"]](header)}
        except OSError as e:     # disk full, permissions: the committed set stays as it was
            log.error("%s: checkpoint %s failed: %s", self.state.name, header["op"], e)
            return error_header(req_id, "CheckpointError", f"{self.state.name}: {e}")
        except KVStoreError as e:
            log.error("%s: %s", self.state.name, e)
            return error_header(req_id, type(e).__name__, f"{self.state.name}: {e}")

    def _write_part(self, header: dict) -> dict:
        ckpt_id, step = _count(header, "checkpoint", 1), _count(header, "step", 0)
        raw = header.get("meta")
        meta: dict = raw if isinstance(raw, dict) else {}
        path = ""
        if self._own_share:
            path = self.files.write_part(ckpt_id, step, self.state.snapshot(meta))
            log.info("%s: part of checkpoint %d (step %d, job %s) written to %s", self.state.name, ckpt_id, step,
                     self.files.job, path)
        for share in sorted(self.state.served):     # replicated: the dead servers' shares served here
            other = self._files_of(share).write_part(ckpt_id, step, self.state.snapshot(meta, share))
            log.info("%s: server %d's part of checkpoint %d (its share, served here) written to %s",
                     self.state.name, share, ckpt_id, other)
            path = path or other
        return {"path": path}

    @property
    def _own_share(self) -> bool:
        """Whether this server has a share of its own: a replacement server
        (``--restart-servers``, ranked past the job's servers) writes only the parts
        of the shares it took over."""
        return self.files.rank < self.files.num_servers

    def _commit(self, header: dict) -> dict:
        ckpt_id = _count(header, "checkpoint", 1)
        path = ""
        for share in sorted(self.state.served):
            path = self._files_of(share).commit(ckpt_id)
        if self._own_share:
            path = self.files.commit(ckpt_id)
        log.info("%s: checkpoint %d committed: %s", self.state.name, ckpt_id, path)
        return {"path": path}

    def _files_of(self, share: int) -> CheckpointDir:
        """(Replicated servers) the files of server ``share``, whose chunks this server
        serves since it died: its parts are written here under its rank, in this
        server's directory, where a resume's server ``share`` finds them when the
        servers share a host or a directory."""
        return CheckpointDir(self.files.directory, share, self.files.num_servers, self.files.job)

    def _list(self, header: dict) -> dict:
        verify = header.get("verify", True)
        if not isinstance(verify, bool):
            raise ProtocolError(f"'verify' must be true or false, got {verify!r}")
        entries = self.files.inventory(verify=verify)
        return {"files": [e.to_wire() for e in entries], "max_id": self.files.max_id}

    def _restore(self, header: dict) -> dict:
        ckpt_id, job = _count(header, "checkpoint", 1), header.get("job")
        if not isinstance(job, str) or not is_job_id(job):
            raise ProtocolError(f"'job' must name the job of the chosen set, got {job!r}")
        if not self.awaiting_restore:
            raise CheckpointError("this server restores a checkpoint only once, at the start of a job "
                                  "run with --resume")
        snap = self.files.load(ckpt_id, job)
        try:
            self.state.restore(snap)
        except (KeyError, TypeError, ValueError) as e:   # verified, parses, but not what we write
            raise CheckpointError(f"checkpoint {ckpt_id} of {self.state.name} is corrupt: "
                                  f"{type(e).__name__}: {e}") from None
        self.awaiting_restore = False
        if job != self.files.job:       # the job goes on as the one that saved: later saves say so
            self.files.job = job
            if self.lock.held:
                self.lock.describe({**self._holder, "job": job})
        self.files.remove_temporaries()
        updater = self.state.updater
        if updater is not None:
            states = updater.get_states()
            self._restored = (updater, updater.optimizer.to_config(), len({cid[0] for cid in states}),
                              len(states))
        log.info("%s: resumed from checkpoint %d of job %s (step %d, %d chunks)", self.state.name, ckpt_id,
                 job, snap["step"], len(self.state.chunks))
        return {}

    def optimizer_set(self, header: dict, ok: bool) -> None:
        """The state machine served ``set_optimizer`` ``header`` (``ok``: it succeeded).
        The first one that succeeds after a restore either kept the restored optimizer
        state (the same optimizer) or dropped it: then a warning names both optimizers
        and the state dropped. A ``keep_state`` one (set_learning_rate) keeps it."""
        if self._restored is None or not ok or header.get("keep_state"):
            return
        (restored, config, keys, chunks), self._restored = self._restored, None
        now = self.state.updater
        if now is restored or now is None:
            return
        old, new = config.get("name"), now.optimizer.to_config()
        if old == new.get("name"):
            what = f"{old!r} with other settings ({_changes(config, new)})"
        else:
            what = f"{new.get('name')!r}"
        log.warning("%s: the job resumed with optimizer %r but set %s: the checkpoint's optimizer state "
                    "(update counts and state arrays) of %d key(s) (%d chunk(s) on this server) is dropped, "
                    "and the new optimizer starts from fresh state. Set the checkpoint's optimizer to keep "
                    "it (set_learning_rate changes the learning rate and keeps it)", self.state.name, old,
                    what, keys, chunks)


def _changes(old: dict, new: dict) -> str:
    """The settings that differ between two optimizer configs, ``name: old -> new``."""
    def flat(config):
        out = dict(config.get("params") or {})
        sched = config.get("lr_scheduler")
        out["lr_scheduler"] = None if sched is None else sched.get("name")
        for k, v in ((sched or {}).get("params") or {}).items():
            out[f"lr_scheduler.{k}"] = v
        return out
    a, b = flat(old), flat(new)
    diff = [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return ", ".join(diff) or "the same parameters"


def _count(header: dict, field: str, least: int) -> int:
    value = header.get(field)
    if type(value) is not int or value < least:
        raise ProtocolError(f"{field!r} must be an integer >= {least}, got {value!r}")
    return value
