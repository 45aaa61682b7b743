"""A server node's checkpoint ops: write its part of a set (phase 1), commit it
(phase 2), list its files, and restore the set a resume chose. The files and the
choice are kvstore.server.checkpoint's; what a snapshot holds is ServerState's.

A server started with ``--resume`` restores nothing by itself: it waits for the
leading worker, which gathers every server's inventory, chooses one complete set
for all (:func:`kvstore.server.checkpoint.choose`) and asks each to restore it.
Until then it refuses every other op, so no request can reach a state that is
about to be replaced.
"""

from __future__ import annotations

import logging

from ..errors import CheckpointError, KVStoreError, ProtocolError
from ..protocol import error_header, ops
from .checkpoint import CheckpointDir
from .state import ServerState

log = logging.getLogger(__name__)

WAITING_ALLOWED = frozenset({ops.CHECKPOINT_LIST, ops.CHECKPOINT_RESTORE})


class CheckpointOps:
    """Example (what ServerNode does)::

        cops = CheckpointOps(directory, rank, num_servers, state, resume=True)
        if header["op"] in CheckpointOps.HANDLED:
            reply_header = cops.handle(header)
        elif (why := cops.refusal(header["op"])):
            ...answer with an error
    """

    HANDLED = frozenset({ops.CHECKPOINT, ops.CHECKPOINT_COMMIT, ops.CHECKPOINT_LIST,
                         ops.CHECKPOINT_RESTORE})

    def __init__(self, directory: str, rank: int, num_servers: int, state: ServerState, resume: bool):
        self.files = CheckpointDir(directory, rank, num_servers)
        self.state = state
        self.awaiting_restore = resume
        self._handlers = {ops.CHECKPOINT: self._write_part, ops.CHECKPOINT_COMMIT: self._commit,
                          ops.CHECKPOINT_LIST: self._list, ops.CHECKPOINT_RESTORE: self._restore}

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
        path = self.files.write_part(ckpt_id, step, self.state.snapshot(meta))
        log.info("%s: part of checkpoint %d (step %d) written to %s", self.state.name, ckpt_id, step, path)
        return {"path": path}

    def _commit(self, header: dict) -> dict:
        ckpt_id = _count(header, "checkpoint", 1)
        path = self.files.commit(ckpt_id)
        log.info("%s: checkpoint %d committed: %s", self.state.name, ckpt_id, path)
        return {"path": path}

    def _list(self, header: dict) -> dict:
        verify = header.get("verify", True)
        if not isinstance(verify, bool):
            raise ProtocolError(f"'verify' must be true or false, got {verify!r}")
        entries = self.files.inventory(verify=verify)
        return {"files": [e.to_wire() for e in entries], "max_id": self.files.max_id}

    def _restore(self, header: dict) -> dict:
        ckpt_id = _count(header, "checkpoint", 1)
        if not self.awaiting_restore:
            raise CheckpointError("this server restores a checkpoint only once, at the start of a job "
                                  "run with --resume")
        snap = self.files.load(ckpt_id)
        try:
            self.state.restore(snap)
        except (KeyError, TypeError, ValueError) as e:   # verified, parses, but not what we write
            raise CheckpointError(f"checkpoint {ckpt_id} of {self.state.name} is corrupt: "
                                  f"{type(e).__name__}: {e}") from None
        self.awaiting_restore = False
        log.info("%s: resumed from checkpoint %d (step %d, %d chunks)", self.state.name, ckpt_id,
                 snap["step"], len(self.state.chunks))
        return {}


def _count(header: dict, field: str, least: int) -> int:
    value = header.get(field)
    if type(value) is not int or value < least:
        raise ProtocolError(f"{field!r} must be an integer >= {least}, got {value!r}")
    return value
