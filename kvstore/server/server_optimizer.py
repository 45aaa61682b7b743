"""The optimizer a server applies, with its state: what ``set_optimizer``,
``set_learning_rate`` and ``save``/``load_optimizer_states`` change.

:class:`ServerOptimizer` is a collaborator of :class:`kvstore.server.state.ServerState`
(was part of its ``Persist`` mixin). It owns the :class:`~kvstore.optimizer.Updater`
(None until a ``set_optimizer``) and, after a resume, the checkpoint's optimizer
config, so that the job's first ``set_optimizer`` with that same optimizer keeps the
restored state. Chunks and the backend are handed to the calls that need them.
Pure: no sockets, threads or clocks.

Example::

    optimizer = ServerOptimizer()
    optimizer.set({"optimizer": SGD(learning_rate=0.1).to_config()})
    optimizer.updater(("w", 0), grad, value)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .. import optimizer as _optimizer
from ..errors import ConfigError, InvalidArgumentError, ProtocolError
from ..protocol import chunk_label
from .rounds import StoredChunk, is_int


class ServerOptimizer:
    def __init__(self) -> None:
        self.updater: _optimizer.Updater | None = None
        self._restored_config: dict | None = None    # the checkpoint's optimizer, until set again

    def set(self, header: dict) -> None:
        """The ``set_optimizer`` op: a new optimizer (fresh state), or with
        ``keep_state`` new hyper-parameters for the same one (``state_scale``
        multiplies its state). Raises for a bad config, changing nothing."""
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
            assert self.updater is not None
            try:
                self.updater.replace_optimizer(opt, float(scale))   # new hyper-parameters, same state
            except ValueError as e:
                raise InvalidArgumentError(f"set_optimizer: {e}") from None
        elif self._restored_config is not None and opt.to_config() == self._restored_config:
            self._restored_config = None   # resumed: keep the checkpoint's optimizer state
        else:
            self._restored_config = None
            self.updater = _optimizer.Updater(opt)

    def config(self) -> dict | None:
        return None if self.updater is None else self.updater.optimizer.to_config()

    def restore(self, config: dict | None, states: dict) -> None:
        """Start from a checkpoint's optimizer and its ``{chunk id: {"t", "state"}}``."""
        self.updater, self._restored_config = None, None
        if config is None:
            return
        self.updater = _optimizer.Updater(_optimizer.from_config(config))
        self._restored_config = self.updater.optimizer.to_config()
        if states:
            self.updater.set_states(states)

    def get_states(self, download: Callable[[list], list]) -> tuple[list, list]:
        """The ``get_states`` op: ``([key, index, t, count] per chunk, the arrays)``,
        the arrays host copies (``download``: in async mode pushes may change the live
        arrays while they are sent)."""
        if self.updater is None:
            raise InvalidArgumentError("no optimizer is set, so there are no optimizer states")
        meta, out = [], []
        for cid, entry in sorted(self.updater.get_states().items(), key=lambda kv: repr(kv[0])):
            meta.append([cid[0], cid[1], int(entry["t"]), len(entry["state"])])
            out += download(entry["state"])
        return meta, out

    def set_states(self, header: dict, arrays: list, chunk_of: Callable[[tuple], StoredChunk]) -> None:
        """The ``set_states`` op (``load_optimizer_states``): every chunk's state,
        checked against the chunk (``chunk_of(cid)``, which raises for an unknown one)
        and the optimizer before anything changes."""
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
            chunk = chunk_of(cid)
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
