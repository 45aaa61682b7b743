"""The workers' side of the servers' checkpoints: ``save_checkpoint``, automatic
checkpoints (``KVSTORE_CHECKPOINT_INTERVAL``) and, with ``--resume``, choosing
the set every server restores. The servers write and read the files
(kvstore/server/checkpoint.py, which also explains the two phases); what both
ends agree on, the files' names, a server's inventory and the choice of a set, is
kvstore/checkpoint_sets.py.

The leading worker drives both: a save is phase 1 (every server writes its
part) then, once all acknowledged, phase 2 (every server commits); a resume
gathers every server's inventory, chooses the newest complete set
(:func:`kvstore.checkpoint_sets.choose`: its files must all name the same job)
and has every server restore that one, naming its job (each server checks its file
against it, and saves under that job id from then on).
"""

from __future__ import annotations

import time
from typing import Callable

import msgpack
import numpy as np

from ..checkpoint_sets import Entry, choose
from ..errors import CheckpointError, InvalidArgumentError, KVStoreError, RemoteError
from ..protocol import ops
from ..transport.links import RequestOptions


class Checkpoints:
    """Example (what DistStore does)::

        checkpoints = Checkpoints(client, leads, config, collective, fail, flush)
        checkpoints.resume()                # at create, before configure (no-op unless --resume)
        checkpoints.save({"epoch": 3})      # collective
        checkpoints.pulled()                # after each pull: maybe an automatic one
        checkpoints.resumed, checkpoints.meta
    """

    def __init__(self, client, leads: Callable[[], bool], config, collective: Callable[[str], object],
                 fail: Callable[[str], None], flush: Callable[[str], None]):
        # leads(): whether this worker acts for all (rank 0; in an elastic job the
        # lowest member rank, the same on every worker between two collective calls)
        # flush(what): every call of this worker in flight completed (its exchange's)
        self._client, self._leads, self._collective, self._fail = client, leads, collective, fail
        self._flush = flush
        self._config = config
        self._interval = config.checkpoint_interval
        # rank 0's pulls: the automatic checkpoints' step, carried across resumes
        self._pulls = 0
        self._last_id: int | None = None     # the newest checkpoint id (known to the leader)
        self._next = time.monotonic() + self._interval if self._interval > 0 else None
        self.resumed = False
        self.meta: dict = {}

    # -- resume -----------------------------------------------------------------------
    def resume(self) -> None:
        """With ``--resume``: the leader chooses the newest complete checkpoint set and
        every server restores it; then every worker reads its metadata. Collective.
        CheckpointError (and the job aborted, naming the cause) when no complete,
        intact set exists."""
        if not self._config.resume:
            return
        if self._leads():
            try:
                inventories, top = self._inventories(verify=True)
                choice = choose(inventories, self._config.checkpoint_dir or "KVSTORE_CHECKPOINT_DIR")
                self._client.request_all(ops.CHECKPOINT_RESTORE, f"restoring checkpoint {choice.id}",
                                         checkpoint=choice.id, job=choice.job)
            except (CheckpointError, RemoteError) as e:
                reason = str(e) if isinstance(e, CheckpointError) else f"cannot resume: {e}"
                self._fail(reason)
                raise CheckpointError(reason) from None
            # the next save's id: above every id any server has seen, including the
            # parts of a set that never completed (a newer one than the set restored)
            self._last_id = max(top, choice.id)
        self._collective("resume")
        found = {}

        def keep(header, values):
            found.update(header)
        what = "reading the checkpoint's metadata"
        self._client.wait([self._client.request(0, ops.GET_META, what, (), RequestOptions(on_reply=keep))[0]], what)
        self.resumed, self.meta = bool(found.get("resumed")), dict(found.get("meta") or {})
        self._pulls = int(found.get("step") or 0)

    def _inventories(self, verify: bool) -> tuple[list[list[Entry]], int]:
        """Every server's checkpoint files (index = server rank), and the highest id any has seen."""
        replies = self._client.request_all(ops.CHECKPOINT_LIST, "listing the servers' checkpoints",
                                           verify=verify)
        inventories = []
        for server, reply in enumerate(replies):
            files = reply.get("files")
            if not isinstance(files, list):
                raise CheckpointError(f"server {server} sent a malformed checkpoint inventory")
            inventories.append([Entry.from_wire(f) for f in files])
        top = max((int(r["max_id"]) for r in replies if type(r.get("max_id")) is int), default=0)
        return inventories, top

    # -- saving ----------------------------------------------------------------------
    def save(self, meta: dict | None) -> None:
        """Every server writes its checkpoint, with ``meta``, once every worker's
        pushes so far are applied (see DistStore.save_checkpoint)."""
        meta = checkpoint_meta(meta)
        self._flush("save_checkpoint")
        self._collective("save_checkpoint")
        if not self._leads():
            try:
                self._collective("save_checkpoint done")
            except KVStoreError as e:     # the leader's token says why the save failed
                raise CheckpointError(f"save_checkpoint failed: {e}") from e
            return
        try:
            self._take(meta, "save_checkpoint")
        except (RemoteError, CheckpointError) as e:
            # every worker hears of it (a token the others do not pass) and raises
            # CheckpointError quoting the server's error, this one too. The previous
            # complete set stays the one a resume takes, and the job may go on.
            try:
                self._collective(f"save_checkpoint failed: {e}")
            except KVStoreError:
                pass
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"save_checkpoint failed: {e}") from e
        self._collective("save_checkpoint done")

    def pulled(self) -> None:
        """Automatic checkpoints, by the leading worker (rank 0) right after a pull: its next push has not
        been sent, so no round after this pull's can have completed on any server, and
        every server saves the same round."""
        self._pulls += 1
        if self._next is None or not self._leads() or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + self._interval
        self._take({"step": self._pulls}, "automatic checkpoint")

    def _take(self, meta: dict, what: str) -> None:
        """Both phases: every server writes its part of a new checkpoint id; only when
        every one acknowledged does any commit. A failure in phase 1 leaves every
        server's committed set as it was."""
        if self._last_id is None:      # the first save of this leader: ids already on disk
            self._last_id = self._inventories(verify=False)[1]
        ckpt_id = self._last_id + 1
        self._last_id = ckpt_id        # used up even if this save fails: never reused
        self._client.request_all(ops.CHECKPOINT, f"{what} (checkpoint {ckpt_id}, writing)",
                                 checkpoint=ckpt_id, step=self._pulls, meta=meta)
        self._client.request_all(ops.CHECKPOINT_COMMIT, f"{what} (checkpoint {ckpt_id}, committing)",
                                 checkpoint=ckpt_id)


def checkpoint_meta(meta) -> dict:
    """``meta`` as the servers store it: numpy scalars become Python numbers, tuples
    lists. InvalidArgumentError for anything a checkpoint cannot hold, raised by every
    worker alike (each checks its own), before the collective call."""
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise InvalidArgumentError(f"save_checkpoint: meta must be a dict, got {type(meta).__name__}")

    def plain(value, where):
        if isinstance(value, np.generic) and not isinstance(value, (np.datetime64, np.timedelta64)):
            value = value.item()
        if isinstance(value, dict):
            return {plain(k, where): plain(v, f"{where}[{k!r}]") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if value is None or isinstance(value, (bool, int, float, str, bytes)):
            return value
        hint = " (use .tolist())" if isinstance(value, np.ndarray) else ""
        raise InvalidArgumentError(f"save_checkpoint: {where} is a {type(value).__name__}{hint}; meta "
                                   "may hold str, int, float, bool, None, bytes, lists and dicts")
    converted = plain(meta, "meta")
    try:
        msgpack.packb(converted, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:    # e.g. an int beyond 64 bits
        raise InvalidArgumentError(f"save_checkpoint: meta cannot be stored: {e}") from None
    return converted
