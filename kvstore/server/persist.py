"""What outlives a round on a server: the optimizer, its state, checkpoints.

:class:`Persist` holds the ``set_optimizer``, ``get_states``/``set_states``
(``save``/``load_optimizer_states``), ``get_meta`` and ``checkpoint`` ops of
:class:`kvstore.server.state.ServerState`, and the ``snapshot``/``restore`` of
its checkpoints (written to files by kvstore.server.checkpoint and node.py).
Pure, like the rest of the state machine: no sockets, threads or clocks.
"""

from __future__ import annotations

import numpy as np

from .. import optimizer as _optimizer
from ..errors import ConfigError, InvalidArgumentError, ProtocolError
from ..protocol import chunk_label
from .rounds import Chunk, is_int


class Persist:
    """The optimizer and checkpoint ops; a mixin of ServerState, whose chunks,
    ``updater``, ``backend`` and helpers (``_ok``, ``_existing``) it uses."""

    def _on_set_optimizer(self, peer, header, arrays):
        try:
            opt = _optimizer.from_config(header["optimizer"])
        except ConfigError as e:
            raise ConfigError(f"set_optimizer: {e}") from None
        keep_state = header.get("keep_state", False)
        if not isinstance(keep_state, bool):
            raise ProtocolError("'keep_state' must be true or false")
        if keep_state and self.updater is None:
            raise InvalidArgumentError("set_learning_rate: no optimizer is set on this server")
        scale = header.get("state_scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
            raise ProtocolError(f"'state_scale' must be a positive number, got {scale!r}")
        if keep_state:
            try:
                self.updater.replace_optimizer(opt, float(scale))   # new hyper-parameters, same state
            except ValueError as e:
                raise InvalidArgumentError(f"set_optimizer: {e}") from None
        elif self._restored_optimizer is not None and opt.to_config() == self._restored_optimizer:
            self._restored_optimizer = None   # resumed: keep the checkpoint's optimizer state
        else:
            self._restored_optimizer = None
            self.updater = _optimizer.Updater(opt)
        return [self._ok(peer, header["id"])]

    def _on_get_meta(self, peer, header, arrays):
        return [self._ok(peer, header["id"], meta=self.meta, resumed=self.resumed,
                         checkpoint=self.resumed_from[0], step=self.resumed_from[1])]

    def _on_checkpoint(self, peer, header, arrays):
        # a node with KVSTORE_CHECKPOINT_DIR serves the checkpoint ops itself
        # (kvstore.server.checkpoint_ops); they reach the state machine only without one
        raise InvalidArgumentError("this server cannot write checkpoints (it has no checkpoint "
                                   "directory): set KVSTORE_CHECKPOINT_DIR for the job")

    _on_checkpoint_commit = _on_checkpoint_list = _on_checkpoint_restore = _on_checkpoint

    # -- checkpoints -------------------------------------------------------------------
    def snapshot(self, meta: dict) -> dict:
        """Everything acknowledged so far: values after their last applied round,
        the optimizer and its state. Pushes of an incomplete round (not yet
        acknowledged to anyone) are not included."""
        states = self.updater.get_states() if self.updater is not None else {}
        chunks = []
        for cid, chunk in self.chunks.items():
            entry = states.get(cid)
            host = self.backend.to_numpy
            chunks.append([cid[0], cid[1], chunk.value.dtype.str, host(chunk.value).tobytes(),
                           None if entry is None else int(entry["t"]),
                           [] if entry is None else [host(x).tobytes() for x in entry["state"]]])
        return {"server": self.name, "mode": self.mode, "num_workers": self.num_workers,
                "optimizer": None if self.updater is None else self.updater.optimizer.to_config(),
                "meta": dict(meta), "chunks": chunks}

    def restore(self, snap: dict) -> None:
        """Start from a checkpoint: the next init of a restored chunk keeps the
        restored value, and a set_optimizer with the same optimizer keeps its state."""
        self.mode, self.num_workers = snap["mode"], snap["num_workers"]
        self.chunks, states = {}, {}
        if snap["optimizer"] is not None:
            self.updater = _optimizer.Updater(_optimizer.from_config(snap["optimizer"]))
            self._restored_optimizer = self.updater.optimizer.to_config()
        for key, index, dtype, data, t, state in snap["chunks"]:
            saved = np.frombuffer(data, dtype=np.dtype(dtype))
            value = self._alloc(saved.size, saved.dtype)   # shared memory, as init's
            with self.backend.scope():
                self.backend.upload(saved, out=value)
            self.chunks[(key, index)] = Chunk(value)
            if t is not None and self.updater is not None:
                kind = self.updater.optimizer.state_spec(value.dtype)[1]   # multi_precision: float32
                states[(key, index)] = {"t": t, "state": [np.frombuffer(b, dtype=kind).copy()
                                                          for b in state]}
        if states:
            self.updater.set_states(states)
        self._restored = set(self.chunks)
        self.meta, self.resumed = dict(snap.get("meta") or {}), True
        self.resumed_from = (snap.get("checkpoint"), snap.get("step", 0))

    def _on_get_states(self, peer, header, arrays):
        if self.updater is None:
            raise InvalidArgumentError("no optimizer is set, so there are no optimizer states")
        meta, out = [], []
        for cid, entry in sorted(self.updater.get_states().items(), key=lambda kv: repr(kv[0])):
            meta.append([cid[0], cid[1], int(entry["t"]), len(entry["state"])])
            # copies: in async mode pushes may change the live arrays while they are sent
            out += self.backend.download(entry["state"], copy=True)
        return [self._ok(peer, header["id"], out, states=meta)]

    def _on_set_states(self, peer, header, arrays):
        if self.updater is None:
            raise InvalidArgumentError("set_optimizer() must come before load_optimizer_states()")
        meta = header["states"]
        if not isinstance(meta, list) or not all(
                isinstance(m, list) and len(m) == 4 and all(is_int(v) and v >= 0 for v in m[1:])
                for m in meta):
            raise ProtocolError("'states' must be a list of [key, index, t, count]")
        if sum(m[3] for m in meta) != len(arrays):
            raise ProtocolError("state descriptions do not match the buffers")
        states, pos = {}, 0
        for key, index, t, count in meta:
            cid = (key, index)
            chunk = self._existing([cid], rows_too=True)[0]
            parts = arrays[pos:pos + count]
            # multi_precision: a float16 chunk's state is a float32 master copy + float32 state
            want, dtype = self.updater.optimizer.state_spec(chunk.value.dtype)
            for a in parts:
                if a.dtype != dtype or a.size != chunk.value.size:
                    raise InvalidArgumentError(f"optimizer state for {chunk_label(cid)}: got {a.size} x "
                                               f"{a.dtype.name}, it must be {chunk.value.size} x "
                                               f"{dtype.name}")
            if len(parts) != want:
                raise InvalidArgumentError(f"optimizer state for {chunk_label(cid)}: {len(parts)} arrays, "
                                           f"{self.updater.optimizer.to_config()['name']} keeps "
                                           f"{want}")
            states[cid] = {"t": t, "state": [np.array(a, copy=True).reshape(-1) for a in parts]}
            pos += count
        self.updater.set_states(states)
        return [self._ok(peer, header["id"])]
