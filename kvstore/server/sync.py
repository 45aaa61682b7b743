"""Synchronous mode (BSP, ``dist_sync``): the consistency strategy whose pushes
merge into rounds, one per chunk at a time, each applied once.

Per chunk, pushes are merged into a round until every worker contributed once (in
an elastic job, a rank that is not a member counts with nothing:
kvstore.server.members); then the round is applied once (assigned, or given to
the optimizer) and every push that joined it is acknowledged. A worker that
pushes again before its round completed starts the next round. A pull is answered
once the sender has no push pending on the chunk (a pushpull once its own round
is applied), so a worker always reads the result of its own last push's round (a
write it was granted, or asked for, counts as a push: kvstore.server.write_in). If
the optimizer fails on a round, exactly the requests that depended on that round
get the error; later rounds proceed.

**Layer-wise rounds** (norms across servers, docs/architecture.md §9): a key cut
into chunks over several servers, updated by an optimizer whose step needs norms
over the whole key (LARS, LAMB: ``Optimizer.splits_norms``), is pushed with
``norms``. Its round then completes in two phases: when every worker has pushed,
phase 1 computes the chunk's sums of squares (``Updater.norm_terms``; nothing
changes yet) and answers every push with them; the round stays at the head of the
queue until the leading worker (rank 0) has added up every chunk's terms per key
and sent the sums (``apply_norms``); phase 2 then steps with them and the round is
applied as any other (pulls parked on it are answered).

**Deterministic sums** (``ordered``: ``KVSTORE_DETERMINISTIC=1`` or
``kvstore.create(..., deterministic=True)``, carried by ``configure``): a round's
pushes are added in worker-rank order whatever their arrival, so the same job on
the same data gives the same bits at any number of workers (floating-point
addition is not associative: arrival order changes the last bits once three
values meet). A push is added as soon as every lower rank's is in (the lowest
rank it speaks for orders a host's sum); one that comes early is held, as it came,
until then. Writes into the sum (write-in) are refused: their order is the order
of the grants.

When the scheduler reports that a worker finished (:meth:`Sync.workers_finished`),
every round still waiting for it fails at once naming it, and so does every later
push: such a round can never complete. A worker that left an elastic job
(:meth:`Sync.left`) is counted, contributing nothing, in every queued round it has
not pushed to.

:class:`Sync` is the one owner of a round's state: the sums, who pushed, the pushes
held for their turn, the writer, the requests parked on rounds. Writing in
(:class:`~kvstore.server.write_in.WriteQueue`) is its queue of writes and grants: Sync
takes the ``write`` and ``written`` requests, asks the queue which write is next,
grants it (opening the round, or giving it the round's sum to add to) and ends it.
The chunks and their rounds live in the server's
:class:`~kvstore.server.chunks.ChunkTable`. Pure: no sockets, threads or clocks.
"""

from __future__ import annotations

import math

import numpy as np

from ..devices.arrays import flat_view
from ..errors import InvalidArgumentError, ProtocolError
from ..modes import SYNC
from ..protocol import chunk_label, error_header, ops
from .chunks import ChunkTable
from .consistency import Consistency
from .members import Members
from .numbering import JoinBases
from .server_optimizer import ServerOptimizer
from .requests import ok
from .rounds import StoredChunk, ParkedRequest, Reply, Round
from .write_in import Grant, HeldPush, WriteQueue, write_request


LEADER = 0          # the worker that adds up layer-wise terms and sends apply_norms


class Sync(Consistency):
    """The sync rounds of the chunks in ``table`` for ``num_workers`` worker ranks
    (``ordered``: deterministic sums, a round's pushes added in rank order)."""

    mode = SYNC                   # rounds; row-sparse tables have rounds of their own (kvstore.server.tables)

    def __init__(self, table: ChunkTable, num_workers: int, members: Members, optimizer: ServerOptimizer,
                 bound: int | None = None, ordered: bool = False):
        super().__init__(table, num_workers, members, optimizer, bound, ordered)
        self.xp = table.backend.xp
        self.writes = WriteQueue()        # the writes queued and granted into these rounds
        self._applied: dict = {}       # chunk id -> rounds applied (to name a round by number)
        self._bases = JoinBases()      # replicated, elastic: where a joiner's push numbers start
        # requests answered with values once their other chunks are done: a chunk
        # whose round of theirs was applied keeps that value for them if a later
        # round changes it first (possible when a worker pushes again before its
        # reply, e.g. _pushpull_start then push)
        self._partial: dict = {}       # chunk id -> [ParkedRequest] done with it, not yet answered
        self._captured: dict = {}      # id(ParkedRequest) -> {chunk id: its value for it}

    # -- the strategy ---------------------------------------------------------------------
    def admit(self, worker: int, ids, want_values: bool) -> None:
        """Refuse a push (or write) into a round that a finished worker will never join."""
        gone = self.table.gone
        if not gone:
            return
        for cid in ids:
            chunk = self.table.chunks[cid]
            pos = self.round_to_join(chunk, worker)
            workers = chunk.rounds[pos].workers if pos < len(chunk.rounds) else set()
            if not gone <= workers:
                raise InvalidArgumentError(self.gone_message(cid, pos, workers))

    def push(self, peer, req_id, worker: int, ids, chunks, arrays, want_values: bool,
             group: frozenset | None, norms: bool = False, rows: list | None = None,
             rounds: list | None = None) -> list[Reply]:
        """A validated push (for ``group``, a host's sum; ``norms``: a layer-wise one;
        ``rows``: per chunk the values a row-sparse push named, see :class:`Round`)
        joins the rounds, or waits behind an earlier write of its worker that is not
        granted yet. ``rounds`` (replicated servers: the worker's number of this push
        of each chunk, 1, 2, ...): a chunk whose numbered round was applied already (a
        push re-sent after a failover, kvstore.server.replication) is not applied again."""
        done = self._applied_already(worker, ids, chunks, rounds) if rounds is not None else None
        for cid, chunk in zip(ids, chunks):
            if not chunk.rounds:          # (the first push of a round: nothing to disagree with)
                continue
            pos = self.round_to_join(chunk, worker)
            if pos < len(chunk.rounds) and chunk.rounds[pos].layerwise != norms:
                raise InvalidArgumentError(
                    f"{chunk_label(cid)}: worker {worker}'s push {'asks' if norms else 'does not ask'} for "
                    f"norms across servers, but round {self._applied.get(cid, 0) + pos + 1} was opened by pushes "
                    f"that {'do not' if norms else 'do'}: the workers disagree on the optimizer or the key's chunks")
        if self.writes.ahead(worker, ids):
            if group is not None:    # a host's leader does not write in (kvstore.hostgroup.group)
                raise InvalidArgumentError(f"worker {worker} pushed a host's sum while its write was pending")
            # that write takes its round first (kvstore.server.write_in), then this push the next one
            self.writes.hold(HeldPush(peer, req_id, worker, ids, chunks, arrays, want_values, rows))
            return []
        return self.join(peer, req_id, worker, ids, chunks, arrays, want_values, group, norms, rows, done)

    def _applied_already(self, worker: int, ids, chunks, rounds: list) -> set:
        """Of a numbered push (``rounds``), the chunks whose round was applied already;
        InvalidArgumentError for a number that is neither that nor the next round."""
        done = set()
        for cid, chunk, number in zip(ids, chunks, rounds):
            applied = self._applied.get(cid, 0) - self._bases.base(cid, worker)   # of this worker's pushes
            expected = applied + self.round_to_join(chunk, worker) + 1
            if number <= applied:
                done.add(cid)
            elif number != expected:
                raise InvalidArgumentError(f"{chunk_label(cid)}: worker {worker} pushes its round {number}, but "
                                           f"its next round on {self.table.name} is {expected}")
        return done

    def adopt(self, cid, rounds: int, last: dict | None = None) -> None:
        self._applied[cid] = rounds
        self._bases.adopt(cid, last)

    def applied(self, cid) -> tuple[int, dict]:
        return self._applied.get(cid, 0), self._bases.of(cid)

    def became_member(self, worker: int) -> None:
        self._bases.joined(worker, ((cid, self._applied.get(cid, 0)) for cid in self.table.chunks))

    def pull(self, peer, req_id, worker: int, ids, chunks) -> list[Reply]:
        parked = ParkedRequest(peer, req_id, worker, ids, True,
                          {cid for cid, c in zip(ids, chunks)
                           if c.pending_from(worker) or self._writing(worker, cid, c)})
        if not parked.blocked:
            return [self.finish(parked)]
        for cid in parked.blocked:
            self.table.chunks[cid].waiting.append(parked)
        return []

    def workers_finished(self) -> list[Reply]:
        """Every round still waiting for a finished worker (``table.gone``) fails now,
        and so do the requests that depend on it. Returns the replies."""
        replies = []
        gone = self.table.gone
        for cid, chunk in self.table.chunks.items():
            # a worker joins rounds in order: those it is missing from are a suffix
            first = next((i for i, rnd in enumerate(chunk.rounds) if not gone <= rnd.workers), None)
            leaderless = LEADER in gone and bool(chunk.rounds) and chunk.rounds[0].terms is not None
            if leaderless:
                first = 0                 # its norms will never come: nor can the rounds after it
            if first is None:
                continue
            for pos in range(first, len(chunk.rounds)):
                rnd = chunk.rounds[pos]
                message = self.gone_message(cid, pos, rnd.workers) if not leaderless else (
                    f"worker {LEADER}, the leader that adds up a key's norms across servers, closed its store "
                    f"while round {self._applied.get(cid, 0) + 1} of {chunk_label(cid)} awaits them")
                self.fail_round(cid, chunk, rnd, message)
            del chunk.rounds[first:]
            replies += self.release(cid, chunk)
        return replies + self._fail_queued()

    def left(self, worker: int, message: str) -> list[Reply]:
        """``worker`` left the elastic job: its parked requests get ``message``; it
        counts, with nothing, in every queued round it has not pushed to."""
        parked = {id(p): p for chunk in self.table.chunks.values() for p in chunk.waiting if p.worker == worker}
        for key in parked:
            self._captured.pop(key, None)
        for cid in self._partial:
            self._partial[cid] = [p for p in self._partial[cid] if p.worker != worker]
        queued = self.writes.leave(worker)
        replies = [Reply(r.peer, error_header(r.req_id, "RemoteError", message))
                   for r in [*parked.values(), *queued]]
        for cid, chunk in self.table.chunks.items():
            chunk.waiting = [p for p in chunk.waiting if p.worker != worker]
            # a round it was writing into holds an unknown part of its gradient: dropped
            for pos, rnd in enumerate(chunk.rounds):
                if rnd.writer == worker:
                    number = self._applied.get(cid, 0) + pos + 1
                    self.fail_round(cid, chunk, rnd, (
                        f"{message} while writing into round {number} of {chunk_label(cid)}: that "
                        "round's sum is incomplete, so it was dropped with every push in it"))
            chunk.rounds = [rnd for rnd in chunk.rounds if rnd.writer != worker]
            for rnd in chunk.rounds:
                if worker not in rnd.workers:
                    rnd.workers.add(worker)
                    rnd.filled |= {worker}
                    self._fold(chunk, rnd)        # a push held for its turn may be next now
            replies += self.apply_complete(cid, chunk) + self.release(cid, chunk)
        return replies + self._grant_ready()

    def queued_rounds(self):
        """(chunk id, round) of every round still waiting (for the stall inspector)."""
        for cid, chunk in self.table.chunks.items():
            for rnd in chunk.rounds:
                yield cid, rnd

    # (stalled: no reads wait here but on rounds, which queued_rounds lists)

    # -- writing in (kvstore.server.write_in: the queue of writes and their grants) ---------
    def write(self, peer, header: dict) -> list[Reply]:
        """A ``write`` request (no buffers, shared sums, uncompressed, sums in arrival
        order: checked by the caller): queued, and granted once its rounds have no
        other writer."""
        worker, ids, want_values = write_request(header, self.num_workers)
        chunks = self.table.existing(ids)
        self.admit(worker, ids, want_values)
        for cid, chunk in zip(ids, chunks):
            pos = self.round_to_join(chunk, worker)
            if pos < len(chunk.rounds) and chunk.rounds[pos].layerwise:
                raise InvalidArgumentError(f"{chunk_label(cid)}: its round takes layer-wise pushes (norms "
                                           "across servers); a write cannot join it")
        if self.optimizer.updater is not None:
            for cid, chunk in zip(ids, chunks):
                if chunk.value.dtype.kind != "f":
                    raise InvalidArgumentError(f"{chunk_label(cid)} holds {chunk.value.dtype.name}: "
                                               "optimizers update floating-point values only")
        self.writes.queue(Grant(peer, header["id"], worker, ids, chunks, want_values))
        return self._grant_ready()

    def written(self, peer, header: dict) -> list[Reply]:
        """``written``: the grant ends; its worker counts as having pushed and is
        answered as a pushpull once its rounds are applied."""
        worker, grant = self.writes.take(header, self.num_workers)
        if grant.error is not None:          # its rounds failed meanwhile (a worker finished)
            return [Reply(peer, error_header(header["id"], "InvalidArgumentError", grant.error))]
        parked = ParkedRequest(peer, header["id"], worker, grant.ids, grant.want_values, set(grant.ids))
        for chunk in grant.chunks:
            chunk.waiting.append(parked)
        ready = []
        for cid, chunk, rnd in zip(grant.ids, grant.chunks, grant.rounds):
            rnd.writer = None
            rnd.workers.add(worker)
            for grad in rnd.deferred:          # pushes that came while it wrote
                rnd.acc += grad
            rnd.deferred = []
            parked.rounds[cid] = rnd
            ready += self.apply_complete(cid, chunk)
        return ready + self._grant_ready()

    def _writing(self, worker: int, cid, chunk: StoredChunk) -> bool:
        """Whether ``worker`` has a write on ``cid`` that is granted and not ``written``,
        or queued (or a push queued behind one): its round is still to come."""
        return (bool(chunk.rounds) and any(r.writer == worker for r in chunk.rounds)) or self.writes.queued(worker, cid)

    def _grant_ready(self) -> list[Reply]:
        """Grant every queued write whose rounds have no writer now, oldest first; a
        worker's requests on a chunk go in the order they came (a push held behind
        its write joins the rounds once the write is granted)."""
        replies: list[Reply] = []
        refused: list = []           # chunks of refused writes: pulls parked behind them go on

        def join(push: HeldPush) -> None:
            replies.extend(self.join(push.peer, push.req_id, push.worker, push.ids, push.chunks,
                                     push.arrays, push.want_values, rows=push.rows))
        self.writes.advance(lambda request: self._grant(request, replies, refused), join)
        for cid, chunk in refused:
            replies += self.release(cid, chunk)
        return replies

    def _grant(self, request: Grant, replies: list, refused: list) -> bool:
        """Grant ``request`` the sums of its rounds (False: one has a writer, it waits),
        or refuse it whole if a sum is not in shared memory; its reply to ``replies``."""
        targets = [next((r for r in chunk.rounds if r.open_to(request.worker)), None)
                   for chunk in request.chunks]
        if any(r is not None and r.writer is not None for r in targets):
            return False
        accs = [rnd.acc if rnd is not None and rnd.acc is not None else self.take_spare(chunk)
                for chunk, rnd in zip(request.chunks, targets)]
        private = [cid for cid, acc in zip(request.ids, accs) if not self.table.backend.shared(acc)]
        if private:                        # refuse the whole request; nothing is granted
            for chunk, rnd, acc in zip(request.chunks, targets, accs):
                if rnd is None or rnd.acc is not acc:
                    chunk.spare = acc      # give back what was taken for it
            replies.append(Reply(request.peer, error_header(
                request.req_id, "InternalError",
                f"{self.table.name}: cannot grant worker {request.worker} a write into "
                f"{chunk_label(private[0])}: its sum is not in shared memory (none could be "
                "allocated); set KVSTORE_WRITE_IN=0 to push instead")))
            refused += zip(request.ids, request.chunks)
            return True
        modes, rounds = [], []
        for chunk, rnd, acc in zip(request.chunks, targets, accs):
            if rnd is None:                # opens the round: copy into a fresh accumulator
                rnd = self.opened(chunk, acc)
                modes.append(ops.COPY)
            else:
                if rnd.acc is None:        # its first push came in a message
                    rnd.acc = acc
                    self.xp.copyto(rnd.acc, rnd.first)
                    rnd.first = None
                modes.append(ops.ADD)
            rnd.rows = None                # a write names every value: the round is dense
            rnd.writer = request.worker
            rounds.append(rnd)
        self.writes.granted(request, rounds)
        replies.append(ok(request.peer, request.req_id, [r.acc for r in rounds], modes=modes, write_in=True))
        return True

    def _fail_queued(self) -> list[Reply]:
        """Every queued write and held push fails: a worker finished, so the rounds
        they would join cannot complete (see workers_finished)."""
        replies = []
        for entry in self.writes.drain():
            cid, chunk = entry.ids[0], entry.chunks[0]
            pos = self.round_to_join(chunk, entry.worker)
            replies.append(Reply(entry.peer, error_header(
                entry.req_id, "InvalidArgumentError", self.gone_message(cid, pos, set()))))
        return replies

    # -- rounds ---------------------------------------------------------------------------
    def join(self, peer, req_id, worker: int, ids, chunks, arrays, want_values: bool,
             group: frozenset | None = None, norms: bool = False, rows: list | None = None,
             done: set | None = None) -> list[Reply]:
        """A validated push (for ``group``, a host's sum) joins the rounds; the replies
        now ready. ``done`` (replicated servers): chunks whose round of this push was
        applied already."""
        # Park the request first: completing (or failing) the rounds below answers
        # it through the same path as everyone else waiting on those chunks.
        parked = ParkedRequest(peer, req_id, worker, ids, want_values, set(ids) - done if done else set(ids), norms=norms)
        if not parked.blocked:
            return [self.finish(parked)]
        for cid, chunk in zip(ids, chunks):
            if not done or cid not in done:
                chunk.waiting.append(parked)
        ready, ranks = [], group or frozenset((worker,))
        with self.table.backend.batched():    # on a GPU: one launch for the updates it completes
            for i, (cid, chunk, grad) in enumerate(zip(ids, chunks, arrays)):
                if done and cid in done:
                    continue
                parked.rounds[cid] = self.contribute(cid, chunk, ranks, flat_view(grad), norms,
                                                      None if rows is None else rows[i])
                ready += self.apply_complete(cid, chunk)
        return ready

    def contribute(self, cid, chunk: StoredChunk, ranks: frozenset, grad: np.ndarray, layerwise: bool = False,
                   rows: np.ndarray | None = None) -> Round:
        """Add one worker's push (``ranks``: it, or the workers a host's sum speaks
        for) to the first round none of them has contributed to; ``rows``: the values
        it named (a row-sparse push on a dense key), joined to the round's, or None
        (every value: the round is then dense).

        A round's first push is kept as it came (a view on the message, or on the
        worker's shared memory, which the worker leaves alone until the round is
        acknowledged); the second is added to it in one pass into the accumulator
        (2 reads + 1 write of the chunk instead of copy + add's 3 + 2)."""
        for rnd in chunk.rounds:
            if rnd.open_to_all(ranks):
                rnd.rows = None if rnd.rows is None or rows is None else rnd.rows | rows
                if rnd.writer is not None:     # a worker is writing into acc: add after it
                    rnd.deferred.append(grad)
                elif self.ordered:
                    rnd.held[min(ranks)] = (ranks, grad)
                else:
                    self._add(chunk, rnd, grad)
                rnd.workers.update(ranks)
                if rnd.held:                   # (deterministic sums: pushes held for their turn)
                    self._fold(chunk, rnd)
                return rnd
        rnd = self.opened(chunk, None, first=None if self.ordered else grad)
        rnd.layerwise = layerwise
        rnd.rows = None if rows is None else rows.copy()
        if self.ordered:
            rnd.held[min(ranks)] = (ranks, grad)
        rnd.workers.update(ranks)
        if rnd.held:
            self._fold(chunk, rnd)
        return rnd

    def _add(self, chunk: StoredChunk, rnd: Round, grad) -> None:
        """Add ``grad`` to the round's sum: the first is kept as it came, the second
        added to it into the accumulator, the others added there."""
        if rnd.acc is None and rnd.first is None:
            rnd.first = grad
        elif rnd.acc is None:
            rnd.acc = self.take_spare(chunk)
            self.xp.add(rnd.first, grad, out=rnd.acc)
            rnd.first = None
        else:
            rnd.acc += grad

    def _fold(self, chunk: StoredChunk, rnd: Round) -> None:
        """Deterministic sums: add the held pushes that are next in rank order (every
        lower rank added already, or counted without a push: an elastic rank that is
        no member, a worker that left)."""
        while rnd.held:
            coming = set().union(*(ranks for ranks, _ in rnd.held.values()))
            done = rnd.folded | (rnd.workers - coming)      # added, or never pushing
            nxt = next(r for r in range(self.num_workers) if r not in done)
            part = rnd.held.pop(nxt, None)
            if part is None:                  # a lower rank's push has not come yet
                return
            ranks, grad = part
            self._add(chunk, rnd, grad)
            rnd.folded |= ranks

    def opened(self, chunk: StoredChunk, acc, first=None) -> Round:
        """A new round of ``chunk``, queued, that counts every rank that is not a member
        from the start (none unless the job is elastic)."""
        absent = self.members.absent(self.num_workers)
        rnd = Round(acc, set(absent), first=first, filled=absent)
        chunk.rounds.append(rnd)
        return rnd

    def take_spare(self, chunk: StoredChunk) -> np.ndarray:
        self.table.backend.settle(chunk.value)    # a batched update still reading the spare goes first
        if chunk.spare is not None:
            acc, chunk.spare = chunk.spare, None
            return acc
        return self.table.alloc(chunk.value.size, chunk.value.dtype)

    def apply_complete(self, cid, chunk: StoredChunk) -> list[Reply]:
        """Apply every round at the head of ``chunk``'s queue that every rank is in (a
        layer-wise round: run its phase 1 and stop, until its norms come)."""
        replies = []
        while chunk.rounds and len(chunk.rounds[0].workers) == self.num_workers:
            rnd = chunk.rounds[0]
            if rnd.layerwise:
                if rnd.terms is None:
                    replies += self._phase1(cid, chunk, rnd)
                if rnd.terms is not None:
                    break                 # awaits apply_norms
                continue                  # phase 1 failed: the round was dropped
            chunk.rounds.pop(0)
            replies += self._commit(cid, chunk, rnd, None if self.optimizer.updater is None else
                                    (lambda acc, value: self.update(cid, acc, value, rnd.rows)))
        return replies

    def _summed(self, chunk: StoredChunk, rnd: Round) -> np.ndarray:
        """The round's sum in its accumulator (one worker: its push copied there)."""
        if rnd.acc is None:
            rnd.acc = self.take_spare(chunk)
            self.xp.copyto(rnd.acc, rnd.first)
            rnd.first = None
        return rnd.acc

    def _commit(self, cid, chunk: StoredChunk, rnd: Round, update) -> list[Reply]:
        """Apply ``rnd`` (popped from the queue): ``update(sum, value)`` in place, or
        (None: no optimizer) the sum becomes the value; then answer what waited."""
        self._applied[cid] = self._applied.get(cid, 0) + 1
        self.table.backend.settle(chunk.value)     # a batched update of it (an earlier round) goes first
        for waiting in self._partial.pop(cid, ()):    # the value is about to change
            if waiting.blocked:                          # (not answered yet)
                self._captured.setdefault(id(waiting), {}).setdefault(cid, self.xp.copy(chunk.value))
        acc = self._summed(chunk, rnd)
        # replicated servers: the backup applies the same sum before anyone is answered
        if self.replication.active:
            self.replication.round_applied(cid, self._applied[cid], acc, update is not None, rows=rnd.rows)
        if update is None:
            # no optimizer: the merged sum becomes the value; the old value
            # buffer is recycled as the next round's accumulator
            chunk.value, acc = acc, chunk.value
        else:
            try:
                update(acc, chunk.value)
            except Exception as e:  # an optimizer failure must not leave workers waiting
                self._fail_depending(cid, chunk, rnd, f"applying the optimizer to {chunk_label(cid)} failed: "
                                                      f"{type(e).__name__}: {e}")
        chunk.spare = acc
        return self.release(cid, chunk)

    def _fail_depending(self, cid, chunk: StoredChunk, rnd: Round, message: str) -> None:
        for parked in chunk.waiting:
            joined = parked.rounds.get(cid)
            if joined is rnd or (joined is None and parked.worker in rnd.workers):
                parked.error = message   # answered with it when it completes

    # -- layer-wise rounds (norms across servers) --------------------------------------------
    def _phase1(self, cid, chunk: StoredChunk, rnd: Round) -> list[Reply]:
        """The complete layer-wise round at the head of ``chunk``: its chunk's terms
        (nothing changes); the pushes that joined it are answered with them. If that
        fails the round is dropped as a failed update is, naming the error."""
        updater = self.optimizer.updater
        try:
            if updater is None or not updater.optimizer.splits_norms:
                raise InvalidArgumentError("no optimizer that splits its update by norms is set")
            rnd.terms, rnd.carry = updater.norm_terms(cid, self._summed(chunk, rnd), chunk.value)
            rnd.number = self._applied.get(cid, 0) + 1
        except Exception as e:
            rnd.terms = rnd.carry = None
            chunk.rounds.pop(0)
            self._applied[cid] = self._applied.get(cid, 0) + 1
            self._fail_depending(cid, chunk, rnd, f"the norms of {chunk_label(cid)} failed: {type(e).__name__}: {e}")
            if rnd.acc is not None:
                chunk.spare = rnd.acc
        return self.release(cid, chunk)

    def apply_norms(self, peer, req_id, ids, chunks, sums, numbers, want_values: bool) -> list[Reply]:
        """``apply_norms``: the leader's sums of every chunk's terms per key, for the
        layer-wise rounds awaiting them at the head of ``chunks``' queues (round
        ``numbers``). All are checked first: a wrong request changes nothing."""
        updater = self.optimizer.updater
        if not (isinstance(sums, list) and isinstance(numbers, list) and len(sums) == len(numbers) == len(ids)):
            raise ProtocolError("apply_norms needs 'sums' and 'rounds', one per chunk")
        heads = []
        for cid, chunk, total, number in zip(ids, chunks, sums, numbers):
            head = chunk.rounds[0] if chunk.rounds else None
            if head is None or head.terms is None:
                raise InvalidArgumentError(f"apply_norms: no round of {chunk_label(cid)} awaits its key's norms "
                                           f"on {self.table.name}")
            if number != head.number:
                raise InvalidArgumentError(f"apply_norms names round {number!r} of {chunk_label(cid)}, but round "
                                           f"{head.number} awaits its key's norms")
            if not (isinstance(total, list) and len(total) == len(head.terms)
                    and all(isinstance(x, float) and math.isfinite(x) and x >= 0 for x in total)):
                raise InvalidArgumentError(f"apply_norms: {chunk_label(cid)} needs {len(head.terms)} finite sums "
                                           f">= 0, got {total!r}")
            heads.append(head)
        assert updater is not None          # phase 1 ran with it
        replies = []
        for cid, chunk, total, rnd in zip(ids, chunks, sums, heads):
            chunk.rounds.pop(0)
            carry, rnd.carry = rnd.carry, None
            rows = None if rnd.rows is None else self.table.backend.upload(np.flatnonzero(rnd.rows))
            replies += self._commit(cid, chunk, rnd, lambda acc, value: updater.apply_norms(
                cid, acc, value, total, carry, rows=rows))
            replies += self.apply_complete(cid, chunk)   # the next round's phase 1, if it is complete
        values = [c.value for c in chunks] if want_values else []
        return [ok(peer, req_id, self.table.backend.download(values, copy=True))] + replies

    def release(self, cid, chunk: StoredChunk) -> list[Reply]:
        """Answer the requests parked on ``chunk`` that no longer wait for it (and for
        no other chunk)."""
        replies, still = [], []
        for parked in chunk.waiting:
            # (a push whose round was applied, nothing queued after it: done here, the
            # common case, decided without _waits' calls)
            if (chunk.rounds or cid not in parked.rounds) and self._waits(parked, cid, chunk):
                still.append(parked)
                continue
            parked.blocked.discard(cid)
            if not parked.blocked:
                replies.append(self.finish(parked))
            elif parked.want_values:
                self._partial.setdefault(cid, []).append(parked)
        chunk.waiting = still
        return replies

    def _waits(self, parked: ParkedRequest, cid, chunk: StoredChunk) -> bool:
        """A push waits for its own round; a pull for every round of its worker,
        including the one a write of that worker (granted, or still queued) goes to."""
        if parked.waits_on(cid, chunk):
            return True
        return cid not in parked.rounds and self._writing(parked.worker, cid, chunk)

    def finish(self, parked: ParkedRequest) -> Reply:
        captured = self._captured.pop(id(parked), {})
        if parked.error is not None:
            return Reply(parked.peer, error_header(parked.req_id, "RemoteError", parked.error))
        if parked.norms:        # phase 1 of its rounds ran: their terms, for the leader to add up
            rounds = [parked.rounds[cid] for cid in parked.chunks]
            return ok(parked.peer, parked.req_id, [np.asarray(r.terms, np.float64) for r in rounds],
                      rounds=[r.number for r in rounds])
        chunks = self.table.chunks
        # Values are sent without a copy: in sync mode a chunk cannot change again
        # before this worker, who is blocked on this reply, pushes to it. Unless it
        # has pushed (or asked to write) again already, which a worker that did not
        # wait for this reply can (_pushpull_start, then a push): then its next round
        # may complete before the reply is read, so it gets a copy.
        values = [captured.get(cid, chunks[cid].value) for cid in parked.chunks] \
            if parked.want_values else []
        worker = parked.worker
        ahead = bool(values) and (
            any(self._writing(worker, cid, chunks[cid]) or chunks[cid].pending_from(worker)
                for cid in parked.chunks if chunks[cid].rounds)
            or (self.writes.waiting() and any(self.writes.queued(worker, cid) for cid in parked.chunks)))
        # a captured value is a copy made for this reply alone: it must not be left on
        # the device for a worker to read by reference after the reply dropped it
        return ok(parked.peer, parked.req_id, self.table.backend.values(values, copy=ahead or bool(captured)))

    # -- rounds that cannot complete ------------------------------------------------------
    def fail_round(self, cid, chunk: StoredChunk, rnd: Round, message: str) -> None:
        """``rnd`` will never be applied: the requests that depend on it (pushes that
        joined it, later reads of the workers that pushed to it, its writer's grant)
        are answered with ``message`` once they wait for nothing else."""
        for parked in chunk.waiting:
            joined = parked.rounds.get(cid)
            if joined is rnd or (joined is None and (parked.worker in rnd.workers - rnd.filled
                                                     or rnd.writer == parked.worker)):
                parked.error = parked.error or message
        self.writes.fail_grants_into(rnd, message)

    def gone_message(self, cid, pos: int, workers) -> str:
        """Why round ``pos`` (in the chunk's queue) of ``cid`` cannot complete."""
        missing = sorted(self.table.gone - set(workers))
        who = ", ".join(map(str, missing))
        many = len(missing) > 1
        number = self._applied.get(cid, 0) + pos + 1
        return (f"worker{'s' if many else ''} {who} closed {'their' if many else 'its'} "
                f"store while round {number} of {chunk_label(cid)} waits for "
                f"{'their' if many else 'its'} push: every worker must take the same "
                "number of steps (give each the same number of batches, e.g. with kvstore.torch.shard)")

    def round_to_join(self, chunk: StoredChunk, worker: int) -> int:
        """The position in ``chunk``'s queue of the round ``worker``'s next push joins."""
        for i, r in enumerate(chunk.rounds):       # (a loop: next() over a generator cost more, per chunk)
            if r.open_to(worker):
                return i
        return len(chunk.rounds)

