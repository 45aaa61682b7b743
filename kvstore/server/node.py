"""The server process's I/O loop: ZeroMQ ROUTER socket <-> :class:`ServerState`."""

from __future__ import annotations

import logging
import os
import time

import msgpack
import zmq

from tracker.membership import Membership

from ..config import Config
from ..errors import InvalidArgumentError, ProtocolError
from ..protocol import decode, encode, error_header, ops
from . import checkpoint
from .sequencer import Sequencer
from .state import ServerState

log = logging.getLogger(__name__)

POLL_MS = 100


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
        port = self._sock.bind_to_random_port(f"tcp://{config.node_host}")
        self.address = f"tcp://{config.node_host}:{port}"
        self.membership = Membership(
            role="server", rank=config.rank, addr=self.address, host=config.node_host,
            scheduler=(config.scheduler_host, config.scheduler_port), timeout=config.timeout,
            heartbeat_interval=config.heartbeat_interval,
            heartbeat_timeout=config.heartbeat_timeout, security=security)
        self.state: ServerState | None = None

    def run(self) -> int:
        try:
            reg = self.membership.register()
        except Exception as e:  # registration failures end the process with a reason
            log.error("server could not join the job: %s", e)
            self._close()
            return 1
        self.state = ServerState(name=f"server {reg.rank}")
        self.sequencer = Sequencer(self.state.name)
        self.rank = reg.rank
        if self.config.resume and not self._restore():
            return 1
        log.info("server %d (pid %d) serving on %s", reg.rank, os.getpid(), self.address)
        next_stall_check = time.monotonic() + 1.0
        try:
            while True:
                if self.config.stall_warning > 0 and time.monotonic() >= next_stall_check:
                    next_stall_check = time.monotonic() + 1.0
                    for line in self.state.stalled(time.monotonic(), self.config.stall_warning):
                        log.warning("%s: %s (KVSTORE_STALL_WARNING=%gs)", self.state.name, line,
                                    self.config.stall_warning)
                if self.membership.aborted.is_set():
                    log.error("server %d stopping: %s", reg.rank, self.membership.abort_reason)
                    return 1
                if self.membership.shutdown.is_set():
                    log.info("server %d: all workers finished, shutting down", reg.rank)
                    self.membership.finish()
                    return 0
                if self._sock.poll(POLL_MS):
                    self._serve_ready()
        finally:
            self._close()

    def _serve_ready(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            peer, body = frames[0].bytes, frames[1:]
            try:
                header, arrays = decode(body, self.config.max_message_bytes)
                if not isinstance(header.get("src"), int) or header["id"] is None:
                    raise ProtocolError("request has no integer 'src' or 'id'")
            except ProtocolError as e:
                log.warning("%s: rejected a malformed message: %s", self.state.name, e)
                self._send(peer, error_header(_guess_id(body), "ProtocolError", str(e)), [])
                continue
            try:
                deliverable = self.sequencer.accept(peer, header, arrays)
            except ValueError as e:
                log.error("%s: %s", self.state.name, e)
                self._send(peer, error_header(header["id"], "ProtocolError", str(e)), [])
                continue
            for header, arrays in deliverable:
                log.debug("%s: %s id=%s from worker %s", self.state.name, header["op"],
                          header["id"], header["src"])
                if header["op"] == ops.CHECKPOINT and self.config.checkpoint_dir:
                    self._send(peer, *self._checkpoint(header), [])
                    continue
                for reply in self.state.handle(peer, header, arrays):
                    self._send(reply.peer, reply.header, reply.arrays)

    def _checkpoint(self, header: dict) -> tuple[dict]:
        """Write this server's checkpoint; the reply header (ok or error)."""
        meta = header.get("meta") if isinstance(header.get("meta"), dict) else {}
        path = checkpoint.path_for(self.config.checkpoint_dir, self.rank)
        try:
            checkpoint.save(path, self.state.snapshot(meta))
        except OSError as e:
            log.error("%s: could not write the checkpoint %s: %s", self.state.name, path, e)
            return (error_header(header["id"], "CheckpointError", f"{self.state.name}: {e}"),)
        log.info("%s: checkpoint written to %s", self.state.name, path)
        return ({"op": ops.OK, "id": header["id"], "path": path},)

    def _restore(self) -> bool:
        """Load this server's checkpoint (KVSTORE_RESUME); on failure abort the job."""
        if not self.config.checkpoint_dir:
            reason = "KVSTORE_RESUME is set but KVSTORE_CHECKPOINT_DIR is not"
        else:
            path = checkpoint.path_for(self.config.checkpoint_dir, self.rank)
            try:
                self.state.restore(checkpoint.load(path))
                log.info("%s: resumed from %s (%d chunks)", self.state.name, path, len(self.state.chunks))
                return True
            except InvalidArgumentError as e:
                reason = str(e)
        log.error("%s: %s", self.state.name, reason)
        self.membership.fail(f"{self.state.name} cannot resume: {reason}")
        self._close()
        return False

    def _send(self, peer: bytes, header: dict, arrays: list) -> None:
        try:
            self._sock.send_multipart([peer, *encode(header, arrays)], copy=False)
        except zmq.ZMQError as e:  # EHOSTUNREACH: that worker is gone
            log.warning("%s: could not reply to a worker that went away: %s", self.state.name, e)

    def _close(self) -> None:
        self.membership.close()
        if self._auth is not None:
            self._auth.stop()
        self._sock.close(linger=0)
        self._ctx.term()


def _guess_id(frames) -> int | None:
    """The request id of a message we could not decode, if the header is readable."""
    try:
        header = msgpack.unpackb(frames[0].bytes, raw=False, strict_map_key=False)
        rid = header.get("id") if isinstance(header, dict) else None
        return rid if isinstance(rid, int) else None
    except Exception:  # garbage header: no id to answer with
        return None
