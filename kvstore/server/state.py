"""The server's brain: a pure state machine, requests in, replies out.

No sockets, threads or clocks: :meth:`ServerState.handle` takes one decoded
request and returns the replies it makes ready (to this sender or to others
whose requests were waiting). The I/O loop in :mod:`kvstore.server.node` feeds it.

Synchronous mode (BSP), per chunk: pushes are merged into a round until every
worker contributed once (in an elastic job, a slot that is not a member
counts with nothing: kvstore.server.members); then the round is applied once
(assigned, or given to the optimizer) and every push that joined it is
acknowledged. A worker that
pushes again before its round completed starts the next round. A pull is
answered once the sender has no push pending on the chunk (a pushpull once its
own round is applied), so a worker always reads the result of its own last
push's round (a write it was granted, or asked for, counts as a push). If the
optimizer fails on a round, exactly the requests that depended on that round get
the error; later rounds proceed. When the scheduler reports that a worker
finished (:meth:`ServerState.workers_finished`), every round still waiting for
it fails at once naming it, and so does every later push: such a round can
never complete.

Asynchronous mode: every push is applied on arrival with the optimizer.

Bounded staleness (``ssp``, dist_ssp): pushes are applied as in async mode, and a
read waits until the slowest worker is at most ``staleness`` pushes behind the
reader on each chunk: kvstore.server.staleness.

Writing in (co-located workers adding into our sums themselves): kvstore.server.writein.
Workers that finished, elastic members that leave or join (kvstore.server.members)
and the stall inspector: kvstore.server.stalls. The optimizer and its state:
kvstore.server.optimizer_slot; checkpoints as data: kvstore.server.snapshot.
"""

from __future__ import annotations

import numpy as np

from .. import compression as _compression
from ..errors import InvalidArgumentError, KVStoreError, ProtocolError
from ..protocol import chunk_label, error_header, ops
from .backend import HostBackend
from .members import Members
from . import snapshot as _snapshot
from .optimizer_slot import ServerOptimizer
from .rounds import Chunk, Pending, Reply, Round, is_int, speaks_for
from .stalls import Stalls
from .staleness import Staleness
from .tables import RowTables
from .writein import Grant, WriteIn


class ServerState(WriteIn, Stalls):
    """State of one server: its chunks, the mode, the optimizer.

    Example::

        s = ServerState(name="server 0")
        replies = s.handle(peer, {"op": "configure", "id": 1, "src": 0,
                                  "mode": "sync", "num_workers": 2}, [])
    """

    def __init__(self, name: str = "server", alloc=None, write_in: bool = False, shared=None,
                 backend=None):
        self.name = name
        # where values, sums and optimizer state live (kvstore.server.backend): host
        # memory from alloc(size, dtype) (the node passes shared memory) and
        # shared(array) -> whether co-located workers can map it; or one GPU
        self.backend = backend or HostBackend(alloc, shared)
        self.xp = self.backend.xp
        self._alloc = self.backend.alloc
        self._shared = self.backend.shared
        self.write_in = write_in           # sums lie in memory co-located workers can map
        self._queue: list[Grant] = []     # write requests waiting for a round's writer
        self._grants: dict = {}            # (worker, write id) -> granted _Grant
        self.mode: str | None = None
        self.num_workers: int | None = None
        self.ssp: Staleness | None = None  # ssp mode: clocks and waiting reads (from configure)
        self.chunks: dict[tuple, Chunk] = {}
        self.optimizer = ServerOptimizer()  # the optimizer and its state (kvstore.server.optimizer_slot)
        self.meta: dict = {}               # carried by the checkpoint this state came from
        self.resumed = False
        self.resumed_from: tuple = (None, 0)   # (checkpoint id, step) of that checkpoint
        self._restored: set = set()        # chunk ids restored and not yet re-initialised
        self._round_seen: dict = {}        # (chunk id, id(round)) -> (first seen, reported, round)
        self._applied: dict = {}           # chunk id -> rounds applied (to name a round by number)
        self._gone: set = set()            # workers that finished: they push no more
        # requests answered with values once their other chunks are done: a chunk
        # whose round of theirs was applied keeps that value for them if a later
        # round changes it first (possible when a worker pushes again before its
        # reply, e.g. _pushpull_start then push)
        self._partial: dict = {}           # chunk id -> [Pending] done with it, not yet answered
        self._captured: dict = {}          # id(Pending) -> {chunk id: its value for it}
        self.rows = RowTables(self)        # row-sparse keys (kvstore.server.tables)
        self.members = Members()           # an elastic job's members (set_members: kvstore.server.stalls)

    # -- entry point -----------------------------------------------------------
    def handle(self, peer, header: dict, arrays: list) -> list[Reply]:
        """Process one request; return the replies now ready. Never raises for bad
        input: an invalid request gets an error reply and changes nothing."""
        req_id = header.get("id")
        try:
            if not is_int(req_id):
                raise ProtocolError("request has no integer 'id'")
            op = header["op"]
            if op not in ops.REQUESTS:
                raise ProtocolError(f"unknown op {op!r}")
            # (a checkpoint carries the mode, not dist_ssp's bound: that comes with configure)
            if (op != ops.CONFIGURE and self.mode is None) or \
                    (self.mode == "ssp" and self.ssp is None and op in (ops.PUSH, ops.PULL, ops.PUSHPULL)):
                raise InvalidArgumentError("server is not configured yet (no store has connected)")
            if op in ops.PUSHING:            # a worker that left, or joined and is no member yet
                self.members.refuse(header.get("src"))
            with self.backend.scope():
                return getattr(self, f"_on_{op}")(peer, header, arrays)
        except KVStoreError as e:
            return [Reply(peer, error_header(req_id, type(e).__name__, str(e)))]
        except (KeyError, TypeError, ValueError, IndexError, ArithmeticError, RecursionError) as e:
            # a structurally valid message whose fields are wrong
            return [Reply(peer, error_header(req_id, "ProtocolError", f"malformed {header.get('op')!r} "
                                             f"request: {type(e).__name__}: {e}"))]

    @property
    def updater(self):
        """The optimizer's :class:`~kvstore.optimizer.Updater`, None until set_optimizer."""
        return self.optimizer.updater

    # -- the optimizer, its state, checkpoints ------------------------------------
    def _on_set_optimizer(self, peer, header, arrays):
        self.optimizer.set(header)
        return [self._ok(peer, header["id"])]

    def _on_get_states(self, peer, header, arrays):
        meta, out = self.optimizer.get_states(lambda states: self.backend.download(states, copy=True))
        return [self._ok(peer, header["id"], out, states=meta)]

    def _on_set_states(self, peer, header, arrays):
        self.optimizer.set_states(header, arrays, lambda cid: self._existing([cid], rows_too=True)[0])
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

    def snapshot(self, meta: dict) -> dict:
        """Everything acknowledged so far (kvstore.server.snapshot): values after
        their last applied round, the optimizer and its state."""
        return _snapshot.take(self.name, self.mode, self.num_workers, self.chunks, self.optimizer,
                              self.backend.to_numpy, meta)

    def restore(self, snap: dict) -> None:
        """Start from a checkpoint: the next init of a restored chunk keeps the
        restored value, and a set_optimizer with the same optimizer keeps its state."""
        def upload(host, out):
            with self.backend.scope():
                self.backend.upload(host, out=out)
        restored = _snapshot.load(snap, self.optimizer, self._alloc, upload)
        self.mode, self.num_workers = restored.mode, restored.num_workers
        self.chunks = restored.chunks
        self._restored = set(self.chunks)
        self.meta, self.resumed, self.resumed_from = restored.meta, True, restored.checkpoint

    # -- helpers ------------------------------------------------------------------
    def _ok(self, peer, req_id, arrays=(), **fields) -> Reply:
        return Reply(peer, {"op": ops.OK, "id": req_id, **fields}, list(arrays))

    @staticmethod
    def _chunk_ids(header: dict, arrays: list | None) -> list[tuple]:
        raw = header["chunks"]
        if not isinstance(raw, list):
            raise ProtocolError("'chunks' must be a list")
        ids = []
        for item in raw:
            if not (isinstance(item, list) and len(item) == 2 and is_int(item[1])
                    and (is_int(item[0]) or isinstance(item[0], str))):
                raise ProtocolError(f"bad chunk id {item!r}: expected [key, index]")
            ids.append((item[0], item[1]))
        if len(set(ids)) != len(ids):
            raise ProtocolError("a chunk appears twice in one request")
        if arrays is not None and len(arrays) != len(ids):
            raise ProtocolError(f"{len(ids)} chunks but {len(arrays)} buffers")
        return ids

    def _existing(self, ids: list[tuple], arrays: list | None = None, rows_too: bool = False) -> list[Chunk]:
        """The chunks ``ids`` (checked against ``arrays``' sizes and dtypes); dense
        chunks only, unless ``rows_too`` (optimizer states cover row-sparse tables)."""
        chunks = []
        for i, cid in enumerate(ids):
            chunk = self.chunks.get(cid)
            if chunk is None:
                raise InvalidArgumentError(f"{chunk_label(cid)} is not initialised on {self.name}; "
                                           "call init() first")
            if not rows_too:
                self.rows.refuse_dense(cid)
            if arrays is not None:
                a = arrays[i]
                if a.dtype != chunk.value.dtype or a.size != chunk.value.size:
                    raise InvalidArgumentError(
                        f"{chunk_label(cid)}: got {a.size} x {a.dtype.name}, stored is "
                        f"{chunk.value.size} x {chunk.value.dtype.name}")
            chunks.append(chunk)
        return chunks

    def _worker(self, header: dict) -> int:
        src = header["src"]
        if not is_int(src) or not 0 <= src < self.num_workers:
            raise ProtocolError(f"'src' must be the sender's worker rank (0..{self.num_workers - 1}), "
                                f"got {src!r}")
        return src

    # -- ops -------------------------------------------------------------------------
    def _on_init_rows(self, peer, header, arrays):
        return self.rows.on_init(peer, header, arrays)

    def _on_push_rows(self, peer, header, arrays):
        return self.rows.on_push(peer, header, arrays)

    def _on_pull_rows(self, peer, header, arrays):
        return self.rows.on_pull(peer, header, arrays)

    def _on_set_rows(self, peer, header, arrays):
        return self.rows.on_set(peer, header, arrays)

    def _on_configure(self, peer, header, arrays):
        mode, workers, bound = header["mode"], header["num_workers"], header.get("staleness")
        if mode not in ("sync", "async", "ssp") or not is_int(workers) or workers < 1 \
                or (mode == "ssp") != (is_int(bound) and bound >= 1):   # ssp: 1 <= staleness < inf
            raise InvalidArgumentError(f"bad configuration mode={mode!r} num_workers={workers!r}"
                                       + (f" staleness={bound!r}" if "staleness" in header else ""))
        if (self.mode is not None and (self.mode, self.num_workers) != (mode, workers)) or \
                (self.ssp is not None and self.ssp.bound != bound):
            now = f" (staleness {self.ssp.bound})" if self.ssp is not None else ""
            raise InvalidArgumentError(f"{self.name} already runs in {self.mode} mode{now} for "
                                       f"{self.num_workers} workers; cannot switch to {mode}/{workers}"
                                       + (f" (staleness {bound})" if mode == "ssp" else ""))
        pending = self.members.pending     # given by set_members before this configure
        if pending is not None:
            self.members.check(pending[1], workers)
            self.members.pending = None
        self.mode, self.num_workers = mode, workers
        if mode == "ssp" and self.ssp is None:   # also after a resume: clocks start at 0
            self.ssp = Staleness(self, bound)
        return [self._ok(peer, header["id"])] + (self.set_members(*pending) if pending else [])

    def _on_init(self, peer, header, arrays):
        ids = self._chunk_ids(header, arrays)
        for cid, a in zip(ids, arrays):
            if cid in self._restored:     # resumed: the checkpoint's value wins over init's
                self._existing([cid], [a])
            elif cid in self.chunks:
                raise InvalidArgumentError(f"{chunk_label(cid)} is already initialised")
        for cid, a in zip(ids, arrays):
            if cid in self._restored:
                self._restored.discard(cid)
            else:
                value = self._alloc(a.size, a.dtype)
                self.backend.upload(a.reshape(-1), out=value)
                self.chunks[cid] = Chunk(value)
        return [self._ok(peer, header["id"])]

    def _on_push(self, peer, header, arrays, want_values=False):
        worker = self._worker(header)
        group = speaks_for(header, worker, self.num_workers, self.mode)   # a host's sum (hostreduce)
        for rank in group or ():
            self.members.refuse(rank)
        ids = self._chunk_ids(header, arrays)
        self._refuse_if_gone(worker, ids)
        if header.get("compression") is not None:
            config = _compression.validate(header["compression"])
            for cid in ids:
                if self._existing([cid])[0].value.dtype.kind != "f":
                    raise InvalidArgumentError(f"{chunk_label(cid)} is not floating-point: "
                                               "gradient compression applies to float values only")
            arrays = [_compression.decompress(config, a, c.value.size, c.value.dtype)
                      for a, c in zip(arrays, self._existing(ids))]
        chunks = self._existing(ids, arrays)
        if self.mode != "sync" and self.updater is None:
            raise InvalidArgumentError(f"dist_{self.mode} applies every push with an optimizer: "
                                       "call set_optimizer() before push")
        if self.updater is not None:
            for cid, chunk in zip(ids, chunks):
                if chunk.value.dtype.kind != "f":
                    raise InvalidArgumentError(f"{chunk_label(cid)} holds {chunk.value.dtype.name}: "
                                               "optimizers update floating-point values only")
        if self.mode == "ssp" and want_values:   # its reply would wait for a finished worker
            self.ssp.refuse_if_gone(worker, ids, ahead=1)
        # validated: now the buffers may move to where the values are (a no-op on the host)
        arrays = [self.backend.upload(a) for a in arrays]
        if self.mode == "ssp":          # a new member's clocks start at its first push
            self._started(ids, worker)
        if self.mode != "sync":
            for cid, chunk, grad in zip(ids, chunks, arrays):
                self.updater(cid, grad.reshape(-1), chunk.value)
            if self.mode == "ssp":
                return self.ssp.pushed(peer, header["id"], worker, ids, want_values)
            return [self._reply_now(peer, header["id"], chunks, want_values, copy=True)]
        if self._writes_ahead(worker, ids):
            if group is not None:    # a host's leader does not write in (kvstore.hostreduce)
                raise InvalidArgumentError(f"worker {worker} pushed a host's sum while its write was pending")
            # a write of this worker asked for earlier is not granted yet: it takes
            # its round first (kvstore.server.writein), then this push the next one
            return self._hold_push(peer, header["id"], worker, ids, chunks, arrays, want_values)
        return self._join_rounds(peer, header["id"], worker, ids, chunks, arrays, want_values, group)

    def _join_rounds(self, peer, req_id, worker, ids, chunks, arrays, want_values,
                     group: frozenset | None = None) -> list[Reply]:
        """A validated sync push (for ``group``, a host's sum) joins the rounds; the replies now ready."""
        # Park the request first: completing (or failing) the rounds below answers
        # it through the same path as everyone else waiting on those chunks.
        pending = Pending(peer, req_id, worker, ids, want_values, set(ids))
        for chunk in chunks:
            chunk.waiting.append(pending)
        ready, ranks = [], group or frozenset((worker,))
        for cid, chunk, grad in zip(ids, chunks, arrays):
            pending.rounds[cid] = self._contribute(cid, chunk, ranks, grad.reshape(-1))
            ready += self._apply_complete_rounds(cid, chunk)
        return ready

    def _on_pushpull(self, peer, header, arrays):
        return self._on_push(peer, header, arrays, want_values=True)

    def _on_pull(self, peer, header, arrays):
        if arrays:
            raise ProtocolError("a pull carries no buffers")
        worker = self._worker(header)
        ids = self._chunk_ids(header, None)
        chunks = self._existing(ids)
        if self.mode == "async":
            return [self._reply_now(peer, header["id"], chunks, True, copy=True)]
        if self.mode == "ssp":
            return self.ssp.read(peer, header["id"], worker, ids)
        pending = Pending(peer, header["id"], worker, ids, True,
                           {cid for cid, c in zip(ids, chunks)
                            if c.pending_from(worker) or self._writing(worker, cid, c)})
        if not pending.blocked:
            return [self._finish(pending)]
        for cid in pending.blocked:
            self.chunks[cid].waiting.append(pending)
        return []

    def _reply_now(self, peer, req_id, chunks, want_values, copy):
        values = self.backend.download([c.value for c in chunks], copy) if want_values else []
        return self._ok(peer, req_id, values)

    def _contribute(self, cid, chunk: Chunk, ranks: frozenset, grad: np.ndarray) -> Round:
        """Add one worker's push (``ranks``: it, or the workers a host's sum speaks
        for) to the first round none of them has contributed to.

        A round's first push is kept as it came (a view on the message, or on the
        worker's shared memory, which the worker leaves alone until the round is
        acknowledged); the second is added to it in one pass into the accumulator
        (2 reads + 1 write of the chunk instead of copy + add's 3 + 2)."""
        for rnd in chunk.rounds:
            if rnd.open_to_all(ranks):
                if rnd.writer is not None:     # a worker is writing into acc: add after it
                    rnd.deferred.append(grad)
                elif rnd.acc is None:
                    rnd.acc = self._take_spare(chunk)
                    self.xp.add(rnd.first, grad, out=rnd.acc)
                    rnd.first = None
                else:
                    rnd.acc += grad
                rnd.workers.update(ranks)
                return rnd
        rnd = self._opened(cid, chunk, None, first=grad)
        rnd.workers.update(ranks)
        return rnd

    def _take_spare(self, chunk: Chunk) -> np.ndarray:
        if chunk.spare is not None:
            acc, chunk.spare = chunk.spare, None
            return acc
        return self._alloc(chunk.value.size, chunk.value.dtype)

    def _apply_complete_rounds(self, cid, chunk: Chunk) -> list[Reply]:
        replies = []
        while chunk.rounds and len(chunk.rounds[0].workers) == self.num_workers:
            rnd = chunk.rounds.pop(0)
            self._applied[cid] = self._applied.get(cid, 0) + 1
            for waiting in self._partial.pop(cid, ()):    # the value is about to change
                if waiting.blocked:                          # (not answered yet)
                    self._captured.setdefault(id(waiting), {}).setdefault(cid, self.xp.copy(chunk.value))
            if rnd.acc is None:   # one worker: its push is the sum
                rnd.acc = self._take_spare(chunk)
                self.xp.copyto(rnd.acc, rnd.first)
                rnd.first = None
            acc = rnd.acc
            if self.updater is None:
                # no optimizer: the merged sum becomes the value; the old value
                # buffer is recycled as the next round's accumulator
                chunk.value, acc = acc, chunk.value
            else:
                try:
                    self.updater(cid, acc, chunk.value)
                except Exception as e:  # an optimizer failure must not leave workers waiting
                    message = (f"applying the optimizer to {chunk_label(cid)} failed: "
                               f"{type(e).__name__}: {e}")
                    for pending in chunk.waiting:
                        joined = pending.rounds.get(cid)
                        if joined is rnd or (joined is None and pending.worker in rnd.workers):
                            pending.error = message   # answered with it when it completes
            chunk.spare = acc
            replies += self._release(cid, chunk)
        return replies

    def _release(self, cid, chunk: Chunk) -> list[Reply]:
        """Answer the requests parked on ``chunk`` that no longer wait for it (and for
        no other chunk)."""
        replies, still = [], []
        for pending in chunk.waiting:
            if self._waits(pending, cid, chunk):
                still.append(pending)
                continue
            pending.blocked.discard(cid)
            if not pending.blocked:
                replies.append(self._finish(pending))
            elif pending.want_values:
                self._partial.setdefault(cid, []).append(pending)
        chunk.waiting = still
        return replies

    def _waits(self, pending: Pending, cid, chunk: Chunk) -> bool:
        """A push waits for its own round; a pull for every round of its worker,
        including the one a write of that worker (granted, or still queued) goes to."""
        if pending.waits_on(cid, chunk):
            return True
        return cid not in pending.rounds and self._writing(pending.worker, cid, chunk)

    def _finish(self, pending: Pending) -> Reply:
        captured = self._captured.pop(id(pending), {})
        if pending.error is not None:
            return Reply(pending.peer, error_header(pending.req_id, "RemoteError", pending.error))
        # Values are sent without a copy: in sync mode a chunk cannot change again
        # before this worker, who is blocked on this reply, pushes to it. Unless it
        # has pushed (or asked to write) again already, which a worker that did not
        # wait for this reply can (_pushpull_start, then a push): then its next round
        # may complete before the reply is read, so it gets a copy.
        values = [captured.get(cid, self.chunks[cid].value) for cid in pending.chunks] \
            if pending.want_values else []
        ahead = bool(values) and any(
            self.chunks[cid].pending_from(pending.worker) or self._writing(pending.worker, cid, self.chunks[cid])
            for cid in pending.chunks)
        return self._ok(pending.peer, pending.req_id, self.backend.download(values, copy=ahead))
