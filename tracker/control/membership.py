"""A node's membership in a job: registration, heartbeats, barrier (and the
all-gather that rides on it), finish.

Every server and worker holds one :class:`Membership`. Requests (register,
barrier, progress, finish) go over a control socket owned by the calling thread;
a background thread owns a second socket that sends heartbeats and hears
``abort``, ``shutdown``, (elastic jobs) ``members`` and (replicated servers)
``servers`` from the scheduler. Both
sockets have deadlines, so no call waits for a dead scheduler forever.

A scheduler that dies may be restarted by the launcher on the same address
(docs/architecture.md §8.2): a node that hears nothing from it keeps trying for
``KVSTORE_SCHEDULER_RESTART_TIMEOUT`` after the heartbeat timeout, and when an
``ack`` names another scheduler (its ``incarnation``) than the one it registered
with, the heartbeat thread registers again with what it knows of the job
(``rejoin``: :mod:`tracker.control.recovery`); a request the old scheduler never
answered is sent again once that registration is answered.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import zmq

from . import env, wire
from .errors import Disagreement, JobAborted, RendezvousError, RendezvousTimeout
from .records import Released, gather_budget
from .security import Security

log = logging.getLogger(__name__)

SLICE = 0.1  # seconds: how often a waiting call re-checks the abort flag
# a barrier's (and a registration's) own deadline lies this much after the scheduler's,
# which answers first naming who did not arrive or acknowledge (the waiter cannot know)
BARRIER_GRACE = 2.0


@dataclass(frozen=True)
class Registration:
    """What the scheduler tells a node once the whole job has registered (or, in an
    elastic job, once the servers acknowledged a worker that joined it)."""
    rank: int
    num_workers: int    # workers in the job now (len(members))
    num_servers: int
    servers: list       # data-plane address of each server, by rank
    workers: list       # "host:pid" of each worker rank, by rank ("" where vacant)
    worker_ranks: int | None = None   # worker ranks 0..worker_ranks-1 (elastic: MAX); None: num_workers
    members: tuple | None = None   # the ranks of the workers in the job; None: all worker ranks
    epoch: int = 0                 # the membership epoch of ``members``
    joined: bool = False           # a worker that joined a running (elastic) job
    progress: dict = field(default_factory=dict)   # as a worker last saved it
    elastic: tuple | None = None   # (MIN, MAX), or None: not elastic
    worker_addrs: list = field(default_factory=list)   # each worker rank's registered address
    job: str = ""                  # servers: the job's id (SchedulerState.job), "" for workers

    def __post_init__(self):
        worker_ranks = self.num_workers if self.worker_ranks is None else self.worker_ranks
        object.__setattr__(self, "worker_ranks", worker_ranks)
        object.__setattr__(self, "members", tuple(range(worker_ranks) if self.members is None else self.members))


class ServersBook(NamedTuple):
    """Replicated servers: the servers' book as a node last heard it
    (tracker.control.failover): ``owners[s]`` serves server s's share of chunks now,
    ``backups[s]`` holds its replica (None: none any more), ``added`` are the
    adverts of the replacement servers (ranks ``len(owners)`` and up), and the
    replicas of the shares in ``rebuilding`` are still being rebuilt on them."""
    epoch: int
    owners: tuple
    backups: tuple
    added: tuple = ()
    rebuilding: frozenset = frozenset()


class Membership:
    """One node's link to the scheduler.

    Example::

        m = Membership(role="worker", rank=None, scheduler=("127.0.0.1", 9000))
        reg = m.register()       # blocks until every node of the job registered
        m.barrier(token="init")  # workers only: (epoch, members) of the job then
        members, payloads = m.allgather(b"mine", token="metrics")   # every worker's bytes
        m.finish()               # done; servers are shut down when all workers finish
    """

    def __init__(self, *, role: str, rank: int | None, scheduler: tuple[str, int],
                 host: str = env.default("KVSTORE_NODE_HOST"), addr: str = "",
                 timeout: float = env.default("KVSTORE_TIMEOUT"),
                 heartbeat_interval: float = env.default("KVSTORE_HEARTBEAT_INTERVAL"),
                 heartbeat_timeout: float = env.default("KVSTORE_HEARTBEAT_TIMEOUT"),
                 on_abort: Callable[[str], None] | None = None, security: Security = Security(),
                 restart_timeout: float = env.default("KVSTORE_SCHEDULER_RESTART_TIMEOUT"),
                 replacement: bool = False):
        self.role = role
        self.requested_rank = rank
        # a replacement server (--restart-servers) registers into the running job
        self.replacement = replacement
        # a server's replicas rebuilt on a replacement, ``[[share, backup], ...]``: every
        # heartbeat reports them (the scheduler ignores what it knows already)
        self.rebuilt: list = []
        self.scheduler = scheduler
        self.host = host
        self.addr = addr
        self.timeout = timeout
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.restart_timeout = restart_timeout
        self.node_id = f"{role}-{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.aborted = threading.Event()
        self.shutdown = threading.Event()
        self.abort_reason: str | None = None
        # ranks of the workers that finished (servers hear it from the scheduler)
        self.finished_workers: frozenset = frozenset()
        self.registration: Registration | None = None
        # the job's progress as last heard (at registration and barriers)
        self.progress: dict = {}
        # (workers) the last barrier released to this one (reported to a restarted scheduler),
        # and the job's barriers this one heard of (the count it sends with the next barrier)
        self.last_barrier: Released | None = None
        self.barriers_heard = 0
        # "host:pid" by worker rank, as last heard (servers: with each new membership)
        self.workers: tuple = ()
        self._members: tuple[int, frozenset] = (-1, frozenset())
        self._members_lock = threading.Lock()   # set by the heartbeat and the calling thread
        # replicated servers (tracker.control.failover): the servers' book as last heard;
        # epoch -1 in a job without replicas
        self._servers = ServersBook(-1, (), ())
        self._book_fields: dict | None = None   # that book as heard (for a restarted scheduler)
        # the scheduler's incarnation last heard (any ack) and the one this node is registered
        # with: when they differ, the scheduler was restarted and this node registers again
        self._heard: str | None = None
        self._joined: str | None = None
        # whether a launcher restarts the scheduler (its `registered` says): only then does a
        # node that lost it keep trying for restart_timeout after the heartbeat timeout
        self._restartable = False
        self._on_abort = on_abort
        self._security = security
        self._ids = itertools.count(1)
        self._ctx = zmq.Context()
        self._url = f"tcp://{scheduler[0]}:{scheduler[1]}"
        self._ctl = self._socket()
        # learn at once if the scheduler refuses our credentials (a wrong secret)
        self._ctl_events = self._ctl.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        self._stop_hb = threading.Event()
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                           name=f"kvstore-heartbeat-{role}")
        self._hb_thread.start()

    @property
    def members(self) -> tuple[int, frozenset]:
        """``(epoch, frozenset(worker ranks))``: the job's members as last heard (from
        the registration, barriers, and the scheduler's ``members`` messages); the
        epoch grows by one at every change ((-1, frozenset()) before registration)."""
        return self._members

    @property
    def servers(self) -> "ServersBook":
        """Replicated servers: the servers' book as last heard (:class:`ServersBook`);
        the epoch grows at every server's death, replacement and rebuilt replica.
        ``ServersBook(-1, (), ())`` in a job without replicas."""
        return self._servers

    def _note_servers(self, msg: dict) -> None:
        """Keep a newer servers' book (the registration's, an ``ack``'s or ``servers``)."""
        epoch, owners, backups = msg.get("book_epoch"), msg.get("owners"), msg.get("backups")
        added, rebuilding = msg.get("added", []), msg.get("rebuilding", [])
        if type(epoch) is not int or not isinstance(owners, list) or not isinstance(backups, list) \
                or not all(type(o) is int for o in owners) \
                or not all(b is None or type(b) is int for b in backups) \
                or not (isinstance(added, list) and all(isinstance(a, str) for a in added)) \
                or not (isinstance(rebuilding, list) and all(type(r) is int for r in rebuilding)):
            return
        with self._members_lock:
            if epoch > self._servers.epoch:
                self._servers = ServersBook(epoch, tuple(owners), tuple(backups), tuple(added),
                                            frozenset(rebuilding))
                self._book_fields = {k: msg[k] for k in ("book_epoch", "owners", "backups", "dead", "lost_with",
                                                         "added", "rebuilding") if k in msg}

    def _note_members(self, epoch, ranks, workers=None) -> None:
        """Keep a newer membership (the two threads may hear them out of order)."""
        if type(epoch) is not int or not isinstance(ranks, (list, tuple)):
            return
        with self._members_lock:
            if epoch > self._members[0]:
                self._members = (epoch, frozenset(ranks))
                if isinstance(workers, list):
                    self.workers = tuple(workers)

    @property
    def name(self) -> str:
        rank = self.registration.rank if self.registration else self.requested_rank
        return f"{self.role} {'?' if rank is None else rank}"

    def _socket(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_BYTES)
        self._security.connect(sock)
        sock.connect(self._url)
        return sock

    # -- requests -----------------------------------------------------------
    def _request(self, op: str, what: str, limit: float | None = None, grace: float = 0.0,
                 **fields) -> dict:
        """Send one control request and wait for its reply (or abort/deadline: ``limit``
        seconds, plus ``grace`` for a scheduler that answers at ``limit`` itself).
        Sends never block: with no usable connection (e.g. refused credentials)
        the message waits here, where the deadline and the abort flag are checked."""
        req_id = next(self._ids)
        message = wire.encode(op, id=req_id, node=self.node_id, **fields)
        limit = self.timeout if limit is None else limit
        deadline = time.monotonic() + limit + grace
        sent = False
        # the scheduler this request went to: when another one answers this node (it was
        # restarted), the request is sent to it again (a registration: once it is heard;
        # anything else: once this node registered with it again)
        sent_to: str | None = None
        again_at: float | None = None   # a restarted scheduler said 'restarting': send again then
        while True:
            self.check()
            if sent and ((self._heard if op == wire.REGISTER else self._joined) != sent_to
                         or (again_at is not None and time.monotonic() >= again_at)):
                sent, again_at = False, None
            if self._ctl_events.poll(0):
                raise RendezvousError(
                    f"the scheduler at {self.scheduler[0]}:{self.scheduler[1]} rejected this process's "
                    "credentials: its KVSTORE_SECRET (or KVSTORE_SECURE) differs from the job's")
            if not sent:
                try:
                    sent_to = self._heard if op == wire.REGISTER else self._joined
                    self._ctl.send(message, zmq.NOBLOCK)
                    sent = True
                except zmq.Again:
                    self._ctl_events.poll(int(SLICE * 1000))   # wait a slice for the connection
            elif self._ctl.poll(int(SLICE * 1000)):
                msg = wire.decode(self._ctl.recv())
                if msg.get("id") != req_id:
                    continue  # a stale reply to an earlier, abandoned request
                if msg["op"] == wire.ERROR:
                    if msg.get("kind") == wire.RESTARTING:   # sent again once this node registered
                        again_at = time.monotonic() + self.heartbeat_interval   # again (or a beat later)
                        continue
                    if msg.get("kind") == wire.ABORTED:
                        raise JobAborted(str(msg.get("message")))
                    if msg.get("kind") == wire.TIMEOUT:
                        raise RendezvousTimeout(f"{self.name}: {msg.get('message')}")
                    if msg.get("kind") == wire.MISMATCH:
                        raise Disagreement(f"{what} failed: {msg.get('message')}")
                    raise RendezvousError(f"{what} failed: {msg.get('message')}")
                return msg
            if time.monotonic() > deadline:
                raise RendezvousTimeout(
                    f"{self.name} waited {limit:g}s for {what} from the scheduler at "
                    f"{self.scheduler[0]}:{self.scheduler[1]}; raise KVSTORE_TIMEOUT to wait longer "
                    "(and check that it runs and that this process has the job's KVSTORE_SECRET)")

    def register(self) -> Registration:
        """Join the job; blocks until every node registered. Returns ranks and address book."""
        msg = self._request(wire.REGISTER, "registration", grace=BARRIER_GRACE, role=self.role,
                            rank=self.requested_rank, host=self.host, addr=self.addr, pid=os.getpid(),
                            **({"replacement": True} if self.replacement else {}))
        elastic = msg["elastic"]
        self.registration = Registration(
            msg["rank"], msg["num_workers"], msg["num_servers"], list(msg["servers"]),
            list(msg["workers"]), worker_ranks=msg["worker_ranks"], members=tuple(msg["members"]),
            epoch=msg["epoch"], joined=bool(msg["joined"]), progress=dict(msg["progress"]),
            elastic=None if elastic is None else tuple(elastic),
            worker_addrs=[str(a) for a in msg.get("worker_addrs") or ()], job=str(msg.get("job") or ""))
        self.progress = self.registration.progress
        self._restartable = msg.get("restartable") is True
        if type(msg.get("barriers")) is int:   # the job's barriers released before this worker joined it
            self.barriers_heard = msg["barriers"]
        self._note_members(msg["epoch"], msg["members"], msg["workers"])
        self._note_servers(msg)
        if isinstance(msg.get("incarnation"), str):
            self._joined = msg["incarnation"]
        return self.registration

    def barrier(self, token: str = "", timeout: float | None = None) -> tuple[int, tuple]:
        """Wait until every worker (elastic: every member) reached a barrier. All must
        pass the same ``token`` (a digest of what the collective call agrees on) or all
        get an error. After ``timeout`` (default: KVSTORE_TIMEOUT) the scheduler fails
        it for every waiter with RendezvousTimeout naming the workers that did not
        arrive. Returns ``(epoch, members)`` (sorted ranks) as the barrier ended;
        :attr:`progress` is the job's progress then."""
        limit = self.timeout if timeout is None else timeout
        msg = self._barrier("a barrier (waiting for every worker)", limit, token)
        self.progress = dict(msg["progress"])
        self._note_members(msg["epoch"], msg["members"])
        return msg["epoch"], tuple(msg["members"])

    def allgather(self, data: bytes, token: str = "", timeout: float | None = None) -> tuple[tuple, list]:
        """Every worker's ``data`` (elastic: every member's), through the scheduler's
        barrier: a barrier whose request carries a piece of it and whose
        ``barrier_done`` carries every worker's piece, by rank. The pieces are as large
        as the scheduler takes (:func:`~.records.gather_budget` shared by the workers),
        so a large ``data`` takes several rounds; every worker must call it with the same
        ``token``. Returns ``(members, payloads)``: the sorted ranks and each one's bytes
        in that order. Errors as :meth:`barrier` (per round: ``timeout``); a change of
        the members between two rounds is a RendezvousError."""
        limit = self.timeout if timeout is None else timeout
        data = bytes(data)
        count = max(len(self._members[1]), 1)
        piece = max(gather_budget(count) // count, 1)   # the same on every worker (in the token)
        parts: list[bytearray] = []
        members: tuple = ()
        round_ = 0
        while True:
            msg = self._barrier(f"a gather (round {round_}, waiting for every worker)", limit,
                                f"{token} gather {piece}/{round_}", data=data[round_ * piece:(round_ + 1) * piece])
            got, ranks = msg.get("data"), tuple(msg["members"])
            if not (isinstance(got, list) and len(got) == len(ranks) and all(isinstance(g, bytes) for g in got)):
                raise RendezvousError(f"the scheduler's answer to a gather has no payload for each of the "
                                      f"{len(ranks)} workers")
            self.progress = dict(msg["progress"])
            self._note_members(msg["epoch"], msg["members"])
            if round_ == 0:
                members, parts = ranks, [bytearray() for _ in ranks]
            elif ranks != members:
                raise RendezvousError(f"the job's members changed during a gather (ranks {list(members)}, "
                                      f"then {list(ranks)}): call it again")
            for part, got_piece in zip(parts, got):
                part += got_piece
            if all(len(g) < piece for g in got):   # a short piece (maybe empty) ends each one's data
                return members, [bytes(p) for p in parts]
            round_ += 1

    def _barrier(self, what: str, limit: float, token: str, **data) -> dict:
        """One barrier request, saying how many releases this worker heard (``after``:
        a restarted scheduler answers a worker its predecessor did not reach with the
        release the others got); its ``barrier_done`` is kept as the last release."""
        msg = self._request(wire.BARRIER, what, limit, BARRIER_GRACE, token=token, timeout=limit,
                            after=self.barriers_heard, **data)
        number = msg.get("barrier")
        if type(number) is int:
            self.barriers_heard = number
            self.last_barrier = Released(number, token, {k: v for k, v in msg.items() if k not in ("v", "op", "id")})
        return msg

    def save_progress(self, progress: dict) -> None:
        """Record the job's ``progress`` (a small map: at most 64 KiB as msgpack) with
        the scheduler: workers that join later get it in their registration."""
        self._request(wire.PROGRESS, "acknowledgement of saved progress", progress=progress)
        self.progress = dict(progress)

    def finish(self, closed: bool = True) -> None:
        """Tell the scheduler this node is done, then stop heartbeats. ``closed``: the
        script said so (close(), the end of a ``with`` block), not the exit handler of an
        interpreter that may be exiting with a failure status (a launcher judges a later
        non-zero exit by it: tracker/launcher.py)."""
        try:
            if not self.aborted.is_set():
                self._request(wire.FINISH, "acknowledgement of finish", min(self.timeout, 10.0), closed=closed)
        finally:
            self.close()

    def fail(self, reason: str) -> None:
        """Report a fatal error of this node: the scheduler aborts the whole job
        at once (instead of others waiting for heartbeats to stop)."""
        try:
            if not self.aborted.is_set():
                try:
                    self._ctl.send(wire.encode(wire.FAIL, id=next(self._ids), node=self.node_id,
                                               reason=reason[:2000]), zmq.NOBLOCK)
                    self._ctl.poll(1000)  # best effort: the scheduler acknowledges by aborting
                except zmq.Again:
                    pass
        finally:
            self.close()

    def check(self) -> None:
        """Raise :class:`JobAborted` if the job was aborted."""
        if self.aborted.is_set():
            raise JobAborted(self.abort_reason)

    def close(self) -> None:
        self._stop_hb.set()
        if self._hb_thread.is_alive() and threading.current_thread() is not self._hb_thread:
            self._hb_thread.join(2 * SLICE + self.heartbeat_interval)
        if not self._ctl.closed:
            self._ctl.disable_monitor()
            self._ctl_events.close(linger=0)
            self._ctl.close(linger=0)
        if not self._hb_thread.is_alive() and not self._ctx.closed:
            self._ctx.term()

    # -- heartbeat thread ---------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        sock = self._socket()
        last_contact = time.monotonic()
        contacted = False   # before the scheduler first answers, registration's timeout applies
        told_forming = False   # the scheduler said the job has not formed yet (logged once)
        told_lost = False      # that contact was lost, waiting for a restart (logged once)
        rejoin: tuple[str, int] | None = None   # (incarnation, request id) of a registration again
        next_beat = 0.0
        try:
            while not self._stop_hb.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    # servers of elastic jobs report the membership epoch they hold: the
                    # scheduler answers a joining worker once every server holds its epoch
                    reg = self.registration
                    epoch: dict = {"epoch": self._members[0]} if (
                        self.role == "server" and reg is not None and reg.elastic) else {}
                    if self.rebuilt:      # (replicated servers) replicas rebuilt on a replacement
                        epoch["rebuilt"] = list(self.rebuilt)
                    try:
                        sock.send(wire.encode(wire.HEARTBEAT, node=self.node_id, **epoch), zmq.NOBLOCK)
                    except zmq.Again:
                        pass   # no connection right now: the silence is noticed by both sides
                    next_beat = now + self.heartbeat_interval
                if sock.poll(int(min(SLICE, self.heartbeat_interval) * 1000)):
                    msg = wire.decode(sock.recv())
                    last_contact, contacted, told_lost = time.monotonic(), True, False
                    if msg["op"] in (wire.REGISTERED, wire.ERROR):   # to a registration again
                        if rejoin is not None and msg.get("id") == rejoin[1]:
                            self._rejoined(msg)
                            if self.aborted.is_set():
                                return
                        continue
                    if msg["op"] == wire.ACK and isinstance(msg.get("incarnation"), str):
                        self._heard = msg["incarnation"]
                        if self._joined is not None and self.registration is not None \
                                and self._heard != self._joined and (rejoin is None or rejoin[0] != self._heard):
                            rejoin = (self._heard, next(self._ids))
                            log.warning("%s: the scheduler at %s:%s was restarted; registering again",
                                        self.name, self.scheduler[0], self.scheduler[1])
                            try:
                                sock.send(self._rejoin_message(rejoin[1]), zmq.NOBLOCK)
                            except zmq.Again:
                                rejoin = None   # tried again at the next ack
                    if msg["op"] == wire.ABORT:
                        self._abort(str(msg.get("reason")))
                        return
                    if msg["op"] == wire.SHUTDOWN:
                        self.shutdown.set()
                    if msg["op"] == wire.WORKERS_FINISHED:
                        self._note_finished(msg.get("ranks"))
                    elif msg["op"] == wire.MEMBERS:   # acknowledged at once by a heartbeat
                        self._note_members(msg.get("epoch"), msg.get("members"), msg.get("workers"))
                        next_beat = 0.0
                    elif msg["op"] == wire.SERVERS:
                        self._note_servers(msg)
                    elif msg["op"] == wire.ACK:
                        if isinstance(msg.get("forming"), str) and not told_forming:   # once
                            told_forming = True
                            log.warning("%s waits to register: %s", self.name, msg["forming"])
                        self._note_servers(msg)
                        self._note_finished(msg.get("workers_finished"))
                        self._note_members(msg.get("epoch"), msg.get("members"), msg.get("workers"))
                elif contacted and time.monotonic() - last_contact > self.heartbeat_timeout + self.restart_window:
                    waited = (f"{self.heartbeat_timeout:g}s (KVSTORE_HEARTBEAT_TIMEOUT)" if not self.restart_window
                              else f"{self.heartbeat_timeout + self.restart_window:g}s (KVSTORE_HEARTBEAT_TIMEOUT "
                              "+ KVSTORE_SCHEDULER_RESTART_TIMEOUT): it died and was not restarted, or is stuck")
                    self._abort(f"lost contact with the scheduler at {self.scheduler[0]}:"
                                f"{self.scheduler[1]} for {waited}")
                    return
                elif contacted and not told_lost and self.restart_window \
                        and time.monotonic() - last_contact > self.heartbeat_timeout:
                    told_lost = True
                    log.warning("%s: no answer from the scheduler at %s:%s for %gs; waiting up to %gs more for "
                                "it to be restarted (KVSTORE_SCHEDULER_RESTART_TIMEOUT)", self.name,
                                self.scheduler[0], self.scheduler[1], self.heartbeat_timeout, self.restart_window)
                elif not contacted and time.monotonic() - last_contact > self.timeout:
                    self._abort(f"the scheduler at {self.scheduler[0]}:{self.scheduler[1]} did not "
                                f"answer within {self.timeout:g}s (KVSTORE_TIMEOUT): is it running?")
                    return
        except (zmq.ZMQError, RendezvousError) as e:
            if not self._stop_hb.is_set():
                self._abort(f"heartbeat channel to the scheduler failed: {e}")
        finally:
            sock.close(linger=0)

    @property
    def restart_window(self) -> float:
        """Seconds this node keeps trying after the heartbeat timeout for a scheduler it
        lost: ``restart_timeout`` when a launcher restarts the scheduler (its
        ``registered`` said so), else 0 (a hand-started scheduler: nothing brings it back)."""
        return self.restart_timeout if self._restartable else 0.0

    def _rejoin_message(self, req_id: int) -> bytes:
        """This node's registration with a restarted scheduler: its role, rank, address,
        pid and host, and what it knows of the job (tracker.control.recovery)."""
        reg = self.registration
        assert reg is not None
        with self._members_lock:
            epoch, members, book = self._members[0], sorted(self._members[1]), self._book_fields
        return wire.encode(wire.REGISTER, id=req_id, node=self.node_id, role=self.role, rank=reg.rank,
                           host=self.host, addr=self.addr, pid=os.getpid(), rejoin={
                               "job": reg.job, "book": book, "epoch": epoch, "members": members,
                               "finished_workers": sorted(self.finished_workers),
                               "shutdown": self.shutdown.is_set(), "progress": self.progress,
                               "barrier": None if self.last_barrier is None else self.last_barrier.report(),
                               "servers": list(reg.servers[:reg.num_servers])})

    def _rejoined(self, msg: dict) -> None:
        """The restarted scheduler answered this node's registration again."""
        if msg["op"] == wire.ERROR:
            if msg.get("kind") == wire.ABORTED:
                return self._abort(str(msg.get("message")))
            return self._abort(f"could not register again with the restarted scheduler at "
                               f"{self.scheduler[0]}:{self.scheduler[1]}: {msg.get('message')}")
        self._note_servers(msg)
        self._note_members(msg.get("epoch"), msg.get("members"), msg.get("workers"))
        if isinstance(msg.get("incarnation"), str):
            self._joined = msg["incarnation"]
        self._restartable = msg.get("restartable") is True
        log.info("%s registered again with the restarted scheduler", self.name)

    def _note_finished(self, ranks) -> None:
        if isinstance(ranks, list) and all(type(r) is int for r in ranks):
            if not self.finished_workers.issuperset(ranks):
                self.finished_workers = self.finished_workers | frozenset(ranks)

    def _abort(self, reason: str) -> None:
        self.abort_reason = reason
        self.aborted.set()
        log.error("[%s] job aborted: %s", self.name, reason)
        if self._on_abort is not None:
            self._on_abort(reason)
