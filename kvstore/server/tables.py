"""Row-sparse tables on one server: the rows it holds of each row-sparse key, their
sync rounds and lazy updates. A collaborator of :class:`~kvstore.server.state.ServerState`
(pure as well: no sockets, threads or clocks).

A table's rows are one flat chunk ``(key, server)`` in the server's
:class:`~kvstore.server.chunks.ChunkTable` (so checkpoints, resume and optimizer
states cover it as any chunk), marked there as a row table so that dense ops
refuse to touch it, plus the :class:`Table` record here.

Sync: the pushes of one round (one from every worker; an empty one from a worker
with no rows here, and from a rank of an elastic job that is not a member:
kvstore.server.members) are merged (union of rows, duplicates summed, in worker rank
order) and applied once: lazily by the optimizer (only the merged rows and their
state change), or, without one, the merged rows are assigned their sum and every
other row keeps its value. A push is acknowledged when its round is applied; a
pull is answered once the sender's pushes here are applied. Async: each push
updates its rows on arrival (an optimizer is required, as for dense keys); with
replicated servers it is numbered per (worker, table shard) by its worker and
replicated (its rows and data, and the pusher's number) before its
acknowledgement, and one sent again after a failover whose number was applied
already is answered without being applied. The
ssp mode (dist_ssp) refuses row-sparse keys at init (its mode's ``no_rows`` says why).
What this reads of the job comes as narrow collaborators, not the server's state:
the :class:`~kvstore.server.modes.Job` (mode and ranks), the optimizer, the members
and the memory budget; with replicated servers the state also gives it its
:class:`~kvstore.server.replication.Replication` (``replication``, which collects the
rounds applied for the backup).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..rows import sparse
from ..errors import InvalidArgumentError, KVStoreError, ProtocolError
from ..protocol import chunk_label, error_header
from ..protocol.codec import ALLOWED_DTYPES
from ..rows.rowinit import RowInit
from ..rows.layout import RowLayout
from ..modes import ConsistencyMode
from .backend import HostBackend
from .budget import MemoryBudget
from .chunks import ChunkTable
from .members import Members
from .numbering import JoinBases
from .modes import Job
from .server_optimizer import ServerOptimizer
from .replication import Replication
from .requests import ok
from .rounds import StoredChunk, Reply, is_int


MAX_DIMS = 32     # dimensions of a table's shape (as of a buffer's: kvstore.protocol.codec)
ROW_LIMIT = 1 << 63   # each size of a table's shape is below it (row ids are int64)


def _dtype(name: str, cid) -> np.dtype:
    """The dtype a table declares: one of the wire's plain numeric dtypes (no object,
    string or void type, whose item size the sender would choose)."""
    try:
        dtype = np.dtype(name)
    except TypeError:
        dtype = None
    if dtype is None or dtype.str not in ALLOWED_DTYPES:
        raise ProtocolError(f"{chunk_label(cid)}: dtype {name!r} is not one of the wire's numeric dtypes")
    return dtype


@dataclass
class RowRound:
    parts: dict = field(default_factory=dict)    # worker -> (rows, data) as pushed
    acks: list = field(default_factory=list)     # (peer, request id, worker) to answer when applied
    filled: frozenset = frozenset()              # of parts: ranks counted without a push (empty)
    writer = None                                # (no write-in for rows: read by the stall inspector)
    terms = None                                 # (no layer-wise rounds for rows: likewise)

    @property
    def workers(self) -> set:
        return set(self.parts)


@dataclass
class Table:
    layout: RowLayout
    row_shape: tuple
    rounds: list = field(default_factory=list)   # queued RowRound, oldest first
    pulls: list = field(default_factory=list)    # (peer, request id, worker, local rows) parked

    def pending_from(self, worker: int) -> bool:
        return any(worker in r.parts for r in self.rounds)


class RowTables:
    """The row-sparse tables among the chunks of ``table``, for ``job`` (its mode and
    worker ranks, read when needed: configure sets them), updated by ``optimizer``
    (its updater, if set), with an elastic job's ``members`` counted in rounds and
    what init may allocate checked against ``budget``."""

    def __init__(self, table: ChunkTable, job: Job, optimizer: ServerOptimizer, members: Members,
                 budget: MemoryBudget):
        self.table = table
        self.job = job
        self.optimizer = optimizer
        self.members = members
        self.budget = budget
        self.tables: dict[tuple, Table] = {}
        # replicated servers (kvstore.server.replication): what the backup must apply, and
        # each table's rounds applied (a numbered push re-sent after a failover is not applied twice)
        self.replication = Replication()       # idle; the state gives its own
        self._applied: dict[tuple, int] = {}
        self._bases = JoinBases()      # elastic (dist_sync): where a joiner's push numbers start
        self._last: dict[tuple, dict[int, int]] = {}    # dist_async: chunk id -> {worker: its last push applied}

    # -- requests ----------------------------------------------------------------------
    def on_init(self, peer, header, arrays) -> list[Reply]:
        return self.init_table(peer, header, arrays)

    def init_table(self, peer, header, arrays, share: int | None = None) -> list[Reply]:
        """``init_rows``; ``share``: (replicated servers) the dead server whose share
        the table is of, served here now (replicated to that share's backup, if any)."""
        cid = self._cid(header)
        if not self._mode().takes_rows:
            raise InvalidArgumentError(self._mode().no_rows)
        shape, dtype = header["shape"], header["dtype"]
        servers, server = header["servers"], cid[1]
        if not (isinstance(shape, list) and shape and len(shape) <= MAX_DIMS
                and all(is_int(n) and 0 <= n < ROW_LIMIT for n in shape)
                and is_int(servers) and 0 <= server < servers and isinstance(dtype, str)):
            raise ProtocolError("init_rows needs shape (a list of sizes), dtype and servers")
        dtype = _dtype(dtype, cid)
        width = math.prod(shape[1:])         # Python ints: a declared shape cannot wrap
        layout = RowLayout(shape[0], width, server, servers)
        size = layout.local_rows * width
        restored = cid in self.table.restored
        # counted before anything is allocated (a restored table is counted already); a
        # GPU server's rows are built on the host first
        nbytes = 0 if restored else size * dtype.itemsize
        staged = 0 if isinstance(self.table.backend, HostBackend) else nbytes
        what = f"init_rows of {chunk_label(cid)} (shape {shape}, {dtype.name}: {size:,} values on {self.table.name})"
        self.budget.check(nbytes + staged, what)
        rows, data = self._rows_data(cid, layout, arrays, dtype)
        replicated = self.replication.active
        spec = None if header.get("init") is None else RowInit.from_wire(header["init"])
        if spec is not None and math.prod(spec.shape[1:]) != width:
            raise InvalidArgumentError(f"{chunk_label(cid)}: its initializer is for rows of {spec.shape[1:]}, "
                                       f"the table's rows are {tuple(shape[1:])}")
        if not restored and cid in self.table.chunks:
            raise InvalidArgumentError(f"{chunk_label(cid)} is already initialised")
        if restored:             # resumed: the checkpoint's rows win over init's
            value = self.table.chunks[cid].value
            if value.size != size or value.dtype != dtype:
                raise InvalidArgumentError(f"{chunk_label(cid)}: the checkpoint holds {value.size} x "
                                           f"{value.dtype.name}, init asks for {size} x {dtype.name}")
            self.table.restored.discard(cid)
            if replicated:       # the replica (rebuilt with the restore) learns it is a row table
                self.replication.initialized([cid], [self.table.backend.to_numpy(value)], [[list(shape), servers]],
                                             share)
        else:
            with self.budget.holding(nbytes, what):
                value = self.table.alloc(size, dtype)
                # values in host memory are filled where they lie: a table as big as this
                # server's memory allows is not built twice (a staging copy, then the value)
                in_place = isinstance(self.table.backend, HostBackend)
                host = value.reshape(layout.local_rows, width) if in_place else np.empty((layout.local_rows, width), dtype)
                if spec is not None:       # (its rows as a range: no array of every row id)
                    spec.fill(host, range(server, shape[0], servers))
                else:
                    host[...] = 0
                host[layout.local(rows, chunk_label(cid))] = data.reshape(len(rows), width)
                if not in_place:
                    self.table.backend.upload(host.reshape(-1), out=value)
            self.table.chunks[cid] = StoredChunk(value)
            if replicated:
                self.replication.initialized([cid], [self.table.backend.to_numpy(value)], [[list(shape), servers]],
                                             share)
        self.tables[cid] = Table(layout, tuple(shape[1:]))
        self.table.row_tables.add(cid)
        return [ok(peer, header["id"])]

    def adopt(self, cid, value, table: list, rounds: int, bases: dict | None = None) -> None:
        """(Replicated servers) the replica of a dead server's row table ``cid``
        (``table``: its ``[shape, servers]``) serves here now, ``rounds`` applied
        (``bases``: of the workers that joined, kvstore.server.numbering)."""
        shape, servers = table
        self.table.chunks[cid] = StoredChunk(value)
        self.tables[cid] = Table(RowLayout(shape[0], math.prod(shape[1:]), cid[1], servers), tuple(shape[1:]))
        self.table.row_tables.add(cid)
        self.adopt_numbers(cid, rounds, bases)

    def adopt_numbers(self, cid, rounds: int, numbers: dict | None) -> None:
        """(Replicated servers) table ``cid`` comes with ``rounds`` applied and
        ``numbers``: in dist_sync the bases of the workers that joined
        (kvstore.server.numbering), in dist_async each worker's last push applied."""
        self._applied[cid] = rounds
        if self._per_push():
            self._last[cid] = dict(numbers or {})
        else:
            self._bases.adopt(cid, numbers)

    def applied(self, cid) -> tuple[int, dict]:
        """(Replicated servers) the rounds applied to row table ``cid`` (in dist_async:
        its pushes applied) and, in dist_sync, the bases of the workers that joined
        (kvstore.server.numbering), in dist_async each worker's last push applied."""
        if self._per_push():
            return self._applied.get(cid, 0), dict(self._last.get(cid, {}))
        return self._applied.get(cid, 0), self._bases.of(cid)

    def became_member(self, worker: int) -> None:
        """(Replicated servers) ``worker`` became a member of the elastic job: a new
        process, whose pushes are numbered from 1 again (dist_async: its last push
        applied is forgotten; dist_sync: its base is each table's rounds applied now)."""
        if self._per_push():
            for last in self._last.values():
                last.pop(worker, None)
            return
        self._bases.joined(worker, ((cid, self._applied.get(cid, 0)) for cid in self.tables))

    def _per_push(self) -> bool:
        """Whether pushes are applied one by one (dist_async), not in rounds."""
        return self.job.mode is not None and not self.job.mode.rounds

    def table_of(self, cid) -> list:
        """(Replicated servers) row table ``cid``'s ``[shape, servers]``, as a replica records it."""
        table = self.tables[cid]
        return [[table.layout.num_rows, *table.row_shape], table.layout.servers]

    def on_push(self, peer, header, arrays) -> list[Reply]:
        worker = self.job.worker(header)
        cid = self._cid(header)
        table, chunk = self._table(cid)
        rows, data = self._rows_data(cid, table.layout, arrays, chunk.value.dtype)
        local = table.layout.local(rows, chunk_label(cid))
        updater = self.optimizer.updater
        if updater is not None and chunk.value.dtype.kind != "f":
            raise InvalidArgumentError(f"{chunk_label(cid)} holds {chunk.value.dtype.name}: "
                                       "optimizers update floating-point values only")
        mode = self._mode()
        if not mode.rounds:          # each push applied on arrival
            if mode.needs_optimizer and updater is None:
                raise InvalidArgumentError(f"dist_{mode.name} applies every push with an optimizer: "
                                           "call set_optimizer() before push")
            number = self._push_number(header, cid, worker)
            if number == 0:
                return [ok(peer, header["id"])]    # a push re-sent after a failover, applied already
            data = data.reshape((len(rows),) + table.row_shape)
            self._applied[cid] = self._applied.get(cid, 0) + 1
            if number is not None:
                self._last.setdefault(cid, {})[worker] = number
            if self.replication.active:    # the backup applies it too, before the acknowledgement
                self._replicate(cid, table, local, data, None if number is None else (worker, number))
            self._apply(cid, table, chunk, local, data)
            return [ok(peer, header["id"])]
        self._refuse_if_gone(cid, table, worker)
        if self._applied_already(header, cid, table, worker):
            return [ok(peer, header["id"])]       # a push re-sent after a failover, its round applied
        rnd = next((r for r in table.rounds if worker not in r.parts), None)
        if rnd is None:
            absent = self.members.absent(self._num_workers())
            rnd = RowRound({w: self._nothing(table, chunk) for w in absent}, filled=absent)
            table.rounds.append(rnd)
        rnd.parts[worker] = (rows, data.reshape((len(rows),) + table.row_shape))
        rnd.acks.append((peer, header["id"], worker))
        return self._apply_complete(cid, table, chunk)

    def on_pull(self, peer, header, arrays) -> list[Reply]:
        worker = self.job.worker(header)
        cid = self._cid(header)
        table, chunk = self._table(cid)
        if len(arrays) != 1:
            raise ProtocolError("pull_rows carries one buffer: the row ids")
        local = table.layout.local(self._ids(arrays[0], cid), chunk_label(cid))
        if self._mode().rounds and table.pending_from(worker):
            table.pulls.append((peer, header["id"], worker, local))
            return []
        return [self._rows_reply(peer, header["id"], table, chunk, local)]

    def on_set(self, peer, header, arrays) -> list[Reply]:
        """Assign rows their values (a table loaded from a file: kv.assign_rows), the
        optimizer's state of those rows untouched. Refused while a sync round is open
        on the table: the assignment and a pending update would meet in an order
        nobody chose (assign between steps, after a barrier)."""
        cid = self._cid(header)
        table, chunk = self._table(cid)
        rows, data = self._rows_data(cid, table.layout, arrays, chunk.value.dtype)
        if table.rounds:
            waiting = sorted(table.rounds[0].parts)
            raise InvalidArgumentError(
                f"set_rows on {chunk_label(cid)}: a round of pushes is still open (from worker(s) "
                f"{', '.join(map(str, waiting))}); assign rows between steps, after a barrier")
        backend, width = self.table.backend, table.layout.width
        host_local = table.layout.local(rows, chunk_label(cid))
        self.replication.rows_set(cid, host_local, data)
        local = backend.upload(host_local)
        weights = chunk.value.reshape(table.layout.local_rows, width)
        weights[local] = backend.upload(np.ascontiguousarray(data).reshape(len(rows), width))
        return [ok(peer, header["id"])]

    # -- rounds ------------------------------------------------------------------------
    def _push_number(self, header, cid, worker: int) -> int | None:
        """(dist_async) A push's number (``rounds``: replicated servers, the worker's
        number of its push of this table): the number to apply, 0 when that push was
        applied already (sent again after a failover), None without one;
        InvalidArgumentError for a number that skips one."""
        numbers = header.get("rounds")
        if numbers is None:
            return None
        if not (isinstance(numbers, list) and len(numbers) == 1 and is_int(numbers[0]) and numbers[0] >= 1):
            raise ProtocolError("'rounds' of a row push must be a list of one round number >= 1")
        last = self._last.get(cid, {}).get(worker, 0)
        if numbers[0] > last + 1:
            raise InvalidArgumentError(f"{chunk_label(cid)}: worker {worker} pushes its push {numbers[0]}, but "
                                       f"its last one applied on {self.table.name} is {last}")
        return numbers[0] if numbers[0] > last else 0

    def _applied_already(self, header, cid, table: Table, worker: int) -> bool:
        """Of a numbered push (``rounds``: replicated servers, the worker's number of its
        push of this table), whether its round was applied already; InvalidArgumentError
        for a number out of order."""
        numbers = header.get("rounds")
        if numbers is None:
            return False
        if not (isinstance(numbers, list) and len(numbers) == 1 and is_int(numbers[0]) and numbers[0] >= 1):
            raise ProtocolError("'rounds' of a row push must be a list of one round number >= 1")
        applied = self._applied.get(cid, 0) - self._bases.base(cid, worker)    # of this worker's pushes
        pos = next((i for i, r in enumerate(table.rounds) if worker not in r.parts), len(table.rounds))
        if numbers[0] <= applied:
            return True
        if numbers[0] != applied + pos + 1:
            raise InvalidArgumentError(f"push {numbers[0]} of {chunk_label(cid)} from worker {worker}: its next "
                                       f"round is {applied + pos + 1}")
        return False

    def _apply_complete(self, cid, table: Table, chunk: StoredChunk) -> list[Reply]:
        replies = []
        while table.rounds and len(table.rounds[0].parts) == self._num_workers():
            rnd = table.rounds.pop(0)
            parts = [rnd.parts[w] for w in sorted(rnd.parts)]
            rows, data = sparse.merge(parts, table.row_shape, chunk.value.dtype)
            kind, error = "RemoteError", ""
            self._applied[cid] = self._applied.get(cid, 0) + 1
            if self.replication.active:      # the backup applies the merged rows too
                self._replicate(cid, table, self._rows_at(cid, table, rows), data)
            try:
                self._apply(cid, table, chunk, self._rows_at(cid, table, rows), data)
            except KVStoreError as e:    # a round the table refuses (a dynamic table's budget)
                kind, error = type(e).__name__, str(e)
            except Exception as e:   # an optimizer failure must not leave workers waiting
                error = f"applying the optimizer to {chunk_label(cid)} failed: {type(e).__name__}: {e}"
            replies += [Reply(peer, error_header(rid, kind, error)) if error
                        else ok(peer, rid) for peer, rid, _ in rnd.acks]
            replies += self._release_pulls(table, chunk)
        return replies

    def _replicate(self, cid, table: Table, local: np.ndarray, data: np.ndarray,
                   pusher: tuple[int, int] | None = None) -> None:
        """(Replicated servers) round ``self._applied[cid]`` of ``cid``, its merged rows
        at ``local`` and their data, for the backup (kvstore.server.replication);
        ``pusher`` (dist_async, each push a round): (worker, its number of the push)."""
        self.replication.rows_applied(cid, self._applied[cid], local, data, self.optimizer.updater is not None,
                                      pusher)

    def _rows_at(self, cid, table: Table, rows: np.ndarray) -> np.ndarray:
        """Where a round's merged ``rows`` lie in the chunk (global ids -> local rows)."""
        return table.layout.local(rows, chunk_label(cid))

    def _apply(self, cid, table: Table, chunk: StoredChunk, local: np.ndarray, data: np.ndarray) -> None:
        backend, width = self.table.backend, table.layout.width
        weights = chunk.value.reshape(table.layout.local_rows, width)
        local = backend.upload(local)
        grad = backend.upload(np.ascontiguousarray(data).reshape(len(data), width))
        updater = self.optimizer.updater
        if updater is None:
            weights[local] = grad            # no optimizer: the merged rows are assigned
        else:
            updater.update_rows(cid, local, grad, weights)

    def _release_pulls(self, table: Table, chunk: StoredChunk) -> list[Reply]:
        ready = [p for p in table.pulls if not table.pending_from(p[2])]
        table.pulls = [p for p in table.pulls if table.pending_from(p[2])]
        return [self._rows_reply(peer, rid, table, chunk, local) for peer, rid, _, local in ready]

    def _rows_reply(self, peer, req_id, table: Table, chunk: StoredChunk, local) -> Reply:
        weights = chunk.value.reshape(table.layout.local_rows, table.layout.width)
        rows = weights[self.table.backend.upload(local)]   # a gather: a fresh array
        return ok(peer, req_id, self.table.backend.download_own([rows]))

    # -- workers that finished -----------------------------------------------------------
    def workers_finished(self) -> list[Reply]:
        """Fail every queued round a finished worker (the table's ``gone``) will never
        push to, and the pulls waiting on them (in sync mode)."""
        replies, gone = [], self.table.gone
        for cid, table in self.tables.items():
            first = next((i for i, r in enumerate(table.rounds) if not gone <= set(r.parts)), None)
            if first is None:
                continue
            for pos in range(first, len(table.rounds)):
                message = self._gone_message(cid, gone, table.rounds[pos])
                replies += [Reply(peer, error_header(rid, "RemoteError", message))
                            for peer, rid, _ in table.rounds[pos].acks]
            failed = {w for r in table.rounds[first:] for w in r.parts}
            del table.rounds[first:]
            for peer, rid, worker, _ in table.pulls:
                if worker in failed and not table.pending_from(worker):
                    replies.append(Reply(peer, error_header(rid, "RemoteError", self._gone_message(cid, gone, None))))
            table.pulls = [p for p in table.pulls if table.pending_from(p[2])]
        return replies

    # -- elastic members ---------------------------------------------------------------
    def leave(self, worker: int, message: str) -> list[Reply]:
        """``worker`` left the elastic job: it counts, with no rows, in every queued round
        it has not pushed to (its rows already in rounds count); its pushes and pulls
        still parked get ``message``; the rounds that complete are applied."""
        replies = []
        for cid, table in self.tables.items():
            _, chunk = self._table(cid)
            for rnd in table.rounds:
                replies += [Reply(peer, error_header(rid, "RemoteError", message))
                            for peer, rid, w in rnd.acks if w == worker]
                rnd.acks = [ack for ack in rnd.acks if ack[2] != worker]
                if worker not in rnd.parts:
                    rnd.parts[worker] = self._nothing(table, chunk)
                    rnd.filled |= {worker}
            replies += [Reply(peer, error_header(rid, "RemoteError", message))
                        for peer, rid, w, _ in table.pulls if w == worker]
            table.pulls = [p for p in table.pulls if p[2] != worker]
            replies += self._apply_complete(cid, table, chunk)
        return replies

    @staticmethod
    def _nothing(table: Table, chunk: StoredChunk) -> tuple[np.ndarray, np.ndarray]:
        """The part of a rank counted in a round without a push: no rows."""
        return np.zeros(0, np.int64), np.zeros((0,) + table.row_shape, chunk.value.dtype)

    def _refuse_if_gone(self, cid, table: Table, worker: int) -> None:
        gone = self.table.gone
        if not gone:
            return
        rnd = next((r for r in table.rounds if worker not in r.parts), None)
        if not gone <= set(rnd.parts if rnd else ()):
            raise InvalidArgumentError(self._gone_message(cid, gone, rnd))

    @staticmethod
    def _gone_message(cid, gone: set, rnd) -> str:
        missing = sorted(gone - set(rnd.parts if rnd else ()))
        return (f"worker(s) {', '.join(map(str, missing))} closed their store while a round of "
                f"{chunk_label(cid)} waits for their push: every worker must take the same number of steps")

    def queued_rounds(self):
        """(chunk id, round) of every round still waiting (for the stall inspector)."""
        for cid, table in self.tables.items():
            for rnd in table.rounds:
                yield cid, rnd

    # -- checks ------------------------------------------------------------------------
    def _mode(self) -> ConsistencyMode:
        """The job's consistency mode (configured, or restored and waiting for
        configure: dist_ssp's bound comes with it)."""
        assert self.job.mode is not None     # ServerState.handle refuses ops before configure
        return self.job.mode

    def _num_workers(self) -> int:
        assert self.job.num_workers is not None
        return self.job.num_workers

    def chunk_of(self, header) -> tuple:
        """The row table a request names (its ``chunk``: ``[key, server]``)."""
        return self._cid(header)

    def _cid(self, header) -> tuple:
        item = header["chunk"]
        if not (isinstance(item, list) and len(item) == 2 and is_int(item[1])
                and (is_int(item[0]) or isinstance(item[0], str))):
            raise ProtocolError(f"bad chunk id {item!r}: expected [key, server]")
        return item[0], item[1]

    def _table(self, cid) -> tuple[Table, StoredChunk]:
        table = self.tables.get(cid)
        if table is None:
            if cid in self.table.chunks:
                raise InvalidArgumentError(f"{chunk_label(cid)} belongs to a dense key: "
                                           "row-sparse operations need a key initialised with rows")
            raise InvalidArgumentError(f"{chunk_label(cid)} is not initialised on {self.table.name}; "
                                       "call init() first")
        return table, self.table.chunks[cid]

    @staticmethod
    def _ids(ids: np.ndarray, cid) -> np.ndarray:
        if ids.dtype != np.int64 or ids.ndim != 1:
            raise ProtocolError(f"{chunk_label(cid)}: row ids must be 1-d int64, got {ids.dtype}{ids.shape}")
        if len(ids) > 1 and not np.all(ids[1:] > ids[:-1]):
            raise ProtocolError(f"{chunk_label(cid)}: row ids must be unique and sorted")
        return ids

    def _rows_data(self, cid, layout: RowLayout, arrays, dtype) -> tuple[np.ndarray, np.ndarray]:
        if len(arrays) != 2:
            raise ProtocolError(f"{chunk_label(cid)}: expected two buffers, row ids and rows")
        rows, data = self._ids(arrays[0], cid), arrays[1]
        if data.dtype != dtype or data.size != len(rows) * layout.width:
            raise InvalidArgumentError(f"{chunk_label(cid)}: {len(rows)} row ids with {data.size} x "
                                       f"{data.dtype.name}; each row holds {layout.width} x {np.dtype(dtype).name}")
        layout.local(rows, chunk_label(cid))
        return rows, data

