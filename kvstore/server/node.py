"""The server process's I/O loop: ZeroMQ ROUTER socket <-> :class:`ServerState`."""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import cast

import zmq

from tracker.control.membership import Membership
from tracker.wrapper import stopping

from ..config import Config
from ..errors import CheckpointError, ProtocolError
from ..protocol import error_header, ops
from ..protocol.codec import parse_header
from ..timeline import Timeline, open_timeline
from . import backend as _backend
from .checkpoint_ops import CheckpointOps
from .commands import ServerCommands
from .dataplane import DataPlane
from .replica_link import BackupFailed, ReplicaLink
from .requests import ok
from .budget import MemoryBudget
from .sequencer import Sequencer
from .state import ServerState

log = logging.getLogger(__name__)

POLL_MS = 100
# (replicated servers, workers fixed) requests whose event's replies leave before the backups
# acknowledged what it applied (kvstore.server.replication.ReplyGate.early): the numbered pushes
# a worker keeps until its server says they are durable, and reads. Dynamic rows' pushes and
# pulls (which may create rows) and everything else wait at the gate.
EARLY = frozenset({ops.PUSH, ops.PUSHPULL, ops.PUSH_ROWS, ops.PULL, ops.PULL_ROWS})


class ServerNode:
    """One parameter server: binds a data socket, joins the job, serves until the
    scheduler says every worker finished (exit status 0) or the job aborts (1).

    Example::

        code = ServerNode(Config.from_env(os.environ)).run()
    """

    def __init__(self, config: Config):
        config.require_cluster("a kvstore server")
        self.config = config
        self._ctx = zmq.Context()
        security = config.security()
        self._auth = security.authenticator(self._ctx, "server")
        self._sock = self._ctx.socket(zmq.ROUTER)
        security.serve(self._sock)
        if self._auth is not None:
            self._auth.watch(self._sock)
        self._sock.setsockopt(zmq.LINGER, 2000)
        self._sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.copy_threshold = config.zero_copy_bytes
        self._data = DataPlane(config)             # the registered transports' endpoints
        self.address = self._data.bind(self._sock)
        self.membership = Membership(
            role="server", rank=config.rank, addr=self.address, host=config.node_host,
            scheduler=(config.scheduler_host, config.scheduler_port), timeout=config.timeout,
            heartbeat_interval=config.heartbeat_interval,
            heartbeat_timeout=config.heartbeat_timeout, restart_timeout=config.scheduler_restart_timeout,
            security=security,
            # a server ranked past the job's servers replaces a dead one (--restart-servers)
            replacement=config.rank is not None and config.num_servers is not None
            and config.rank >= config.num_servers)
        self.state: ServerState | None = None
        self._elastic = False       # the job's workers may leave and join (--elastic)
        self._epoch: int | None = None   # the epoch of the members the state machine holds
        self._checkpoints: CheckpointOps | None = None   # with KVSTORE_CHECKPOINT_DIR
        self._commands: ServerCommands | None = None     # _send_command_to_servers
        self._timeline: Timeline | None = None           # KVSTORE_TIMELINE (kvstore.timeline)
        self._replica: ReplicaLink | None = None        # KVSTORE_REPLICAS=1 (kvstore.server.replica_link)

    @property
    def _live(self) -> ServerState:
        """The state machine, which :meth:`run` makes once this server registered."""
        assert self.state is not None, "the server has not registered yet"
        return self.state

    def run(self) -> int:
        try:
            reg = self.membership.register()
        except Exception as e:  # registration failures end the process with a reason
            log.error("server could not join the job: %s", e)
            self._close()
            return 1
        try:
            backend = _backend.for_config(self.config, reg.rank, alloc=self._data.alloc,
                                          shared=self._data.in_shared_memory, host=self._data.memory)
        except _backend.ServerDeviceError as e:
            # the user asked for a GPU: no silent CPU fallback, the job ends naming us
            log.error("server %d cannot start: %s", reg.rank, e)
            self.membership.fail(f"server {reg.rank} cannot start: {e}")
            self._close()
            return 1
        self._data.serving(backend)
        self.state = ServerState(name=f"server {reg.rank}", backend=backend, write_in=self._data.write_in,
                                 budget=MemoryBudget.from_setting(self.config.server_memory))
        self._data.joined(reg.workers)
        self.sequencer = Sequencer(self._live.name, self._live.budget)
        self.rank, self.num_servers = reg.rank, reg.num_servers
        self._elastic = reg.elastic is not None
        self._commands = ServerCommands(reg.rank, self.config.profile_dir)
        if self.config.replicas:
            refusal = _replicas_refusal(self.config, reg.num_servers)
            if refusal is not None:
                log.error("%s cannot start: %s", self._live.name, refusal)
                self.membership.fail(f"{self._live.name} cannot start: {refusal}")
                self._close()
                return 1
            self._replica = ReplicaLink(self.config, self._ctx, reg.rank, reg.servers[:reg.num_servers],
                                        self.state)
            self._replica.book(self.membership.servers)
        if self.config.checkpoint_dir:
            try:     # its lock on the directory: another live job's there fails this one, named
                # (a replacement server takes its state from its primaries, never from a checkpoint)
                self._checkpoints = CheckpointOps(self.config.checkpoint_dir, reg.rank, reg.num_servers,
                                                  self.state, resume=self.config.resume
                                                  and not self.membership.replacement, job=reg.job)
                self._checkpoints.start(wait=self.config.heartbeat_timeout, stop=self.membership.aborted)
            except CheckpointError as e:
                log.error("%s cannot start: %s", self._live.name, e)
                self.membership.fail(f"{self._live.name} cannot start: {e}")
                self._close()
                return 1
        elif self.config.resume and not self.membership.replacement:
            reason = "KVSTORE_RESUME is set but KVSTORE_CHECKPOINT_DIR is not"
            log.error("%s: %s", self._live.name, reason)
            self.membership.fail(f"{self._live.name} cannot resume: {reason}")
            self._close()
            return 1
        log.info("server %d (pid %d) serving on %s, values in %s", reg.rank, os.getpid(),
                 self.address, backend.describe())
        next_stall_check = time.monotonic() + 1.0
        finished: frozenset = frozenset()   # workers the state machine knows have finished
        # what the server's start made lives as long as it: the cyclic collector's full passes
        # (a few ms each, in the middle of requests) need not walk it again
        gc.freeze()
        try:
            self._timeline = open_timeline(self.config.timeline, "server", reg.rank)
            while True:
                self._apply_members()
                if self._replica is not None and not self._replicate_events():
                    return 1
                if self.membership.finished_workers != finished:
                    # rounds that wait for a worker that finished fail now, naming it
                    finished = self.membership.finished_workers
                    try:
                        self._send_all(self._live.workers_finished(finished))
                    except Exception:   # a bug must not end the server: the rounds then time out
                        log.exception("%s: failed to end the rounds of finished workers", self._live.name)
                if self.config.stall_warning > 0 and time.monotonic() >= next_stall_check:
                    next_stall_check = time.monotonic() + 1.0
                    for line in self._live.stalled(time.monotonic(), self.config.stall_warning):
                        log.warning("%s: %s (KVSTORE_STALL_WARNING=%gs)", self._live.name, line,
                                    self.config.stall_warning)
                # early requests whose worker gave up (its connection lost one) let go of their memory
                self.sequencer.expire(time.monotonic(), self.config.timeout)
                if self.membership.aborted.is_set():
                    # the launcher reads the reason from this line (tracker.wrapper.Exceptions)
                    log.error("%s", stopping("server", reg.rank, self.membership.abort_reason))
                    return 1
                if self.membership.shutdown.is_set():
                    log.info("server %d: all workers finished, shutting down", reg.rank)
                    self.membership.finish()
                    return 0
                if self._poll():
                    self._serve_ready()
                elif self._timeline is not None:
                    self._timeline.idle()
        finally:
            for line in self._live.dyn.summary():      # dynamic rows' counters (kvstore.server.dyntables)
                log.info("%s: %s", self._live.name, line)
            self._close()

    def _poll(self) -> bool:
        """Wait up to POLL_MS for a request (or, replicated, the backup's answers);
        True when a request came."""
        backups = self._replica.sockets if self._replica is not None else []
        if not backups:
            return bool(self._sock.poll(POLL_MS))
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        for backup in backups:
            poller.register(backup, zmq.POLLIN)
        ready = dict(poller.poll(POLL_MS))
        return self._sock in ready

    def _replicate_events(self) -> bool:
        """(Replicated servers) apply a new epoch of the servers' book and send the
        replies the backup's answers release. False when the backup refused a round:
        the job is failed, naming both servers."""
        assert self._replica is not None
        try:
            self._send_all(self._replica.book(self.membership.servers), gated=False)
            self._send_all(self._replica.acks(), gated=False)
            self.membership.rebuilt = self._replica.rebuilt    # told to the scheduler with each heartbeat
            ready, late = self._replica.ready(time.monotonic())
            self._send_all(late, gated=False)
            for peer, header, arrays in ready:      # requests that waited for this server's book
                self._handle(peer, header, arrays, waited=True)
        except BackupFailed as e:
            log.error("%s", e)
            self.membership.fail(str(e))
            return False
        return True

    def _serve_ready(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._serve_one(frames)
            except Exception:   # a bug or an input nobody foresaw: this server goes on serving
                log.exception("%s: failed on a message; it was dropped", self._live.name)

    def _serve_one(self, frames: list) -> None:
        """Decode, sequence and handle one message (``frames``: identity, header, buffers)."""
        peer, body = frames[0].bytes, frames[1:]
        try:
            header, arrays = self._data.decode(peer, body)
            if type(header.get("src")) is not int or type(header.get("id")) is not int:
                error = ProtocolError("a request needs an integer 'src' and 'id'")
                error.request_id = header["id"] if type(header.get("id")) is int else None
                raise error
        except ProtocolError as e:
            log.warning("%s: rejected a malformed message: %s", self._live.name, e)
            self._send(peer, error_header(getattr(e, "request_id", None), "ProtocolError", str(e)), [])
            # its sequence number is used up, or the requests after it would wait
            # for it forever (a readable header tells which one it was)
            self._deliver(peer, self.sequencer.skip(peer, _sequence_number(body)))
            return
        try:
            deliverable = self.sequencer.accept(peer, header, arrays)
        except ValueError as e:
            log.error("%s: %s", self._live.name, e)
            self._send(peer, error_header(header["id"], "ProtocolError", str(e)), [])
            return
        self._deliver(peer, deliverable)

    def _deliver(self, peer: bytes, deliverable) -> None:
        """Handle requests of ``peer`` that the sequencer released, in order."""
        for header, arrays in deliverable:
            if self._timeline is None:
                self._handle(peer, header, arrays)
            else:
                start = self._timeline.now()
                self._timeline.served(start, peer, header, self._handle(peer, header, arrays))

    def _handle(self, peer: bytes, header: dict, arrays, waited: bool = False) -> list | None:
        """Handle one request and send its replies: the state machine's, returned
        (None for a request the node answers itself, or one that waits for this
        server's servers' book; ``waited``: one that did)."""
        log.debug("%s: %s id=%s from worker %s", self._live.name, header["op"],
                  header["id"], header["src"])
        try:
            return self._handle_request(peer, header, arrays, waited)
        except Exception as e:  # a bug or an input we did not foresee: answer it, keep serving
            log.exception("%s: failed on %s request %s", self._live.name, header.get("op"),
                          header.get("id"))
            self._send(peer, error_header(header["id"], "InternalError",
                                          f"{self._live.name}: {header.get('op')!r} request failed: "
                                          f"{type(e).__name__}: {e}"), [])
            return None

    def _handle_request(self, peer: bytes, header: dict, arrays, waited: bool = False) -> list | None:
        handled = self._data.intercept(peer, header, arrays)   # e.g. hello
        if handled is not None:
            self._send(peer, *handled)
            return None
        if header["op"] == ops.COMMAND:
            assert self._commands is not None          # made with the state, at registration
            self._send(peer, self._commands.handle(header), [])
            return None
        if self._checkpoints is not None:
            if header["op"] in CheckpointOps.HANDLED:
                self._send(peer, self._checkpoints.handle(header), [])
                return None
            refusal = self._checkpoints.refusal(header["op"])
            if refusal is not None:
                self._send(peer, error_header(header["id"], "CheckpointError", refusal), [])
                return None
        self._apply_members()
        if self._replica is not None:
            self._send_all(self._replica.book(self.membership.servers), gated=False)
            if not waited and self._replica.waits(peer, header, arrays, time.monotonic()):
                return None       # sent by a newer servers' book than this server heard of yet
        if header["op"] == ops.DURABLE:     # answered once all this server applied is on its backups
            self._send_all([ok(peer, header["id"])])
            return None
        replies = self._live.handle(peer, header, arrays)   # what raises is answered by _handle
        if self._replica is not None and header["op"] != ops.REPLICATE:
            # the backup applies this event's rounds before any of its replies leaves, or
            # (EARLY, workers fixed) its replies leave now with their ticket and the workers
            # keep their pushes until it is durable (a backup's own acknowledgements never
            # wait: two servers backing up each other would wait for each other)
            replies = self._replica.after(replies, early=not self._elastic and header["op"] in EARLY)
        if self._checkpoints is not None and header["op"] == ops.SET_OPTIMIZER:
            # after a resume: a warning when it dropped the restored optimizer state
            self._checkpoints.optimizer_set(header, ok=all(r.header.get("op") == ops.OK for r in replies))
        with self._data.batch():          # one event's replies: their values are the same
            for reply in replies:
                if reply.header.get("kind") == "ProtocolError":
                    log.warning("%s: rejected a malformed %s request: %s", self._live.name,
                                header.get("op"), reply.header.get("message"))
                self._send(cast(bytes, reply.peer), reply.header, reply.arrays)   # the ROUTER's identity
        return replies

    def _apply_members(self) -> None:
        """In an elastic job, hand the workers' members to the state machine when their
        epoch changed (the heartbeat thread keeps the latest). Before each request too:
        a joiner's first request comes as soon as this server told the scheduler that
        it holds the epoch that contains it, maybe before this loop turned. A job that
        is not elastic never calls set_members: every rank stays a member (fail-fast)."""
        if not self._elastic:
            return
        epoch, ranks = self.membership.members
        if epoch == self._epoch:
            return
        log.info("%s: worker members %s (epoch %d)", self._live.name, ", ".join(map(str, sorted(ranks))), epoch)
        self._epoch = epoch
        self._data.joined(self.membership.workers)   # a joiner's shared memory (as new as ranks)
        try:
            self._send_all(self._live.set_members(epoch, ranks))
        except Exception:   # a bug must not end the server: its rounds then stall, and are reported
            log.exception("%s: failed to apply the members of epoch %s", self._live.name, epoch)

    def _send_all(self, replies, gated: bool = True) -> None:
        """Send the replies of one state-machine event (``gated``: replicated, after the
        backup acknowledged what the event made it apply)."""
        if gated and self._replica is not None:
            replies = self._replica.after(replies)
        with self._data.batch():
            for reply in replies:
                self._send(reply.peer, reply.header, reply.arrays)

    def _send(self, peer: bytes, header: dict, arrays: list) -> None:
        start = self._timeline.now() if self._timeline is not None else 0
        if self._replica is not None:   # how far the backups have it: workers forget pushes up to there
            header = {**header, "durable": self._replica.gate.durable}
        try:
            # never block: a peer that does not read its replies must not stall everyone
            self._data.reply(peer, header, arrays, lambda frames: self._sock.send_multipart(
                [peer, *frames], zmq.NOBLOCK, copy=False))
        except zmq.Again:
            log.warning("%s: dropped a reply to a peer whose queue is full (it does not read)",
                        self._live.name)
        except zmq.ZMQError as e:  # EHOSTUNREACH: that worker is gone
            log.warning("%s: could not reply to a worker that went away: %s", self._live.name, e)
        if self._timeline is not None:
            self._timeline.replied(start, peer, header, arrays)

    def _close(self) -> None:
        if self._replica is not None:
            self._replica.close()
        if self._checkpoints is not None:
            self._checkpoints.close()      # lets go of the directory (kvstore.server.checkpoint_lock)
        if self._timeline is not None:
            self._timeline.close()
        if self._commands is not None:
            self._commands.close()
        self.membership.close()
        if self._auth is not None:
            self._auth.stop()
        self._sock.close(linger=0)
        self._ctx.term()
        self._data.close()


def _replicas_refusal(config: Config, num_servers: int) -> str | None:
    """Why this server cannot run with KVSTORE_REPLICAS=1 (None: it can)."""
    if num_servers < 2:
        return (f"KVSTORE_REPLICAS=1 needs at least 2 servers (a backup on another server); this job has "
                f"{num_servers}")
    if config.server_device != "cpu":
        return "KVSTORE_REPLICAS=1 with KVSTORE_SERVER_DEVICE=gpu is not built yet (replicas in host memory only)"
    return None


def _sequence_number(body):
    """The ``seq`` of a request whose decoding failed, if its header is readable."""
    try:
        return parse_header(body[0].buffer if hasattr(body[0], "buffer") else body[0]).get("seq")
    except Exception:       # not even the header: nothing to skip
        return None
