"""Replicated servers (``KVSTORE_REPLICAS=1``): the server's replication strategy,
beside its consistency mode (docs/architecture.md, "Replicated servers").

Primary-backup per server share, *replication after aggregation* (Li et al.,
OSDI 2014): a server replicates what it applies, not what it receives. Three
collaborators, all pure (no sockets, threads or clocks):

- :class:`Replication`, the primary's side. The sync strategy
  (kvstore.server.sync) tells it each round it applies: the round's number and
  its aggregated gradient (the sum, before the optimizer sees it), or the new
  value itself when there is no optimizer; the state tells it the values an
  ``init`` stored. It collects them into ``replicate`` requests for the backup of
  each share it serves (its own, and a dead server's it took over: they may have
  different backups), which the node sends; a share without a backup
  (``KVSTORE_REPLICAS`` unset, or its backup died) collects nothing. A new
  backup (a replacement, ``--restart-servers``) gets the share *rebuilt*
  (:meth:`Replication.rebuild`: the job's setup, every chunk's value with its
  round count, the optimizer state), then the rounds after it.
- :class:`ReplyGate`, also the primary's: no reply leaves before the backup
  acknowledged every ``replicate`` request made before it (replies keep their
  order; those with values are copied when held, since a later round may change
  the value before they leave), except a round's replies in a job whose workers
  are fixed: they leave at once with a ``ticket``, and the worker keeps the
  pushes they answer until the server says that ticket is ``durable``.
- :class:`Replicas`, the backup's side: for each share it backs up, a replica of
  every chunk (values in the backup's own memory) with the number of rounds
  applied to it. A ``replicate`` request applies each round with the backup's own
  optimizer (every server gets the same ``set_optimizer``; optimizer state is per
  chunk, so the replica's weights are its own), the same code on the same bits: the
  replica equals the primary's value bit for bit. When the primary dies the
  scheduler promotes the backup, and :meth:`Replicas.promote` hands the chunks and
  their round counts to the server's own table.

Round numbers make the failover exact: a worker numbers its pushes of each chunk
(1, 2, ...; the ``rounds`` field), so a push re-sent to the promoted backup of a
round the replica already applied is answered without being applied again, and
one of a round still open joins it (kvstore.server.sync).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..errors import InvalidArgumentError, ProtocolError
from ..protocol import chunk_label, ops
from .budget import MemoryBudget
from .numbering import member_again
from .dyn_replicas import DYN_INIT, DYN_ROUNDS, DynReplicas, table_wire
from .server_optimizer import ServerOptimizer
from .requests import chunk_ids, ok, pushes_field
from .rounds import StoredChunk, Reply, is_int

# what a ``replicate`` request carries (its ``kind``): inits, dense rounds, loaded optimizer
# states, row-sparse rounds (merged rows, lazily updated) and row assignments (set_rows)
INIT, ROUNDS, STATES, ROW_ROUNDS, ROW_SET = "init", "rounds", "states", "row_rounds", "row_set"
# a rebuild on a replacement server (--restart-servers) starts with the job's setup: the
# mode, the worker ranks, the sum's order and the optimizer, as configure and set_optimizer gave them
SETUP = "setup"
# a worker's set_optimizer forwarded to the backups (a replacement hears it from no worker);
# the fields it carries, and ``caller``: the worker
OPTIMIZER = "optimizer"
OPTIMIZER_FIELDS = ("optimizer", "keep_state", "state_scale", "call")


class _Batch:
    """What one share's backup must apply, collected since the last :meth:`Replication.take`."""

    def __init__(self) -> None:
        self.setup: dict | None = None      # a rebuild's first request: the mode and the optimizer
        self.optimizer: dict | None = None  # a worker's set_optimizer, forwarded
        # ids, values, row tables' [shape, servers], a rebuild's [rounds applied, {worker: last push}]
        self.inits: tuple[list, list, list, list] = ([], [], [], [])
        self.rounds: tuple[list, list, list, list] = ([], [], [], [])    # ids, numbers, sums, pushers
        self.updated: bool | None = None
        self.lazy: list = []        # per round of ``rounds``: the values a lazy update changes, or None
        self.row_rounds: tuple[list, list, list, list] = ([], [], [], [])   # ids, numbers, [rows, data], updated
        self.row_pushers: list = []     # per row round: [worker, its push number] (dist_async) or None
        self.row_sets: list[tuple] = []                                      # (id, local rows, data)
        self.states: tuple[list, list] = ([], [])     # [key, index, t, count], arrays
        self.dyn: list[tuple[dict, list]] = []        # dynamic tables' requests (kvstore.server.dyn_replicas), in order

    def requests(self, share: int | None) -> list[tuple[dict, list]]:
        """Its ``replicate`` requests, in order (``share``: named unless it is the server's own)."""
        named = {} if share is None else {"share": share}
        out: list[tuple[dict, list]] = []
        fields: dict
        if self.setup is not None:
            out.append(({"kind": SETUP, **named, **self.setup}, []))
        if self.optimizer is not None:
            out.append(({"kind": OPTIMIZER, **named, **self.optimizer}, []))
        if self.inits[0]:
            ids, values, tables, applied = self.inits
            fields = {"kind": INIT, **named, "chunks": [list(c) for c in ids]}
            if any(t is not None for t in tables):
                fields["tables"] = tables
            if any(a is not None for a in applied):
                fields["applied"] = applied
            out.append((fields, values))
        if self.rounds[0]:
            ids, numbers, arrays, pushers = self.rounds
            fields = {"kind": ROUNDS, **named, "chunks": [list(c) for c in ids], "rounds": numbers,
                      "updated": bool(self.updated)}
            if any(p is not None for p in pushers):
                fields["pushes"] = pushers
            if any(x is not None for x in self.lazy):     # their indices follow the sums
                fields["lazy"] = [x is not None for x in self.lazy]
                arrays = arrays + [x for x in self.lazy if x is not None]
            out.append((fields, arrays))
        if self.row_rounds[0]:
            ids, numbers, arrays, flags = self.row_rounds
            fields = {"kind": ROW_ROUNDS, **named, "chunks": [list(c) for c in ids], "rounds": numbers,
                      "updated": flags}
            if any(p is not None for p in self.row_pushers):
                fields["pushes"] = self.row_pushers
            out.append((fields, arrays))
        for cid, local, data in self.row_sets:
            out.append(({"kind": ROW_SET, **named, "chunks": [list(cid)]}, [local, data]))
        out += [({**fields, **named}, arrays) for fields, arrays in self.dyn]
        if self.states[0]:
            out.append(({"kind": STATES, **named, "states": self.states[0]}, self.states[1]))
        return out


class Replication:
    """The primary's side: the ``replicate`` requests its applied rounds and inits
    make, for the backup of each share it serves (``backups``: share -> backup
    rank, the key None for its own share; none: nothing is replicated)."""

    def __init__(self) -> None:
        self.backups: dict[int | None, int] = {}
        self._share_of: dict = {}     # chunk id -> its share: None (its own) or a dead server's it serves
        self._batches: dict[int | None, _Batch] = {}

    @property
    def backup(self) -> int | None:
        """The backup of this server's own share (None: none)."""
        return self.backups.get(None)

    @backup.setter
    def backup(self, rank: int | None) -> None:
        if rank is None:
            self.backups.pop(None, None)
        else:
            self.backups[None] = rank

    @property
    def active(self) -> bool:
        return bool(self.backups)

    def _batch(self, cid) -> _Batch | None:
        """The batch of ``cid``'s share, or None when it has no backup (or is not served here)."""
        if cid not in self._share_of:
            return None
        share = self._share_of[cid]
        if share not in self.backups:
            return None
        return self._batches.setdefault(share, _Batch())

    def adopted(self, ids, share: int) -> None:
        """The chunks ``ids`` of dead server ``share``'s share are served here now
        (promoted replicas, or inits naming the share)."""
        for cid in ids:
            self._share_of[cid] = share

    def initialized(self, ids, values, tables: list | None = None, share: int | None = None) -> None:
        """An ``init`` stored ``values`` (the chunks' arrays) for ``ids`` (of ``share``,
        None: this server's own); ``tables`` (row-sparse tables,
        kvstore.server.tables): per chunk its ``[shape, servers]``."""
        for cid in ids:
            self._share_of[cid] = share
        if share not in self.backups:
            return
        batch = self._batches.setdefault(share, _Batch())
        batch.inits[0].extend(ids)
        batch.inits[1].extend(np.array(v, copy=True) for v in values)
        batch.inits[2].extend(tables or [None] * len(ids))
        batch.inits[3].extend([None] * len(ids))

    def rebuild(self, share: int | None, setup: dict, chunks: list[tuple]) -> None:
        """The backup of ``share`` is new (a replacement, ``--restart-servers``): send it
        everything, as of now, before any later round. ``setup``: the mode and the
        optimizer; ``chunks``: (id, value, row table's [shape, servers] or None,
        rounds applied, {worker: its last push applied}) of every chunk of the share;
        the optimizer state goes with :meth:`states_set`. Inits or rounds collected for
        that share and not taken yet are dropped: the values carry them."""
        batch = self._batches[share] = _Batch()
        batch.setup = setup
        for cid, value, table, rounds, last in chunks:
            self._share_of[cid] = share
            batch.inits[0].append(cid)
            batch.inits[1].append(np.array(value, copy=True))
            batch.inits[2].append(table)
            batch.inits[3].append([rounds, [[w, n] for w, n in sorted(last.items())]])

    def optimizer_set(self, fields: dict) -> None:
        """A worker's numbered ``set_optimizer`` (``fields``, with its ``caller``) was
        applied: every backup gets it too (one that heard it from the worker applies
        it once: the number says so)."""
        for share in self.backups:
            self._batches.setdefault(share, _Batch()).optimizer = dict(fields)

    def rows_applied(self, cid, number: int, local, data, updated: bool, pusher: tuple | None = None) -> None:
        """Round ``number`` of row table ``cid`` is being applied: ``local`` (its merged
        rows, as the table's local row indices) and ``data`` (their summed gradient, or
        without an optimizer their new values); the replica applies them lazily, as
        the primary does (copies: the optimizer may change its gradient). ``pusher``
        (dist_async, where each push is a round): (worker, its number of the push),
        which the replica keeps to apply no push twice after a failover."""
        batch = self._batch(cid)
        if batch is None:
            return
        ids, numbers, arrays, flags = batch.row_rounds
        ids.append(cid)
        numbers.append(number)
        arrays += [np.array(local, dtype=np.int64, copy=True), np.array(data, copy=True)]
        flags.append(updated)
        batch.row_pushers.append(None if pusher is None else list(pusher))

    def dyn_initialized(self, cid, spec: dict, servers: int, rows, share: int | None = None,
                        applied: tuple[int, dict] | None = None) -> None:
        """Dynamic table ``cid`` (``spec``: its DynamicRows wire; ``servers``: the job's
        count) is served here with ``rows`` (its :class:`~kvstore.rows.dyntable.DynTable`,
        sent as it is now: empty at a key's init, a checkpoint's rows when resumed, the
        table of the moment in a rebuild, which gives ``applied``: the rounds applied
        and the bases of the workers that joined); of ``share`` (None: this server's own)."""
        self._share_of[cid] = share
        if share not in self.backups:
            return
        table, arrays = table_wire(rows)
        fields = {"kind": DYN_INIT, "chunk": list(cid), "spec": spec, "servers": servers, "table": table}
        if applied is not None:
            fields["applied"] = [applied[0], [[w, n] for w, n in sorted(applied[1].items())]]
        self._batches.setdefault(share, _Batch()).dyn.append((fields, [np.array(a, copy=True) for a in arrays]))

    def dyn_applied(self, cid, number: int, ids, data, updated: bool, reads: tuple[int, int],
                    pusher: tuple | None = None) -> None:
        """Round ``number`` of dynamic table ``cid`` is being applied: its merged ``ids``
        and their summed gradient ``data`` (or without an optimizer their new values);
        ``reads``: the table's (hits, misses) counters (its pulls are not replicated);
        ``pusher`` (dist_async): (worker, its number of the push), as :meth:`rows_applied`'s."""
        batch = self._batch(cid)
        if batch is None:
            return
        fields = {"kind": DYN_ROUNDS, "chunks": [list(cid)], "rounds": [number], "updated": [updated],
                  "reads": [list(reads)]}
        if pusher is not None:
            fields["pushes"] = [list(pusher)]
        batch.dyn.append((fields, [np.array(ids, dtype=np.int64, copy=True), np.array(data, copy=True)]))

    def rows_set(self, cid, local, data) -> None:
        """``set_rows`` assigned ``data`` to the local rows ``local`` of row table ``cid``."""
        batch = self._batch(cid)
        if batch is None:
            return
        batch.row_sets.append((cid, np.array(local, dtype=np.int64, copy=True), np.array(data, copy=True)))

    def round_applied(self, cid, number: int, total, updated: bool, pusher: tuple | None = None,
                      rows=None) -> None:
        """Round ``number`` of chunk ``cid`` is being applied: ``total`` is its sum,
        given to the optimizer (``updated``) or, without one, the new value. A copy
        is kept: the optimizer may change its gradient, and the sum's buffer is the
        next round's. Chunks of a share without a backup are not replicated.
        ``pusher`` (dist_async, where each push is a round): (worker, its number of
        the push), which the replica keeps to apply no push twice after a failover.
        ``rows``: the mask of the values a row-sparse push named (a lazy update of
        those alone), or None."""
        batch = self._batch(cid)
        if batch is None:
            return
        if batch.updated is not None and batch.updated != updated:
            raise InvalidArgumentError("a round applied with and one without an optimizer in one event")
        batch.updated = updated
        ids, numbers, arrays, pushers = batch.rounds
        ids.append(cid)
        numbers.append(number)
        arrays.append(np.array(total, copy=True))
        pushers.append(None if pusher is None else list(pusher))
        batch.lazy.append(None if rows is None or not updated else np.flatnonzero(rows).astype(np.int64))

    def states_set(self, meta: list, arrays: list) -> None:
        """A ``set_states`` request (``load_optimizer_states``) set these chunks'
        optimizer state (``meta``: ``[key, index, t, count]`` per chunk, ``arrays``
        their state arrays in order): each share's backup sets the same on its
        replicas, so that their next rounds make the primary's bits."""
        pos = 0
        for entry in meta:
            parts = arrays[pos:pos + entry[3]]
            pos += entry[3]
            batch = self._batch((entry[0], entry[1]))
            if batch is not None:
                batch.states[0].append(list(entry))
                batch.states[1].extend(np.array(a, copy=True).reshape(-1) for a in parts)

    def take(self) -> list[tuple[dict, list]]:
        """The ``replicate`` requests made since the last call: (header fields, arrays);
        those for a share other than the server's own name it (``share``)."""
        out = []
        for share, batch in self._batches.items():
            if share in self.backups:
                out += batch.requests(share)
        self._batches = {}
        return out


# replicate requests a primary may have unacknowledged and still answer a round at once
# (ReplyGate.early); past it, replies wait for the backup again
AHEAD = 32


class ReplyGate:
    """The primary's replies held until the backup acknowledged every ``replicate``
    request sent before them; in order. Example::

        gate = ReplyGate()
        gate.sent(7)                      # a replicate request with sequence 7 is out
        gate.hold(replies)                # -> []: they wait for 7
        gate.acknowledged(7)              # -> replies
        gate.early(replies)               # -> the replies now, each with ``ticket`` 7
        gate.durable                      # 7: every request up to 7 is acknowledged

    A round's replies need not wait (:meth:`early`, docs/architecture.md §8.1): they
    leave at once, each naming the last ``replicate`` request made before it (its
    ``ticket``), and the worker keeps its pushes until a later reply from this
    server says that ticket is acknowledged (``durable``, which :meth:`durable`
    gives every reply); a push the backup may lack is then still the worker's to
    send again.
    """

    def __init__(self) -> None:
        self._unacked: set[int] = set()
        self._held: list[tuple[int, list[Reply]]] = []    # (the last sequence before them, replies)
        self._last = -1

    def sent(self, seq: int) -> None:
        self._unacked.add(seq)
        self._last = max(self._last, seq)

    @property
    def waiting(self) -> int:
        """Replicate requests not acknowledged yet."""
        return len(self._unacked)

    @property
    def durable(self) -> int:
        """The highest sequence up to which every replicate request is acknowledged
        (sequences are consecutive: the link numbers them 1, 2, ...; -1: none sent)."""
        return min(self._unacked) - 1 if self._unacked else self._last

    def hold(self, replies: list[Reply]) -> list[Reply]:
        """``replies`` made now: those that may leave (all, when nothing is unacknowledged
        and nothing is held), the others kept (values copied)."""
        if not self._unacked and not self._held:
            return replies
        if replies:
            self._held.append((self._last, [Reply(r.peer, r.header, [np.array(a, copy=True) for a in r.arrays])
                                            for r in replies]))
        return []

    def early(self, replies: list[Reply]) -> list[Reply]:
        """``replies`` made now, to leave at once: while a replicate request is
        unacknowledged, each names the last one made (``ticket``), which the worker
        waits to see durable before it forgets the pushes they answer. With more than
        :data:`AHEAD` requests unacknowledged (a backup slower than its primary) they
        are held instead: the gate is then the backpressure that bounds the primary's
        queue to the backup and the pushes the workers keep."""
        if not self._unacked:
            return replies
        if len(self._unacked) > AHEAD:
            return self.hold(replies)
        return [Reply(r.peer, {**r.header, "ticket": self._last}, r.arrays) for r in replies]

    def acknowledged(self, seq: int) -> list[Reply]:
        """The backup acknowledged ``seq``: the replies that may leave now."""
        self._unacked.discard(seq)
        return self._release()

    def open(self) -> list[Reply]:
        """The backup is gone (its replica with it): every held reply leaves."""
        self._unacked.clear()
        return self._release()

    def forget(self, seqs) -> list[Reply]:
        """One of several backups is gone: its requests ``seqs`` will never be
        acknowledged; the replies that may leave now."""
        self._unacked.difference_update(seqs)
        return self._release()

    def _release(self) -> list[Reply]:
        oldest = min(self._unacked, default=None)
        out: list[Reply] = []
        while self._held and (oldest is None or self._held[0][0] < oldest):
            out += self._held.pop(0)[1]
        return out


class Replicas:
    """The backup's side: replicas of other servers' chunks, by their primary's rank.
    ``alloc(size, dtype)``: memory for a replica's values, counted in ``budget``
    (``KVSTORE_SERVER_MEMORY``) as the server's own values are."""

    def __init__(self, name: str, optimizer: ServerOptimizer, alloc: Callable,
                 budget: MemoryBudget | None = None):
        self.name = name
        self.budget = budget or MemoryBudget(None)
        self.optimizer = optimizer
        self.alloc = alloc
        # the shares it backs up (a share: server s's chunks as the job formed; its
        # primary is s, or the server that took it over when s died)
        self.primaries: frozenset[int] = frozenset()
        # share -> {chunk id: [value, rounds applied, {worker: its last push applied} (dist_async)
        #                      or {worker: its base} (dist_sync, the workers that joined:
        #                      kvstore.server.numbering), a row table's [shape, servers] or None]}
        self.held: dict[int, dict[tuple, list]] = {}
        self.dyn = DynReplicas(name, optimizer, self.budget)    # the dynamic tables' replicas, by share

    def nbytes(self) -> int:
        return sum(entry[0].nbytes for chunks in self.held.values() for entry in chunks.values()) + self.dyn.nbytes()

    def share_of(self, header: dict) -> int:
        """The share a ``replicate`` request is for (``share``, else its sender's own),
        checked: one this server backs up."""
        primary = header.get("src")
        share = header.get("share", primary)
        if not (is_int(share) and share in self.primaries):
            whose = f"server {primary!r}" if share == primary else f"server {share!r}'s share (from server {primary!r})"
            raise InvalidArgumentError(f"{self.name} holds no replica for {whose} "
                                       "(replicate comes from the primaries it backs up, KVSTORE_REPLICAS=1)")
        return share

    def on_replicate(self, peer, header: dict, arrays: list) -> list[Reply]:
        """A ``replicate`` request from a primary. Everything is checked before anything
        changes; a wrong request (not for a share this one backs up, a round out of
        order, a shape that differs) is an error reply."""
        primary = self.share_of(header)       # the share's (its replicas are held by share)
        kind = header.get("kind")
        held = self.held.setdefault(primary, {})
        if kind == STATES:
            return self._set_states(peer, header, arrays, primary, held)
        if kind in (ROW_ROUNDS, ROW_SET):
            return self._rows(peer, header, arrays, primary, held)
        if kind in (DYN_INIT, DYN_ROUNDS):
            return self.dyn.on_replicate(peer, header, arrays, primary)
        lazy = header.get("lazy")
        indices: list = []
        if kind == ROUNDS and lazy is not None:   # lazy updates: the values' indices after the sums
            if not (isinstance(lazy, list) and isinstance(header.get("chunks"), list)
                    and len(lazy) == len(header["chunks"]) and all(isinstance(x, bool) for x in lazy)
                    and len(arrays) == len(lazy) + sum(lazy)):
                raise ProtocolError("'lazy' must be a list of true or false, one per chunk, with one index "
                                    "buffer after the sums for each true")
            extra = iter(arrays[len(lazy):])
            arrays = arrays[:len(lazy)]
            indices = [np.asarray(next(extra)) if x else None for x in lazy]
        ids = chunk_ids(header, arrays)
        indices = indices or [None] * len(ids)
        flat = [np.asarray(a).reshape(-1) for a in arrays]
        if kind == INIT:
            tables = header.get("tables", [None] * len(ids))
            if not (isinstance(tables, list) and len(tables) == len(ids) and all(
                    t is None or (isinstance(t, list) and len(t) == 2 and isinstance(t[0], list) and t[0]
                                  and all(is_int(n) and n >= 0 for n in t[0]) and is_int(t[1]) and t[1] >= 1)
                    for t in tables)):
                raise ProtocolError("'tables' must be a list with one [shape, servers] (or null) per chunk")
            for cid, a in zip(ids, flat):
                if cid in held and (held[cid][0].shape != a.shape or held[cid][0].dtype != a.dtype):
                    raise InvalidArgumentError(f"replicate init of {chunk_label(cid)}: it holds a replica of "
                                               "another shape")
            applied = header.get("applied", [None] * len(ids))     # a rebuild: rounds and last pushes
            if not (isinstance(applied, list) and len(applied) == len(ids) and all(
                    x is None or (isinstance(x, list) and len(x) == 2 and is_int(x[0]) and x[0] >= 0
                                  and isinstance(x[1], list) and all(
                                      isinstance(p, list) and len(p) == 2 and all(is_int(v) and v >= 0 for v in p)
                                      for p in x[1]))
                    for x in applied)):
                raise ProtocolError("'applied' must be a list with one [rounds, [[worker, push], ...]] "
                                    "(or null) per chunk")
            for cid, t in zip(ids, tables):     # a resumed row table: its replica came with the restore
                if cid in held and t is not None:
                    held[cid][3] = t
            for cid, a, x, t in zip(ids, flat, applied, tables):   # a rebuild: the primary's value now
                if x is not None and cid in held:
                    held[cid][0][...] = a
                    held[cid][1:] = [x[0], {w: n for w, n in x[1]}, t]
            fresh = [(cid, a) for cid, a in zip(ids, flat) if cid not in held]
            with self.budget.holding(sum(a.nbytes for _, a in fresh),
                                     f"the replicas of {len(fresh)} chunk(s) of server {primary} on {self.name}"):
                meta = dict(zip(ids, tables))
                counts = {cid: x for cid, x in zip(ids, applied) if x is not None}
                for cid, a in fresh:
                    value = self.alloc(a.size, a.dtype)
                    value[...] = a
                    x = counts.get(cid)
                    held[cid] = [value, 0, {}, meta[cid]] if x is None else \
                        [value, x[0], {w: n for w, n in x[1]}, meta[cid]]
            return [ok(peer, header["id"])]
        if kind != ROUNDS:
            raise ProtocolError(f"'kind' must be one of {[INIT, ROUNDS, STATES, ROW_ROUNDS, ROW_SET, DYN_INIT, DYN_ROUNDS]}"
                                f", got {kind!r}")
        numbers, updated = header.get("rounds"), header.get("updated")
        if not (isinstance(numbers, list) and len(numbers) == len(ids) and all(is_int(n) for n in numbers)):
            raise ProtocolError("'rounds' must be a list of round numbers, one per chunk")
        if not isinstance(updated, bool):
            raise ProtocolError("'updated' must be true or false")
        pushes = pushes_field(header, len(ids))
        updater = self.optimizer.updater
        if updated and updater is None:
            raise InvalidArgumentError(f"server {primary} applied a round with an optimizer, but {self.name} "
                                       "has none: set_optimizer must reach every server")
        expected: dict = {}
        for cid, n, a in zip(ids, numbers, flat):
            entry = held.get(cid)
            if entry is None:
                raise InvalidArgumentError(f"replicate: {self.name} holds no replica of {chunk_label(cid)}")
            if a.shape != entry[0].shape or a.dtype != entry[0].dtype:
                raise InvalidArgumentError(f"replicate: round {n} of {chunk_label(cid)} is {a.size} x "
                                           f"{a.dtype.name}, the replica {entry[0].size} x {entry[0].dtype.name}")
            want = expected.get(cid, entry[1]) + 1
            if n != want:
                raise InvalidArgumentError(f"replicate: round {n} of {chunk_label(cid)} came, but the replica's "
                                           f"next round is {want} (a replicate request was lost or repeated)")
            expected[cid] = n
        for cid, a, idx in zip(ids, flat, indices):
            if idx is not None and (idx.dtype != np.int64 or idx.ndim != 1
                                    or (idx.size and (idx.min() < 0 or idx.max() >= a.size))):
                raise InvalidArgumentError(f"replicate: the lazy indices of {chunk_label(cid)} do not fit it")
        for cid, a, pusher, idx in zip(ids, flat, pushes, indices):
            entry = held[cid]
            if pusher is not None:
                entry[2][pusher[0]] = pusher[1]
            if updated:
                assert updater is not None
                try:
                    if idx is None:
                        updater(cid, np.array(a, copy=True), entry[0])
                    else:            # a row-sparse push on a dense key: the named values alone
                        updater.update_lazy(cid, np.array(a, copy=True), entry[0], idx)
                except Exception:   # the primary's update failed the same way: the round is counted
                    pass
            else:
                entry[0][...] = a
            entry[1] += 1
        return [ok(peer, header["id"])]

    def _rows(self, peer, header: dict, arrays: list, primary: int, held: dict) -> list[Reply]:
        """Row-sparse rounds (each chunk: its local rows and their data) applied to the
        replicas of row tables as the primary applied them (lazily, with the
        optimizer, or assigned), or a ``set_rows`` assignment; checked first."""
        ids = chunk_ids(header, None)
        if len(arrays) != 2 * len(ids):
            raise ProtocolError("a row replicate carries two buffers per chunk: local rows and data")
        rounding = header["kind"] == ROW_ROUNDS
        numbers = header.get("rounds") if rounding else [None] * len(ids)
        flags = header.get("updated") if rounding else [False] * len(ids)
        if not (isinstance(numbers, list) and len(numbers) == len(ids)
                and (not rounding or all(is_int(n) for n in numbers))):
            raise ProtocolError("'rounds' must be a list of round numbers, one per chunk")
        if not (isinstance(flags, list) and len(flags) == len(ids) and all(isinstance(f, bool) for f in flags)):
            raise ProtocolError("'updated' must be a list of true or false, one per chunk")
        pushes = pushes_field(header, len(ids)) if rounding else [None] * len(ids)
        updater = self.optimizer.updater
        expected: dict = {}
        work = []
        for i, (cid, n, updated) in enumerate(zip(ids, numbers, flags)):
            entry = held.get(cid)
            if entry is None or entry[3] is None:
                raise InvalidArgumentError(f"replicate: {self.name} holds no replica of the row table "
                                           f"{chunk_label(cid)}")
            width = int(np.prod(entry[3][0][1:], dtype=np.int64))
            local, data = np.asarray(arrays[2 * i]), np.asarray(arrays[2 * i + 1])
            rows = entry[0].size // width if width else 0
            if local.dtype != np.int64 or local.ndim != 1 or data.dtype != entry[0].dtype \
                    or data.size != local.size * width or (local.size and (local.min() < 0 or local.max() >= rows)):
                raise InvalidArgumentError(f"replicate: rows of {chunk_label(cid)} that do not fit its replica")
            if updated and updater is None:
                raise InvalidArgumentError(f"server {primary} applied a round with an optimizer, but "
                                           f"{self.name} has none: set_optimizer must reach every server")
            if rounding:
                want = expected.get(cid, entry[1]) + 1
                if n != want:
                    raise InvalidArgumentError(f"replicate: round {n} of {chunk_label(cid)} came, but the "
                                               f"replica's next round is {want} (a replicate request was lost "
                                               "or repeated)")
                expected[cid] = n
            work.append((cid, entry, width, local, data, updated, pushes[i]))
        for cid, entry, width, local, data, updated, pusher in work:
            if pusher is not None:           # dist_async: the worker's last push applied
                entry[2][pusher[0]] = pusher[1]
            weights = entry[0].reshape(-1, width)
            grad = np.array(data, copy=True).reshape(len(local), width)
            if updated:
                assert updater is not None
                try:
                    updater.update_rows(cid, local, grad, weights)
                except Exception:   # the primary's update failed the same way: the round is counted
                    pass
            else:
                weights[local] = grad
            if rounding:
                entry[1] += 1
        return [ok(peer, header["id"])]

    def _set_states(self, peer, header: dict, arrays: list, primary: int, held: dict) -> list[Reply]:
        """``load_optimizer_states`` reached the primary: the same state set on the
        replicas, checked as the primary checked it (kvstore.server.server_optimizer)."""
        def replica_of(cid) -> StoredChunk:
            if cid not in held:
                raise InvalidArgumentError(f"replicate states: {self.name} holds no replica of {chunk_label(cid)} "
                                           f"of server {primary}")
            return StoredChunk(held[cid][0])
        if self.optimizer.updater is None:
            raise InvalidArgumentError(f"server {primary} loaded optimizer states, but {self.name} has no "
                                       "optimizer: set_optimizer must reach every server")
        self.optimizer.set_states(header, arrays, replica_of)
        return [ok(peer, header["id"])]

    def became_member(self, worker: int, per_push: bool) -> None:
        """``worker`` became a member of the elastic job, a new process that numbers its
        pushes from 1 again: where pushes are applied one by one (``per_push``,
        dist_async) its last push applied is forgotten; where they join rounds, its
        base is each replica's rounds applied now (kvstore.server.numbering)."""
        for chunks in self.held.values():
            for entry in chunks.values():
                member_again(entry[2], worker, entry[1], per_push)
        self.dyn.became_member(worker, per_push)

    def promote(self, primary: int) -> dict[tuple, tuple[np.ndarray, int, dict, list | None]]:
        """Server ``primary`` died and this one serves its chunks now: each chunk's
        replica, the rounds applied to it, (dist_async) each worker's last push
        applied and (a row table) its ``[shape, servers]``, handed over (held no more)."""
        self.primaries = self.primaries - {primary}
        return {cid: (value, rounds, last, table)
                for cid, (value, rounds, last, table) in self.held.pop(primary, {}).items()}

    def drop(self, primary: int) -> None:
        """Server ``primary`` is served elsewhere now: its replica is of no use."""
        self.primaries = self.primaries - {primary}
        gone = self.held.pop(primary, {})
        self.budget.give(sum(entry[0].nbytes for entry in gone.values()))
        self.dyn.drop(primary)


def replicate_request(req_id: int, src: int, seq: int, fields: dict) -> dict:
    """The header of a ``replicate`` request from server ``src`` (its ``seq`` on the
    connection to its backup, as a worker's request has on its own)."""
    return {"op": ops.REPLICATE, "id": req_id, "src": src, "seq": seq, **fields}
