"""The server's brain: a pure state machine, requests in, replies out.

No sockets, threads or clocks: :meth:`ServerState.handle` takes one decoded
request and returns the replies it makes ready (to this sender or to others
whose requests were waiting). The I/O loop in :mod:`kvstore.server.node` feeds it.

The state validates each request and hands it to the collaborator that owns what
it acts on; every op has one handler, listed in :meth:`ServerState._handlers`:

- the chunks, where their values live and which workers finished:
  :class:`~kvstore.server.chunks.ChunkTable`;
- the consistency mode, a strategy chosen by name at ``configure``
  (kvstore.server.modes; what the mode allows is asked of its
  :class:`~kvstore.modes.ConsistencyMode`, never which mode it is, and the job's
  mode and ranks are one :class:`~kvstore.server.modes.Job` that the row tables
  read too): ``sync`` merges pushes into rounds applied once
  (kvstore.server.sync, with co-located workers writing into the sums:
  kvstore.server.write_in), ``async`` applies each push on arrival
  (kvstore.server.asyncmode), ``ssp`` too, holding reads within a staleness bound
  (kvstore.server.ssp);
- row-sparse tables: kvstore.server.tables; dynamic rows (created on first push,
  evicted): kvstore.server.dyntables;
- the optimizer and its state: kvstore.server.server_optimizer; checkpoints as
  data: kvstore.server.snapshot;
- an elastic job's members: kvstore.server.members; rounds that wait long:
  kvstore.server.stalls;
- replicated servers (``KVSTORE_REPLICAS=1``): the replication strategy beside the
  mode, the primary's side (:class:`~kvstore.server.replication.Replication`: what
  the backup must apply) and the backup's (:class:`~kvstore.server.replication.Replicas`:
  the replicas it holds, promoted into this table when their primary dies).
"""

from __future__ import annotations

from collections.abc import Callable

from .. import compression as _compression
from .. import precision as _precision
from ..errors import InvalidArgumentError, KVStoreError, ProtocolError
from ..modes import ConsistencyMode
from ..protocol import chunk_label, error_header, ops
from ..rows import lazy
from .backend import HostBackend
from .budget import MemoryBudget
from .chunks import ChunkTable
from .members import Members
from .consistency import Consistency
from .modes import MODES, Job
from . import snapshot as _snapshot
from .server_optimizer import ServerOptimizer
from .replication import OPTIMIZER, OPTIMIZER_FIELDS, SETUP, Replicas, Replication
from .reply_precision import ReplyPrecision
from .requests import chunk_ids, ok
from .rounds import StoredChunk, Reply, is_int, speaks_for
from .stalls import StallInspector
from .tables import RowTables
from .dyntables import DynTables


class ServerState:
    """State of one server: its chunks, the mode, the optimizer.

    Example::

        s = ServerState(name="server 0")
        replies = s.handle(peer, {"op": "configure", "id": 1, "src": 0,
                                  "mode": "sync", "num_workers": 2}, [])
    """

    def __init__(self, name: str = "server", alloc=None, write_in: bool = False, shared=None,
                 backend=None, budget: MemoryBudget | None = None):
        self.name = name
        # what requests may make this server hold (KVSTORE_SERVER_MEMORY; kvstore.server.budget)
        self.budget = budget or MemoryBudget(None)
        # where values, sums and optimizer state live (kvstore.server.backend): host
        # memory from alloc(size, dtype) (the node passes shared memory) and
        # shared(array) -> whether co-located workers can map it; or one GPU
        self.backend = backend or HostBackend(alloc, shared)
        self.write_in = write_in           # sums lie in memory co-located workers can map
        self.table = ChunkTable(name, self.backend)
        self.job = Job()                   # the mode (kvstore.modes) and worker ranks, as configured or restored
        self.consistency: Consistency | None = None   # the mode's strategy (kvstore.server.modes)
        self.optimizer = ServerOptimizer()  # the optimizer and its state (kvstore.server.server_optimizer)
        self.members = Members()           # an elastic job's members (set_members)
        # row-sparse keys (kvstore.server.tables) and dynamic rows (kvstore.server.dyntables)
        self.rows = RowTables(self.table, self.job, self.optimizer, self.members, self.budget)
        self.dyn = DynTables(self.table, self.job, self.optimizer, self.members, self.budget)
        self.stalls = StallInspector()
        # reads answered in float16/bfloat16 (reply_precision; kvstore.server.reply_precision)
        self.reply_precision = ReplyPrecision(self.table, self.budget)
        # replicated servers (kvstore.server.replication): what this server's backup must
        # apply, and the replicas this server holds for others (both idle unless set up)
        self.replication = Replication()
        self.replicas = Replicas(name, self.optimizer, self.table.alloc, self.budget)
        self.rows.replication = self.dyn.replication = self.replication
        self._adopted: set = set()         # promoted chunks whose init may come again (re-sent)
        self._optimizer_calls: dict = {}   # worker -> its last numbered set_optimizer applied here
        # the shares of dead servers this one serves now: their chunks (promoted, or
        # inited here since, by a request naming the ``share``), saved as those servers' parts
        self.served: dict[int, set] = {}
        self.meta: dict = {}               # carried by the checkpoint this state came from
        self.resumed = False
        self.resumed_from: tuple = (None, 0)   # (checkpoint id, step) of that checkpoint
        self._handle_op = self._handlers()

    def _handlers(self) -> dict[str, Callable[[object, dict, list], list[Reply]]]:
        handlers = {
            ops.CONFIGURE: self._on_configure,
            ops.INIT: self._on_init,
            ops.PUSH: self._on_push,
            ops.PUSHPULL: self._on_push,        # a push answered with the values after its round
            ops.PULL: self._on_pull,
            ops.WRITE: self._on_write,
            ops.WRITTEN: self._on_written,
            ops.INIT_ROWS: self._on_init_rows,
            ops.PUSH_ROWS: self.rows.on_push,
            ops.PULL_ROWS: self.rows.on_pull,
            ops.SET_ROWS: self.rows.on_set,
            ops.INIT_DYN: self._on_init_dyn,
            ops.PUSH_DYN: self.dyn.on_push,
            ops.PULL_DYN: self.dyn.on_pull,
            ops.DYN_STATS: self.dyn.on_stats,
            ops.APPLY_NORMS: self._on_apply_norms,
            ops.REPLICATE: self._on_replicate,
            ops.SET_OPTIMIZER: self._on_set_optimizer,
            ops.GET_STATES: self._on_get_states,
            ops.SET_STATES: self._on_set_states,
            ops.GET_META: self._on_get_meta,
            ops.CHECKPOINT: self._on_checkpoint,
            ops.CHECKPOINT_COMMIT: self._on_checkpoint,
            ops.CHECKPOINT_LIST: self._on_checkpoint,
            ops.CHECKPOINT_RESTORE: self._on_checkpoint,
        }
        assert set(handlers) == ops.REQUESTS, set(handlers) ^ ops.REQUESTS
        return handlers

    # -- entry point -----------------------------------------------------------
    def handle(self, peer, header: dict, arrays: list) -> list[Reply]:
        """Process one request; return the replies now ready. Never raises for bad
        input: an invalid request gets an error reply and changes nothing."""
        replies = self._handle(peer, header, arrays)
        return self._narrowed(replies) if self.reply_precision.waiting else replies

    def _narrowed(self, replies: list[Reply]) -> list[Reply]:
        """Replies to reads that asked for float16/bfloat16 values, rounded (on the backend's device)."""
        with self.backend.scope():
            return self.reply_precision.narrowed(replies)

    def _handle(self, peer, header: dict, arrays: list) -> list[Reply]:
        req_id = header.get("id")
        try:
            if not is_int(req_id):
                raise ProtocolError("request has no integer 'id'")
            op = header["op"]
            handler = self._handle_op.get(op) if isinstance(op, str) else None
            if handler is None:
                raise ProtocolError(f"unknown op {op!r}")
            # (a checkpoint carries the mode, not dist_ssp's bound: that comes with configure)
            # (a replacement server is configured by its primaries' rebuild: replicate)
            if (op not in (ops.CONFIGURE, ops.REPLICATE) and self.mode is None) or \
                    (self.consistency is None and op in (ops.PUSH, ops.PULL, ops.PUSHPULL)):
                raise InvalidArgumentError("server is not configured yet (no store has connected)")
            if op in ops.PUSHING:            # a worker that left, or joined and is no member yet
                self.members.refuse(header.get("src"))
            with self.backend.scope():
                return handler(peer, header, arrays)
        except KVStoreError as e:
            return [Reply(peer, error_header(req_id, type(e).__name__, str(e)))]
        except (KeyError, TypeError, ValueError, IndexError, ArithmeticError, RecursionError) as e:
            # a structurally valid message whose fields are wrong
            return [Reply(peer, error_header(req_id, "ProtocolError", f"malformed {header.get('op')!r} "
                                             f"request: {type(e).__name__}: {e}"))]

    @property
    def chunks(self) -> dict[tuple, StoredChunk]:
        return self.table.chunks

    @property
    def updater(self):
        """The optimizer's :class:`~kvstore.optimizer.Updater`, None until set_optimizer."""
        return self.optimizer.updater

    @property
    def mode(self) -> ConsistencyMode | None:
        """The consistency mode (kvstore.modes), as configured or restored; None before."""
        return self.job.mode

    @property
    def num_workers(self) -> int | None:
        """The worker ranks, as configured or restored; None before."""
        return self.job.num_workers

    @property
    def _mode_name(self) -> str:
        return self.mode.name if self.mode is not None else "no mode"

    def worker(self, header: dict) -> int:
        """The sender's worker rank, checked against the configured ranks."""
        return self.job.worker(header)

    # -- the job's shape ----------------------------------------------------------------
    def _on_configure(self, peer, header, arrays):
        mode, workers, bound = header["mode"], header["num_workers"], header.get("staleness")
        strategy = MODES.get(mode) if isinstance(mode, str) else None
        bounded = strategy is not None and strategy.mode.bounded
        if strategy is None or not is_int(workers) or workers < 1 \
                or bounded != (is_int(bound) and bound >= 1):   # ssp: 1 <= staleness < inf
            raise InvalidArgumentError(f"bad configuration mode={mode!r} num_workers={workers!r}"
                                       + (f" staleness={bound!r}" if "staleness" in header else ""))
        now, was_mode = self.consistency, self.mode
        if (was_mode is not None and (was_mode, self.num_workers) != (strategy.mode, workers)) or \
                (now is not None and now.bound != (bound if bounded else None)):
            was = f" (staleness {now.bound})" if now is not None and now.bound is not None else ""
            raise InvalidArgumentError(f"{self.name} already runs in {was_mode and was_mode.name} mode{was} for "
                                       f"{self.num_workers} workers; cannot switch to {mode}/{workers}"
                                       + (f" (staleness {bound})" if bounded else ""))
        ordered = header.get("deterministic", False)   # sums in rank order (kvstore.server.sync)
        if not isinstance(ordered, bool):
            raise ProtocolError(f"'deterministic' must be true or false, got {ordered!r}")
        # a resumed server was configured by its checkpoint, which does not say how it summed
        fresh = now is None or (self.resumed and now.ordered != ordered
                                and not any(c.rounds for c in self.table.chunks.values()))
        if now is not None and not fresh and now.ordered != ordered:
            raise InvalidArgumentError(f"{self.name} already sums {'in rank order' if now.ordered else 'in arrival order'}"
                                       f"; cannot switch to deterministic={ordered}")
        pending = self.members.pending     # given by set_members before this configure
        if pending is not None:
            self.members.check(pending[1], workers)
            self.members.pending = None
        if fresh:                          # also after a resume: ssp clocks start at 0
            self._configure(strategy, workers, bound if bounded else None, ordered)
        return [ok(peer, header["id"])] + (self.set_members(*pending) if pending else [])

    def _configure(self, strategy: type[Consistency], workers: int, bound: int | None,
                   ordered: bool = False) -> None:
        self.consistency = strategy(self.table, workers, self.members, self.optimizer, bound, ordered)
        self.consistency.replication = self.replication
        self.job.mode, self.job.num_workers = strategy.mode, workers

    # -- dense chunks ---------------------------------------------------------------------
    def _on_init(self, peer, header, arrays):
        ids = chunk_ids(header, arrays)
        if self._adopted.intersection(ids):
            # (replicated servers) an init the dead primary applied, and its replica holds,
            # sent again by a worker it had not answered: the replica's value stays
            again = [cid in self._adopted for cid in ids]
            self.table.existing([c for c, a in zip(ids, again) if a], [x for x, a in zip(arrays, again) if a])
            self._adopted.difference_update(ids)
            ids, arrays = [c for c, a in zip(ids, again) if not a], [x for x, a in zip(arrays, again) if not a]
        share = self._share(header)      # (replicated servers) a dead server's share, served here
        fresh = {cid: a.nbytes for cid, a in zip(ids, arrays) if cid not in self.table.chunks}
        what = f"init of {len(fresh)} chunk(s) ({', '.join(map(chunk_label, list(fresh)[:3]))}" \
               f"{', ...' if len(fresh) > 3 else ''}) on {self.name}"
        with self.budget.holding(sum(fresh.values()), what):
            self.table.init(ids, arrays)
        if share is not None:            # a dead server's share: saved as its part
            self.served[share].update(fresh)
        # (replicated to the share's backup: a replacement's, for a dead server's share)
        self.replication.initialized(list(fresh), [self.table.chunks[cid].value for cid in fresh], share=share)
        return [ok(peer, header["id"])]

    def _on_init_rows(self, peer, header, arrays):
        return self._init_table(self.rows, peer, header, arrays)

    def _on_init_dyn(self, peer, header, arrays):
        return self._init_table(self.dyn, peer, header, arrays)

    def _init_table(self, tables: RowTables, peer, header, arrays):
        """``init_rows`` / ``init_dyn``: a row table of ``tables`` (the row-sparse ones or
        the dynamic ones) made here; for a dead server's share, saved as its part."""
        share = self._share(header)
        cid = tables.chunk_of(header)
        if share is not None and cid in self._adopted:
            # an init the dead primary applied, and its replica holds, sent again by a
            # worker it had not answered: the replica's table stays
            self._adopted.discard(cid)
            return [ok(peer, header["id"])]
        replies = tables.init_table(peer, header, arrays, share=share)
        if share is not None:
            self.served[share].add(cid)
        return replies

    def _share(self, header) -> int | None:
        """An init's ``share`` (replicated servers: the dead server whose share it is
        for, served here now), or None; InvalidArgumentError for one not served here."""
        share = header.get("share")
        if share is not None and not (is_int(share) and share in self.served):
            raise InvalidArgumentError(f"init for server {share!r}'s share: {self.name} does not serve it "
                                       f"(it serves {sorted(self.served) or 'no other server'}'s)")
        return share

    def _on_push(self, peer, header, arrays):
        """A push, or a pushpull (``want_values``: answered with the values after its round)."""
        strategy = self.consistency
        assert strategy is not None and self.num_workers is not None
        want_values = header["op"] == ops.PUSHPULL
        worker = self.worker(header)
        group = speaks_for(header, worker, self.num_workers, strategy.mode)   # a host's sum (hostreduce)
        for rank in group or ():
            self.members.refuse(rank)
        ids = chunk_ids(header, arrays)
        rounds = self._round_numbers(header, ids)
        norms = self._layerwise(header, want_values, group)
        if header.get("compression") is not None:
            config = _compression.validate(header["compression"])
            for cid in ids:
                if self.table.existing([cid])[0].value.dtype.kind != "f":
                    raise InvalidArgumentError(f"{chunk_label(cid)} is not floating-point: "
                                               "gradient compression applies to float values only")
            arrays = [_compression.decompress(config, a, c.value.size, c.value.dtype)
                      for a, c in zip(arrays, self.table.existing(ids))]
        if header.get("precision") is not None:     # float16/bfloat16 for float32 keys (kvstore.precision)
            if header.get("compression") is not None:
                raise ProtocolError("a push is either compressed or in low precision, not both")
            names = _precision.parse(header["precision"], len(ids))
            arrays = [a if name is None else _precision.widen(name, a, c.value.size, chunk_label(cid), c.value.dtype)
                      for name, a, cid, c in zip(names, arrays, ids, self.table.existing(ids))]
        chunks = self.table.existing(ids, arrays)
        rows = self._lazy_rows(header, ids, chunks)
        strategy.admit(worker, ids, want_values)
        if self.updater is not None:
            for cid, chunk in zip(ids, chunks):
                if chunk.value.dtype.kind != "f":
                    raise InvalidArgumentError(f"{chunk_label(cid)} holds {chunk.value.dtype.name}: "
                                               "optimizers update floating-point values only")
        self.reply_precision.expect(peer, header, ids, chunks)      # (the last check)
        # validated: now the buffers may move to where the values are (a no-op on the host)
        arrays = [self.backend.upload(a) for a in arrays]
        # (rows only when the push has them: a strategy without lazy updates need not take them)
        return strategy.push(peer, header["id"], worker, ids, chunks, arrays, want_values, group, norms,
                             **({} if rows is None else {"rows": rows}),
                             **({} if rounds is None else {"rounds": rounds}))

    def _round_numbers(self, header, ids) -> list | None:
        """A push's ``rounds`` field (replicated servers: the worker's number of this
        push of each chunk, 1, 2, ...), or None without it."""
        rounds = header.get("rounds")
        if rounds is None:
            return None
        if not (isinstance(rounds, list) and len(rounds) == len(ids) and all(is_int(n) and n >= 1 for n in rounds)):
            raise ProtocolError("'rounds' must be a list of round numbers >= 1, one per chunk")
        return rounds

    @staticmethod
    def _lazy_rows(header, ids, chunks) -> list | None:
        """A push's ``rows`` field (kvstore.rows.lazy): per chunk, the values of the rows
        its row-sparse push named (a bool mask; None: a dense chunk, every value), for
        the optimizer's lazy update; None without the field."""
        field = header.get("rows")
        if field is None:
            return None
        if not isinstance(field, list) or len(field) != len(ids):
            raise ProtocolError("'rows' must be a list with one entry (or null) per chunk")
        return [None if f is None else lazy.parse(f, c.value.size, chunk_label(cid))
                for cid, f, c in zip(ids, field, chunks)]

    def _layerwise(self, header, want_values: bool, group) -> bool:
        """Whether a push asks for two-phase rounds (``norms``: its chunks are of keys cut
        over servers, under an optimizer whose step needs the whole key's norms)."""
        norms = header.get("norms", False)
        if not isinstance(norms, bool):
            raise ProtocolError("'norms' must be true or false")
        if not norms:
            return False
        if want_values or group is not None:
            raise ProtocolError("a layer-wise push (norms) is a plain push from one worker: its reply "
                                "carries its chunks' terms; pull (or apply_norms) for the values")
        self._splitting_norms()
        if self.replication.active:
            raise InvalidArgumentError("two-phase pushes (norms across servers: LARS, LAMB on keys cut over "
                                       "servers, or a torch twin's clip_grad_norm / grad_scale) are not "
                                       "replicated yet: unset KVSTORE_REPLICAS")
        if self.updater is None or not self.updater.optimizer.splits_norms:
            raise InvalidArgumentError("a layer-wise push (norms) needs an optimizer that splits its update "
                                       "by norms (LARS, LAMB): call set_optimizer() first")
        return True

    def _on_apply_norms(self, peer, header, arrays):
        if arrays:
            raise ProtocolError("apply_norms carries no buffers: its sums are in the header")
        strategy = self._splitting_norms()
        self.worker(header)
        ids = chunk_ids(header, None)
        values = header.get("values", False)
        if not isinstance(values, bool):
            raise ProtocolError("'values' must be true or false")
        return strategy.apply_norms(peer, header["id"], ids, self.table.existing(ids), header.get("sums"),
                                    header.get("rounds"), values)

    def _splitting_norms(self) -> Consistency:
        """The strategy, if its mode adds up layer-wise norms across servers."""
        strategy = self.consistency
        if strategy is None or not strategy.mode.split_norms:
            raise InvalidArgumentError(f"norms across servers are for dist_sync; {self.name} runs "
                                       f"dist_{self._mode_name}")
        return strategy

    def _on_pull(self, peer, header, arrays):
        assert self.consistency is not None
        if arrays:
            raise ProtocolError("a pull carries no buffers")
        worker = self.worker(header)
        ids = chunk_ids(header, None)
        chunks = self.table.existing(ids)
        self.reply_precision.expect(peer, header, ids, chunks)
        return self.consistency.pull(peer, header["id"], worker, ids, chunks)

    # -- writing in (kvstore.server.write_in) -----------------------------------------------
    def _write_in(self, header, arrays, what: str) -> Consistency:
        if arrays:
            raise ProtocolError(f"a {what} request carries no buffers")
        strategy = self.consistency
        allowed = strategy if strategy is not None and strategy.mode.write_in else None
        if what == ops.WRITE:
            if not self.write_in:
                raise InvalidArgumentError(f"{self.name} keeps its sums in private memory: workers "
                                           "cannot write into them (push instead)")
            if allowed is None or header.get("compression") is not None:
                raise InvalidArgumentError("writing in is for uncompressed dist_sync pushes only")
            if allowed.ordered:
                raise InvalidArgumentError(f"{self.name} adds a round's pushes in rank order (deterministic "
                                           "sums): workers push instead of writing into its sums")
        if allowed is None:
            raise ProtocolError(f"'{what}' names no write granted: {self.name} runs dist_{self._mode_name}")
        return allowed

    def _on_write(self, peer, header, arrays):
        return self._write_in(header, arrays, ops.WRITE).write(peer, header)

    def _on_written(self, peer, header, arrays):
        return self._write_in(header, arrays, ops.WRITTEN).written(peer, header)

    # -- the optimizer, its state, checkpoints ------------------------------------
    def _on_set_optimizer(self, peer, header, arrays):
        if self._set_optimizer(header, header["src"]):
            # (replicated servers) a backup that is a replacement gets set_optimizer from
            # no worker: the primary forwards it (a numbered call is applied once)
            self.replication.optimizer_set({k: header[k] for k in OPTIMIZER_FIELDS if k in header}
                                           | {"caller": header["src"]})
        return [ok(peer, header["id"])]

    def _set_optimizer(self, fields: dict, caller) -> bool:
        """``set_optimizer``'s fields from worker ``caller``; a numbered one (``call``:
        the worker's count of its set_optimizer calls) that was applied here already
        (sent directly and forwarded by a primary, replicated servers) is not applied
        again. Returns whether it was applied now (and was numbered)."""
        call = fields.get("call")
        if call is not None and not (is_int(call) and call >= 1 and is_int(caller) and caller >= 0):
            raise ProtocolError(f"'call' must be a positive count of a worker's set_optimizer calls, got {call!r}")
        if call is not None and self._optimizer_calls.get(caller, 0) >= call:
            return False
        before = self.updater
        self.optimizer.set(fields)
        if self.updater is not before:          # a new optimizer: fresh state (replicas' too)
            self.dyn.optimizer_changed(True, 1.0)
            self.replicas.dyn.optimizer_changed(True, 1.0)
        elif fields.get("keep_state"):          # new hyper-parameters, state kept (maybe scaled)
            self.dyn.optimizer_changed(False, float(fields.get("state_scale", 1.0)))
            self.replicas.dyn.optimizer_changed(False, float(fields.get("state_scale", 1.0)))
        if call is None:
            return False
        self._optimizer_calls[caller] = call
        return True

    def _on_get_states(self, peer, header, arrays):
        meta, out = self.optimizer.get_states(lambda states: self.backend.download(states, copy=True))
        return [ok(peer, header["id"], out, states=meta)]

    def _on_set_states(self, peer, header, arrays):
        self.optimizer.set_states(header, arrays, lambda cid: self.table.existing([cid], rows_too=True)[0])
        # replicated servers: the backup sets the same state on its replicas before the reply leaves
        self.replication.states_set(header["states"], arrays)
        return [ok(peer, header["id"])]

    def _on_get_meta(self, peer, header, arrays):
        return [ok(peer, header["id"], meta=self.meta, resumed=self.resumed,
                   checkpoint=self.resumed_from[0], step=self.resumed_from[1])]

    def _on_checkpoint(self, peer, header, arrays):
        # a node with KVSTORE_CHECKPOINT_DIR serves the checkpoint ops itself
        # (kvstore.server.checkpoint_ops); they reach the state machine only without one
        raise InvalidArgumentError("this server cannot write checkpoints (it has no checkpoint "
                                   "directory): set KVSTORE_CHECKPOINT_DIR for the job")

    def snapshot(self, meta: dict, share: int | None = None) -> dict:
        """Everything acknowledged so far (kvstore.server.snapshot): values after
        their last applied round, the optimizer and its state. Replicated servers:
        the chunks of this server's own share, or (``share``) those of a dead
        server's share it serves now (that server's part of a checkpoint); never
        the replicas it holds."""
        chunks = self.table.chunks
        foreign = set().union(*self.served.values()) if self.served else set()
        if share is not None:
            chunks = {cid: chunks[cid] for cid in self.served[share] if cid in chunks}
        elif foreign:
            chunks = {cid: c for cid, c in chunks.items() if cid not in foreign}
        ours = (lambda cid: cid in self.served[share]) if share is not None else (lambda cid: cid not in foreign)
        return _snapshot.take(self.name, self.mode and self.mode.name, self.num_workers, chunks,
                              self.optimizer, self.backend.to_numpy, meta, self.dyn.snapshot(ours))

    def restore(self, snap: dict) -> None:
        """Start from a checkpoint: the next init of a restored chunk keeps the
        restored value, and a set_optimizer with the same optimizer keeps its state."""
        def upload(host, out):
            with self.backend.scope():
                self.backend.upload(host, out=out)
        restored = _snapshot.load(snap, self.optimizer, self.table.alloc, upload)
        self.table.restore(restored.chunks)
        self.budget.count(sum(c.value.nbytes for c in restored.chunks.values()))
        self.dyn.restore(restored.dyn_tables)
        strategy = None if restored.mode is None else MODES[restored.mode]
        self.job.mode = None if strategy is None else strategy.mode
        self.job.num_workers = restored.num_workers
        if strategy is not None and restored.num_workers is not None \
                and not strategy.mode.bounded:   # dist_ssp's bound comes with the next configure
            self._configure(strategy, restored.num_workers, None)
        self.meta, self.resumed, self.resumed_from = restored.meta, True, restored.checkpoint
        # replicated servers: the backup rebuilds its replicas from the restored values and
        # optimizer state (sent with this server's next event: every server has restored
        # by then, since the leading worker waits for all restores before anything else)
        ids = list(restored.chunks)
        if self.replication.active:
            self.replication.initialized(ids, [self.backend.to_numpy(restored.chunks[cid].value) for cid in ids])
        if self.replication.active and self.updater is not None:
            states = self.updater.get_states()
            kept = [cid for cid in ids if cid in states]
            self.replication.states_set(
                [[cid[0], cid[1], int(states[cid]["t"]), len(states[cid]["state"])] for cid in kept],
                [self.backend.to_numpy(a) for cid in kept for a in states[cid]["state"]])

    # -- replicated servers (kvstore.server.replication) ---------------------------------
    def _on_replicate(self, peer, header, arrays):
        """A primary's ``replicate``: its rounds and inits applied to the replicas
        (kvstore.server.replication.Replicas), or a rebuild's ``setup``: a replacement
        server takes the job's mode and optimizer from its first primary."""
        if header.get("kind") == OPTIMIZER:       # a worker's set_optimizer, forwarded
            self.replicas.share_of(header)
            self._set_optimizer(header, header.get("caller"))
            return [ok(peer, header["id"])]
        if header.get("kind") != SETUP:
            if self.mode is None:
                raise InvalidArgumentError("server is not configured yet (a replica's rebuild starts with its setup)")
            return self.replicas.on_replicate(peer, header, arrays)
        self.replicas.share_of(header)
        calls = header.get("calls", [])
        if not (isinstance(calls, list) and all(isinstance(c, list) and len(c) == 2 and all(
                is_int(x) and x >= 0 for x in c) for c in calls)):
            raise ProtocolError("'calls' must be a list of [worker, its last set_optimizer call]")
        mode, workers, ordered, config = header["mode"], header["num_workers"], header["deterministic"], \
            header.get("optimizer")
        strategy = MODES.get(mode) if isinstance(mode, str) else None
        bound = header.get("staleness")
        if strategy is None or strategy.mode.bounded != (is_int(bound) and bound >= 1) or not is_int(workers) \
                or workers < 1 or not isinstance(ordered, bool) or not (config is None or isinstance(config, dict)):
            raise ProtocolError(f"a replica's setup needs mode (sync, async, or ssp with its staleness), "
                                f"num_workers, deterministic and optimizer; got {mode!r}, {workers!r}, {ordered!r}"
                                + (f", staleness {bound!r}" if "staleness" in header else ""))
        now = self.consistency
        if now is not None and (self.mode, self.num_workers, now.ordered, now.bound) != \
                (strategy.mode, workers, ordered, bound):
            was, wants = (f" (staleness {b})" if b is not None else "" for b in (now.bound, bound))
            raise InvalidArgumentError(f"{self.name} runs dist_{self._mode_name}{was} for {self.num_workers} "
                                       f"workers; server {header['src']} replicates dist_{mode}{wants} for {workers}")
        current = self.optimizer.config()
        if config is not None and current is not None and current != config:
            raise InvalidArgumentError(f"{self.name} holds replicas with optimizer {current.get('name')!r}; "
                                       f"server {header['src']} replicates with {config.get('name')!r}")
        if now is None:
            self._configure(strategy, workers, bound, ordered)
        if config is not None and current is None:
            self.optimizer.set({"optimizer": config})
        for worker, call in calls:                 # the calls that config includes: not applied again
            self._optimizer_calls[worker] = max(call, self._optimizer_calls.get(worker, 0))
        return [ok(peer, header["id"])]

    def rebuild(self, share: int | None) -> int:
        """(Replicated servers) the backup of ``share`` (None: this server's own) is a
        replacement: queue everything it must hold, as of now, before any later round
        (kvstore.server.replication.Replication.rebuild): the mode and optimizer, every
        chunk's value with the rounds applied to it, their optimizer state, every dynamic table as it is
        (kvstore.server.dyn_replicas). Returns how many chunks and tables."""
        foreign = set().union(*self.served.values()) if self.served else set()
        if share is None:
            ids = [cid for cid in self.table.chunks if cid not in foreign]
            dyn = [cid for cid in self.dyn.tables if cid not in foreign]
        else:
            ids = [cid for cid in self.served.get(share, ()) if cid in self.table.chunks]
            dyn = [cid for cid in self.served.get(share, ()) if cid in self.dyn.tables]
        strategy = self.consistency
        setup = {"mode": self._mode_name, "num_workers": self.num_workers,
                 **({} if strategy is None or strategy.bound is None else {"staleness": strategy.bound}),
                 "deterministic": bool(strategy is not None and strategy.ordered),
                 "optimizer": self.optimizer.config(),
                 "calls": [[w, c] for w, c in sorted(self._optimizer_calls.items())]}
        chunks: list[tuple] = []
        for cid in ids:
            value = self.backend.to_numpy(self.table.chunks[cid].value)
            if cid in self.table.row_tables:
                rounds, bases = self.rows.applied(cid)
                chunks.append((cid, value, self.rows.table_of(cid), rounds, bases))
            else:
                rounds, last = strategy.applied(cid) if strategy is not None else (0, {})
                chunks.append((cid, value, None, rounds, last))
        self.replication.rebuild(share, setup, chunks)
        self.dyn.rebuilt(dyn, share)           # dynamic tables: each as it is now (kvstore.server.dyn_replicas)
        if self.updater is not None:
            states = self.updater.get_states()
            kept = [cid for cid in ids if cid in states]
            self.replication.states_set(
                [[cid[0], cid[1], int(states[cid]["t"]), len(states[cid]["state"])] for cid in kept],
                [self.backend.to_numpy(a) for cid in kept for a in states[cid]["state"]])
        return len(ids) + len(dyn)

    def promote(self, primary: int) -> list[Reply]:
        """Server ``primary`` died and this server serves its chunks now: the replicas
        join this table with their round counts (the next push of each is numbered
        one more). Returns the replies now ready (none: nothing waits on them yet)."""
        adopted = self.replicas.promote(primary)
        for cid, (value, rounds, last, table) in adopted.items():
            if table is not None:        # a row-sparse table (kvstore.server.tables)
                self.rows.adopt(cid, value, table, rounds, last)
        tables = self.replicas.dyn.promote(primary)
        for cid, replica in tables.items():   # dynamic rows (kvstore.server.dyntables)
            self.dyn.adopt_table(cid, replica.rows, replica.servers, replica.rounds, replica.bases)
        dense = {cid: entry for cid, entry in adopted.items() if entry[3] is None}
        self.table.chunks.update({cid: StoredChunk(value) for cid, (value, _, _, _) in dense.items()})
        self._adopted |= set(adopted) | set(tables)
        self.served.setdefault(primary, set()).update(adopted, tables)
        self.replication.adopted([*adopted, *tables], primary)
        if self.consistency is not None:
            for cid, (_, rounds, last, _) in dense.items():
                self.consistency.adopt(cid, rounds, last)
        return []

    # -- what the scheduler reports ------------------------------------------------------
    def workers_finished(self, ranks) -> list[Reply]:
        """The scheduler says these workers finished (closed their stores). In sync
        mode every round still waiting for one of them can never complete: the
        requests that depend on such a round fail now, naming that worker, and so
        does every later push (in ssp mode: every read that waits for one of them).
        Returns the replies."""
        new = set(ranks) - self.table.gone
        if not new:
            return []
        self.table.gone |= new
        if self.consistency is None:
            return []
        with self.backend.scope():
            return self.reply_precision.narrowed(self.consistency.workers_finished() + self.rows.workers_finished()
                                                 + self.dyn.workers_finished())

    def set_members(self, epoch: int, ranks) -> list[Reply]:
        """The elastic job's members as of ``epoch`` (the scheduler's count of changes;
        an epoch not newer than the last is ignored). Returns the replies now ready.

        A worker that left is counted, contributing nothing, in every queued round it
        has not pushed to, of every chunk and table; the rounds that complete so are
        applied and answered. Its pushes already in rounds count; its requests still
        parked are answered with an error naming it. A worker that became a member
        (the scheduler does it at a barrier, when no round is in flight) is waited for
        by every round opened from now on. Before configure (which says how many
        ranks there are) the members are kept and applied by it.

        Raises InvalidArgumentError for members that are not worker ranks or two sets
        of members for one epoch."""
        ranks = frozenset(ranks)
        if not self.members.newer(epoch, ranks):
            return []
        if self.num_workers is None:
            self.members.pending = (epoch, ranks)
            return []
        replies = []
        before = self.members.ranks      # None: every rank (the job's first members)
        with self.backend.scope():
            for worker in sorted(ranks - before) if before is not None else ():
                self._became_member(worker)
            for worker in self.members.change(epoch, ranks, self.num_workers):
                message = f"worker {worker} left the job"
                if self.consistency is not None:
                    replies += self.consistency.left(worker, message)
                replies += self.rows.leave(worker, message)
                replies += self.dyn.leave(worker, message)
            return self.reply_precision.narrowed(replies)

    def _became_member(self, worker: int) -> None:
        """``worker`` became a member (a new process: replicated servers number its
        pushes from its join on, kvstore.server.numbering)."""
        if self.consistency is not None:
            self.consistency.became_member(worker)
        self.rows.became_member(worker)
        self.dyn.became_member(worker)
        self.replicas.became_member(worker, per_push=self.consistency is not None and not self.consistency.mode.rounds)

    def stalled(self, now: float, after: float) -> list[str]:
        """Rounds waiting longer than ``after`` seconds for some workers (each
        reported once), as readable lines naming the key and the missing workers,
        then the reads that waited as long (ssp). ``now`` comes from the caller's
        clock; a round's age counts from the first call that saw it."""
        mode = self.consistency
        if mode is None or self.num_workers is None:
            return []
        rounds = list(mode.queued_rounds()) + list(self.rows.queued_rounds()) + list(self.dyn.queued_rounds())
        return self.stalls.stalled(now, after, rounds, self.num_workers) + mode.stalled(now, after)
