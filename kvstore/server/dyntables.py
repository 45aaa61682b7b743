"""Dynamic row tables on one server (kvstore.rows.dynamic): the rows it holds of each
:class:`~kvstore.DynamicRows` key, created on first push and evicted by age or
budget. A collaborator of :class:`~kvstore.server.state.ServerState`, pure as well.

It is :class:`~kvstore.server.tables.RowTables` with another store under the
rounds: the same sync rounds (one push from every worker, merged in rank order),
parked pulls, failed rounds of finished workers, elastic leaves and stall lines,
and async pushes applied on arrival; but a table's rows live in a
:class:`~kvstore.rows.dyntable.DynTable` (an id -> slab row map over a growable slab),
not in a chunk of the :class:`~kvstore.server.chunks.ChunkTable`, and a row id is
any int64 in [0, 2**63) that hashes to this server (:func:`kvstore.rows.dynamic.owner`).

A round that would pass the budget with eviction off fails with an
InvalidArgumentError naming the key, the server, the budget and the count, and
changes nothing (each worker of the round gets it); so does an optimizer error.
Checkpoints carry the tables (:meth:`DynTables.snapshot`, :meth:`DynTables.restore`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..rows.dynamic import ID_LIMIT, DynamicRows, owner
from ..rows.dyntable import DynTable
from ..errors import InvalidArgumentError, ProtocolError
from ..protocol import chunk_label
from ..rows.layout import RowLayout
from .budget import MemoryBudget
from .chunks import ChunkTable
from .members import Members
from .modes import Job
from .server_optimizer import ServerOptimizer
from .requests import ok
from .rounds import StoredChunk, Reply, is_int
from .tables import RowTables, Table


@dataclass(frozen=True)
class HashLayout(RowLayout):
    """What the rounds read of a table's layout: ``width``, and ``local(ids)``, which
    checks that each id is in [0, 2**63) and hashes to this server, and returns them
    (a dynamic table is addressed by id; ``num_rows`` is 2**63)."""

    def local(self, rows: np.ndarray, what: str) -> np.ndarray:
        rows = np.asarray(rows)
        if rows.dtype != np.int64 or rows.ndim != 1:
            raise InvalidArgumentError(f"{what}: row ids must be a 1-d int64 array, got {rows.dtype}{rows.shape}")
        bad = np.flatnonzero(rows < 0)
        if not len(bad):
            bad = np.flatnonzero(owner(rows, self.servers) != self.server)
        if len(bad):
            raise InvalidArgumentError(f"{what}: row id {int(rows[bad[0]])} is not one of this server's rows "
                                       f"(server {self.server} of {self.servers}, dynamic rows: ids in "
                                       "[0, 2**63) placed by splitmix64(id) % servers)")
        return rows


@dataclass
class DynRecord(Table):
    """A table's rounds (as :class:`~kvstore.server.tables.Table`) and its rows."""
    rows: DynTable | None = None
    spec: DynamicRows | None = None
    dtype_of: StoredChunk = field(default_factory=lambda: StoredChunk(np.zeros(0, np.float32)))   # its dtype, for the rounds


class DynTables(RowTables):
    """The dynamic tables of this server (``tables``: chunk id -> DynRecord), and
    those restored from a checkpoint that wait for their init (``restored``)."""

    def __init__(self, table: ChunkTable, job: Job, optimizer: ServerOptimizer, members: Members,
                 budget: MemoryBudget):
        super().__init__(table, job, optimizer, members, budget)
        self.restored: dict[tuple, tuple] = {}    # chunk id -> (spec wire, DynTable snapshot)

    # -- requests ----------------------------------------------------------------------
    def on_init(self, peer, header, arrays) -> list[Reply]:
        return self.init_table(peer, header, arrays)

    def init_table(self, peer, header, arrays, share: int | None = None) -> list[Reply]:
        """``init_dyn``; ``share``: (replicated servers) the dead server whose share the
        table is of, served here now (replicated to that share's backup, if any)."""
        cid = self._cid(header)
        if not self._mode().takes_rows:
            raise InvalidArgumentError(self._mode().no_rows)
        servers, server = header["servers"], cid[1]
        if not (is_int(servers) and 0 <= server < servers) or arrays:
            raise ProtocolError("init_dyn needs servers (the job's count) and a spec, and carries no buffers")
        spec = DynamicRows.from_wire(header["spec"])
        if cid in self.tables or cid in self.table.chunks:
            raise InvalidArgumentError(f"{chunk_label(cid)} is already initialised")
        label = f"key {cid[0]!r} on {self.table.name}"
        budget = self.budget

        def reserve(nbytes: int) -> None:   # the slab, as it is made and as it grows
            budget.take(nbytes, f"dynamic rows of {chunk_label(cid)} ({spec.describe()}) on {self.table.name}")
        if cid in self.restored:       # resumed: the checkpoint's rows, for the same spec
            saved, snap = self.restored[cid]
            if saved != spec.to_wire():
                raise InvalidArgumentError(f"{chunk_label(cid)}: the checkpoint holds {DynamicRows.from_wire(saved).describe()}"
                                           f", init asks for {spec.describe()}")
        held = budget.held
        try:
            if cid in self.restored:
                rows = DynTable.restore(spec, label, self.restored[cid][1], reserve)
                del self.restored[cid]
            else:
                rows = DynTable(spec, label, reserve=reserve)
        except BaseException:          # refused or failed: what it reserved is free again
            budget.give(budget.held - held)
            raise
        self._record(cid, rows, spec, servers)
        if self.replication.active:     # the backup holds a replica (a restored table's rows included)
            self.replication.dyn_initialized(cid, spec.to_wire(), servers, rows, share)
        return [ok(peer, header["id"])]

    def _record(self, cid, rows: DynTable, spec: DynamicRows, servers: int) -> None:
        self.tables[cid] = DynRecord(HashLayout(ID_LIMIT, spec.width, cid[1], servers), spec.row_shape, rows=rows,
                                     spec=spec, dtype_of=StoredChunk(np.zeros(0, spec.dtype)))

    # -- replicated servers (kvstore.server.replication, kvstore.server.dyn_replicas) ----
    def adopt_table(self, cid, rows: DynTable, servers: int, rounds: int, bases: dict | None = None) -> None:
        """The replica of a dead server's dynamic table ``cid`` (``servers``: the job's
        count) serves here now, ``rounds`` applied (``bases``: in dist_sync of the
        workers that joined, kvstore.server.numbering; in dist_async each worker's
        last push applied)."""
        self._record(cid, rows, rows.spec, servers)
        self.adopt_numbers(cid, rounds, bases)

    def rebuilt(self, ids, share: int | None) -> None:
        """(Replicated servers) the backup of ``share`` (None: this server's own), whose
        tables are ``ids``, is new (a replacement): each table goes to it as it is
        now, with its rounds applied."""
        for cid in ids:
            record = self.tables[cid]
            assert isinstance(record, DynRecord) and record.spec is not None and record.rows is not None
            self.replication.dyn_initialized(cid, record.spec.to_wire(), record.layout.servers, record.rows,
                                             share, self.applied(cid))

    def _replicate(self, cid, table: Table, local: np.ndarray, data: np.ndarray,
                   pusher: tuple[int, int] | None = None) -> None:
        assert isinstance(table, DynRecord) and table.rows is not None
        counts = table.rows.counts
        self.replication.dyn_applied(cid, self._applied[cid], local, data, self.optimizer.updater is not None,
                                     (counts["hits"], counts["misses"]), pusher)

    def on_pull(self, peer, header, arrays) -> list[Reply]:
        """As a row table's pull; but ids need not have rows, so the reply (a row per
        id) is counted against the server's budget before it is built."""
        cid = self._cid(header)
        table, chunk = self._table(cid)
        if len(arrays) == 1:
            nbytes = arrays[0].size * table.layout.width * chunk.value.dtype.itemsize
            self.budget.check(nbytes, f"pull_dyn of {arrays[0].size:,} ids of {chunk_label(cid)} "
                                            f"(rows of {table.layout.width} x {chunk.value.dtype.name})")
        return super().on_pull(peer, header, arrays)

    def on_set(self, peer, header, arrays) -> list[Reply]:
        raise InvalidArgumentError(f"{chunk_label(self._cid(header))} holds dynamic rows: they are made by "
                                   "pushes, not assigned")

    def on_stats(self, peer, header, arrays) -> list[Reply]:
        """The table's counters, after the sender's pushes (parked as a pull is)."""
        worker = self.job.worker(header)
        cid = self._cid(header)
        table, _ = self._table(cid)
        if arrays:
            raise ProtocolError("dyn_stats carries no buffers")
        if self._mode().rounds and table.pending_from(worker):
            table.pulls.append((peer, header["id"], worker, None))
            return []
        return [self._stats_reply(peer, header["id"], table)]

    # -- what RowTables' rounds call ----------------------------------------------------
    def _table(self, cid) -> tuple[Table, StoredChunk]:
        table = self.tables.get(cid)
        if not isinstance(table, DynRecord):
            raise InvalidArgumentError(f"{chunk_label(cid)} holds no dynamic rows on {self.table.name}: "
                                       "init the key with kvstore.DynamicRows first")
        return table, table.dtype_of

    def _apply(self, cid, table: Table, chunk: StoredChunk, local: np.ndarray, data: np.ndarray) -> None:
        assert isinstance(table, DynRecord) and table.rows is not None
        updater = self.optimizer.updater
        if updater is not None and not updater.optimizer.lazy_for(row_sparse_key=True):
            # (the workers refuse this at set_optimizer and init: kvstore.worker.store)
            raise InvalidArgumentError(f"{chunk_label(cid)} holds dynamic rows, which exist only once pushed: "
                                       f"{type(updater.optimizer).__name__}(lazy_update=False) would update every row")
        table.rows.apply(local, data, None if updater is None else updater.optimizer, index=cid)

    def _rows_at(self, cid, table: Table, rows: np.ndarray) -> np.ndarray:
        return rows                         # the ids themselves: DynTable finds their slab rows

    def _rows_reply(self, peer, req_id, table: Table, chunk: StoredChunk, local) -> Reply:
        assert isinstance(table, DynRecord) and table.rows is not None
        if local is None:                   # a parked dyn_stats
            return self._stats_reply(peer, req_id, table)
        return ok(peer, req_id, [table.rows.read(local)])

    @staticmethod
    def _stats_reply(peer, req_id, table: Table) -> Reply:
        assert isinstance(table, DynRecord) and table.rows is not None
        return ok(peer, req_id, stats=table.rows.stats())

    # -- the optimizer changed ------------------------------------------------------------
    def optimizer_changed(self, fresh: bool, scale: float) -> None:
        """``fresh``: a new optimizer (state made again); else ``scale`` multiplies the state."""
        for record in self._records():
            if fresh:
                record.reset_state()
            else:
                record.scale_state(scale)

    def _records(self) -> list[DynTable]:
        return [t.rows for t in self.tables.values() if isinstance(t, DynRecord) and t.rows is not None]

    # -- checkpoints ---------------------------------------------------------------------
    def snapshot(self, chosen: Callable[[tuple], bool] = lambda cid: True) -> list:
        """``[[key, server, spec, table], ...]``: every table after its last applied round
        (and the restored ones not initialised again yet); those whose chunk id is
        ``chosen`` (replicated servers: a share's)."""
        out = []
        for cid, record in self.tables.items():
            if not chosen(cid):
                continue
            assert isinstance(record, DynRecord) and record.spec is not None and record.rows is not None
            out.append([cid[0], cid[1], record.spec.to_wire(), record.rows.snapshot()])
        out += [[cid[0], cid[1], spec, snap] for cid, (spec, snap) in self.restored.items() if chosen(cid)]
        return out

    def restore(self, entries: list) -> None:
        """Start from a checkpoint's tables: each waits for its key's init (same spec)."""
        self.tables.clear()
        self.restored = {(key, index): (spec, snap) for key, index, spec, snap in entries}

    def summary(self) -> list[str]:
        """One line per table for the server's log."""
        lines = []
        for cid, record in self.tables.items():
            if isinstance(record, DynRecord) and record.rows is not None:
                s = record.rows.stats()
                looked = s["hits"] + s["misses"]
                rate = f"{s['hits'] / looked:.4f}" if looked else "n/a"
                lines.append(f"dynamic rows of {chunk_label(cid)}: {s['rows']} rows, {s['created']} created, "
                             f"{s['evicted']} evicted ({s['evicted_by_age']} by age, {s['evicted_by_budget']} "
                             f"by budget), hit rate {rate} over {looked} ids pulled, {s['rounds']} rounds")
        return lines
