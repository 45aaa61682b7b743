"""Replicas of dynamic row tables (kvstore.server.dyntables) on a backup server
(replicated servers, ``KVSTORE_REPLICAS=1``, dist_sync and dist_async): the backup's side for
:class:`~kvstore.DynamicRows` keys, beside :class:`~kvstore.server.replication.Replicas`
for chunks and row-sparse tables. Pure: no sockets, threads or clocks.

A primary replicates each dynamic table of a share it serves as two kinds of
``replicate`` request:

- ``dyn_init``: the table as it is now (:func:`table_wire`: ids, rows, ``last``
  round stamps, optimizer state per row, ``t``, the round clock and the
  counters), its spec and the job's server count, and (a rebuild on a
  replacement server, or a resumed table) the rounds applied and the bases of
  the workers that joined (kvstore.server.numbering). A key's init sends an empty
  table; a restored one its checkpoint's rows; a rebuild the table of the moment.
- ``dyn_rounds``: the rounds the primary applied, each as its merged ids and
  their summed gradient (replication after aggregation), with the primary's
  read counters (``hits``, ``misses``: pulls are not replicated). The backup
  applies each with the same :class:`~kvstore.rows.dyntable.DynTable` code and its
  own optimizer, so the replica's ids, rows, stamps, evictions and optimizer state
  equal the primary's bit for bit; a round the primary's table refused (its row
  budget, an optimizer error) is refused here the same way, changing nothing,
  and is counted. In dist_async each push is a round, and names its pusher
  (``pushes``: [worker, its number of the push]): the replica keeps each worker's
  last push applied, so that a push sent again after a promotion is not applied twice.

When the primary dies, :meth:`DynReplicas.promote` hands each table with its round
count to the server's own :class:`~kvstore.server.dyntables.DynTables`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import InvalidArgumentError, ProtocolError
from ..protocol import chunk_label
from ..rows.dynamic import DynamicRows
from ..rows.dyntable import COUNTERS, DynTable
from .budget import MemoryBudget
from .numbering import member_again
from .requests import ok, pushes_field
from .rounds import Reply, is_int
from .server_optimizer import ServerOptimizer

DYN_INIT, DYN_ROUNDS = "dyn_init", "dyn_rounds"


def table_wire(rows: DynTable) -> tuple[dict, list]:
    """A table as a ``dyn_init`` request's ``table`` field and buffers: ids (int64),
    rows, ``last`` (int64), then each optimizer state array; rows in id order."""
    snap = rows.snapshot()
    n = len(rows.ids)
    arrays = [np.frombuffer(snap["ids"], np.int64), np.frombuffer(snap["values"], rows.dtype).reshape(n, rows.width),
              np.frombuffer(snap["last"], np.int64)]
    states = None
    if snap["state"] is not None:
        states = [dtype for dtype, _ in snap["state"]]
        arrays += [np.frombuffer(data, np.dtype(dtype)).reshape(n, rows.width) for dtype, data in snap["state"]]
    return {"t": snap["t"], "clock": snap["clock"], "counts": snap["counts"], "state": states}, arrays


def table_from_wire(spec: DynamicRows, label: str, meta, arrays: list, reserve=None) -> DynTable:
    """The table :func:`table_wire` described (checked as a checkpoint's is)."""
    if not (isinstance(meta, dict) and is_int(meta.get("t")) and is_int(meta.get("clock"))
            and isinstance(meta.get("counts"), dict) and all(is_int(meta["counts"].get(k)) for k in COUNTERS)
            and (meta.get("state") is None or (isinstance(meta["state"], list)
                                               and all(isinstance(d, str) for d in meta["state"])))):
        raise ProtocolError("a dyn_init's 'table' needs t, clock, counts and state (a list of dtypes, or null)")
    states = meta["state"] or []
    if len(arrays) != 3 + len(states):
        raise ProtocolError(f"a dyn_init carries ids, rows, round stamps and {len(states)} state array(s); "
                            f"got {len(arrays)} buffers")
    for a, dtype in zip(arrays[3:], states):
        if np.asarray(a).dtype != np.dtype(dtype):
            raise InvalidArgumentError(f"{label}: an optimizer state array of {np.asarray(a).dtype}, declared {dtype}")
    snap = {"ids": np.asarray(arrays[0], np.int64).tobytes(), "values": np.asarray(arrays[1], spec.dtype).tobytes(),
            "last": np.asarray(arrays[2], np.int64).tobytes(), "t": meta["t"], "clock": meta["clock"],
            "counts": meta["counts"],
            "state": None if meta["state"] is None else
            [[dtype, np.asarray(a).tobytes()] for dtype, a in zip(states, arrays[3:])]}
    return DynTable.restore(spec, label, snap, reserve)


class _Charge:
    """A replica's reserve: bytes taken from the server's budget, and counted."""

    def __init__(self, budget: MemoryBudget, what: str):
        self.budget, self.what, self.nbytes = budget, what, 0

    def __call__(self, nbytes: int) -> None:
        self.budget.take(nbytes, self.what)
        self.nbytes += nbytes


@dataclass
class DynReplica:
    """A backup's replica of one dynamic table: the rows, the job's server count, the
    rounds applied, the bases of the workers that joined (dist_sync; in dist_async:
    each worker's last push applied), the bytes it reserved."""
    rows: DynTable
    servers: int
    charge: _Charge
    rounds: int = 0
    bases: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.charge.nbytes


class DynReplicas:
    """The dynamic tables a backup holds for the shares it backs up (``held``:
    share -> {chunk id: :class:`DynReplica`}), updated by ``optimizer`` (the
    server's, as its own tables are) and counted in ``budget``."""

    def __init__(self, name: str, optimizer: ServerOptimizer, budget: MemoryBudget):
        self.name = name
        self.optimizer = optimizer
        self.budget = budget
        self.held: dict[int, dict[tuple, DynReplica]] = {}

    def nbytes(self) -> int:
        return sum(r.nbytes for tables in self.held.values() for r in tables.values())

    def on_replicate(self, peer, header: dict, arrays: list, share: int) -> list[Reply]:
        """A ``dyn_init`` or ``dyn_rounds`` request for ``share`` (checked by the caller:
        one this server backs up). Everything is checked before anything changes."""
        held = self.held.setdefault(share, {})
        if header["kind"] == DYN_INIT:
            self._init(header, arrays, share, held)
        else:
            self._rounds(header, arrays, share, held)
        return [ok(peer, header["id"])]

    def _init(self, header: dict, arrays: list, share: int, held: dict) -> None:
        cid = _cid(header.get("chunk"))
        servers, applied = header["servers"], header.get("applied")
        if not (is_int(servers) and 0 <= cid[1] < servers):
            raise ProtocolError("a dyn_init needs servers (the job's count)")
        if applied is not None and not (isinstance(applied, list) and len(applied) == 2 and is_int(applied[0])
                                        and applied[0] >= 0 and isinstance(applied[1], list) and all(
                                            isinstance(p, list) and len(p) == 2 and all(is_int(v) and v >= 0 for v in p)
                                            for p in applied[1])):
            raise ProtocolError("a dyn_init's 'applied' must be [rounds, [[worker, base], ...]]")
        spec = DynamicRows.from_wire(header["spec"])
        charge = _Charge(self.budget, f"the replica of the dynamic rows of {chunk_label(cid)} (of server "
                                      f"{share}) on {self.name}")
        try:
            rows = table_from_wire(spec, f"key {cid[0]!r} on {self.name}", header.get("table"), arrays, charge)
        except BaseException:          # refused or failed: what it reserved is free again
            self.budget.give(charge.nbytes)
            raise
        replica = DynReplica(rows, servers, charge)
        if applied is not None:
            replica.rounds, replica.bases = applied[0], {w: n for w, n in applied[1]}
        old = held.pop(cid, None)      # a rebuild or a resumed table: the primary's table now
        if old is not None:
            self.budget.give(old.nbytes)
        held[cid] = replica

    def _rounds(self, header: dict, arrays: list, share: int, held: dict) -> None:
        ids = header.get("chunks")
        numbers, flags, reads = header.get("rounds"), header.get("updated"), header.get("reads")
        if not (isinstance(ids, list) and isinstance(numbers, list) and isinstance(flags, list)
                and isinstance(reads, list) and len(ids) == len(numbers) == len(flags) == len(reads)
                and len(arrays) == 2 * len(ids) and all(is_int(n) for n in numbers)
                and all(isinstance(f, bool) for f in flags)
                and all(isinstance(r, list) and len(r) == 2 and all(is_int(x) and x >= 0 for x in r) for r in reads)):
            raise ProtocolError("a dyn_rounds request carries chunks, rounds, updated and reads ([hits, misses]), "
                                "one each per round, and two buffers per round: ids and their rows")
        pushes = pushes_field(header, len(ids))
        updater = self.optimizer.updater
        expected: dict = {}
        work = []
        for i, (item, n, updated) in enumerate(zip(ids, numbers, flags)):
            cid = _cid(item)
            replica = held.get(cid)
            if replica is None:
                raise InvalidArgumentError(f"replicate: {self.name} holds no replica of the dynamic rows of "
                                           f"{chunk_label(cid)} of server {share}")
            rows, data = np.asarray(arrays[2 * i]), np.asarray(arrays[2 * i + 1])
            table = replica.rows
            if rows.dtype != np.int64 or rows.ndim != 1 or data.dtype != table.dtype \
                    or data.size != rows.size * table.width:
                raise InvalidArgumentError(f"replicate: rows of {chunk_label(cid)} that do not fit its replica")
            if updated and updater is None:
                raise InvalidArgumentError(f"server {share} applied a round with an optimizer, but {self.name} "
                                           "has none: set_optimizer must reach every server")
            want = expected.get(cid, replica.rounds) + 1
            if n != want:
                raise InvalidArgumentError(f"replicate: round {n} of {chunk_label(cid)} came, but the replica's "
                                           f"next round is {want} (a replicate request was lost or repeated)")
            expected[cid] = n
            work.append((cid, replica, rows, data, updated, reads[i], pushes[i]))
        for cid, replica, rows, data, updated, (hits, misses), pusher in work:
            if pusher is not None:         # dist_async: the worker's last push applied
                replica.bases[pusher[0]] = pusher[1]
            optimizer = updater.optimizer if updated and updater is not None else None
            # as the primary's table (kvstore.server.dyntables): a round refused there (its
            # budget, an optimizer that is not lazy or fails) is refused here, and counted
            if optimizer is None or optimizer.lazy_for(row_sparse_key=True):
                try:
                    replica.rows.apply(rows, np.array(data, copy=True), optimizer, index=cid)
                except Exception:     # (KVStoreError for the budget, or the optimizer's error)
                    pass
            replica.rounds += 1
            replica.rows.counts["hits"], replica.rows.counts["misses"] = hits, misses

    def became_member(self, worker: int, per_push: bool = False) -> None:
        """``worker`` joined the elastic job (a new process numbering its pushes from
        1): its base is each replica's rounds applied now; where pushes are applied
        one by one (``per_push``, dist_async) its last push applied is forgotten."""
        for tables in self.held.values():
            for replica in tables.values():
                member_again(replica.bases, worker, replica.rounds, per_push)

    def optimizer_changed(self, fresh: bool, scale: float) -> None:
        """As :meth:`kvstore.server.dyntables.DynTables.optimizer_changed`, for the replicas."""
        for tables in self.held.values():
            for replica in tables.values():
                if fresh:
                    replica.rows.reset_state()
                else:
                    replica.rows.scale_state(scale)

    def promote(self, share: int) -> dict[tuple, DynReplica]:
        """Server ``share`` died and this one serves its tables now: handed over."""
        return self.held.pop(share, {})

    def drop(self, share: int) -> None:
        """Server ``share`` is served elsewhere now: its replicas are of no use."""
        gone = self.held.pop(share, {})
        self.budget.give(sum(r.nbytes for r in gone.values()))


def _cid(item) -> tuple:
    if not (isinstance(item, list) and len(item) == 2 and is_int(item[1]) and item[1] >= 0
            and (is_int(item[0]) or isinstance(item[0], str))):
        raise ProtocolError(f"bad chunk id {item!r}: expected [key, server]")
    return item[0], item[1]
