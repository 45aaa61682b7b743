"""The workers' side of the servers' checkpoints: ``save_checkpoint``, automatic
checkpoints (``KVSTORE_CHECKPOINT_INTERVAL``) and, after ``--resume``, the
metadata of the checkpoint the servers started from. The servers write and read
the files (kvstore/server/checkpoint.py)."""

from __future__ import annotations

import time

import msgpack
import numpy as np

from .errors import InvalidArgumentError
from .protocol import ops


class Checkpoints:
    """Example (what DistStore does)::

        checkpoints = Checkpoints(client, leads, config, collective)
        checkpoints.save({"epoch": 3})      # collective
        checkpoints.pulled()                # after each pull: maybe an automatic one
        checkpoints.resumed, checkpoints.meta
    """

    def __init__(self, client, leads, config, collective):
        # leads(): whether this worker acts for all (rank 0; in an elastic job the
        # lowest member rank, the same on every worker between two collective calls)
        self._client, self._leads, self._collective = client, leads, collective
        self._interval = config.checkpoint_interval
        self._pulls = 0
        self._next = time.monotonic() + self._interval if self._interval > 0 else None
        self.resumed, self.meta = False, {}
        if config.resume:
            found = {}

            def keep(header, values):
                found.update(header)
            what = "reading the checkpoint's metadata"
            client.wait([client.request(0, ops.GET_META, what, on_reply=keep)[0]], what)
            self.resumed, self.meta = bool(found.get("resumed")), dict(found.get("meta") or {})

    def save(self, meta: dict | None) -> None:
        """Every server writes its checkpoint, with ``meta``, once every worker's
        pushes so far are applied (see DistStore.save_checkpoint)."""
        meta = checkpoint_meta(meta)
        self._client.flush("save_checkpoint")
        self._collective("save_checkpoint")
        if self._leads():
            self._client.request_all(ops.CHECKPOINT, "save_checkpoint", meta=meta)
        self._collective("save_checkpoint done")

    def pulled(self) -> None:
        """Automatic checkpoints, by the leading worker (rank 0) right after a pull: its next push has not
        been sent, so no round after this pull's can have completed on any server, and
        every server saves the same round."""
        self._pulls += 1
        if self._next is None or not self._leads() or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + self._interval
        self._client.request_all(ops.CHECKPOINT, "automatic checkpoint", meta={"step": self._pulls})


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
