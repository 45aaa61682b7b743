"""The socket between the workers of one host group (kvstore.hostgroup.group).

Every worker that sums on its host binds a ROUTER before it registers (abstract
ipc, and tcp on 127.0.0.1 where ipc is missing; with the job's authentication,
tracker.control.security) and registers that advert. The group's leader keeps
it; a member closes it and connects a DEALER to the leader's. Messages are the
data plane's frames (kvstore.protocol.codec).

No wait here is unbounded: sends never block (a full queue is retried until
``KVSTORE_TIMEOUT``), and every wait checks the job's abort flag and whether the
processes it waits for are alive (they are on this host: their pids), so a dead
or stuck peer ends it within a bounded time, naming the peer.
"""

from __future__ import annotations

import os
import time

import numpy as np
import zmq

from ..errors import DeadlineError, NodeFailedError, ProtocolError
from ..protocol.codec import decode, encode
from ..transport import endpoints

SLICE = 0.05          # seconds between checks of the abort flag and of peers' pids


class HostLink:
    """Example::

        link = HostLink(config)            # bound: register link.advert
        link.watch(membership, {1: 4242})  # the job's abort flag; pids by rank
        link.connect(leader_advert)        # (a member) DEALER to the leader
        link.send(None, {"op": wire.HELLO, "id": 0, "rank": 1})   # (kvstore.hostgroup.wire)
        ident, header, arrays = link.receive(deadline, "joining", peers=[0])
    """

    def __init__(self, config):
        self._config = config
        self._ctx = zmq.Context()
        self._security = config.security()
        self._auth = self._security.authenticator(self._ctx, "host-reduce")
        self._sock = self._socket(zmq.ROUTER)
        self._security.serve(self._sock)
        if self._auth is not None:
            self._auth.watch(self._sock)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.advert = endpoints.bind(self._sock, "127.0.0.1", label=config.host_label).format()
        self._membership = None
        self.pids: dict = {}            # rank -> pid of the group's workers
        self.bytes_sent = self.bytes_received = 0
        self.linger = 0                 # ms close() may wait to deliver what is queued
        # kinds of reference accepted in messages: {"dev": ...} once a group moves
        # device values (kvstore.hostgroup.group); frames only until then
        self.resolve: dict = {}

    def _socket(self, kind):
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._config.max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.copy_threshold = self._config.zero_copy_bytes
        return sock

    def watch(self, membership, pids: dict) -> None:
        self._membership, self.pids = membership, dict(pids)

    def connect(self, advert) -> None:
        """Become a member: a DEALER to the leader's ``advert`` instead of our ROUTER."""
        self._sock.close(linger=0)
        self._sock = self._socket(zmq.DEALER)
        self._security.connect(self._sock)
        self._sock.connect(advert.url("ipc") or advert.url("tcp"))

    def ready(self, timeout: float) -> bool:
        """Whether a message is waiting (after up to ``timeout`` seconds)."""
        return bool(self._sock.poll(timeout * 1000))

    def send(self, ident, header: dict, arrays=(), copy: bool = True, to=(), shared=None) -> None:
        """Send one message (to ROUTER identity ``ident``; None from a DEALER).
        ``copy=False``: the caller keeps ``arrays`` unchanged until the call's
        answer. ``to``: the ranks it goes to, named if it cannot be sent.
        ``shared``: per array None (a frame) or a reference (protocol.encode's: device
        memory the peer opens, kvstore.devices.slots)."""
        places = list(shared) if shared is not None else [None] * len(arrays)
        arrays = [a if place is not None else np.ascontiguousarray(a) for a, place in zip(arrays, places)]
        frames = ([ident] if ident is not None else []) + encode(header, arrays, places)
        deadline = time.monotonic() + self._config.timeout
        while True:
            try:
                self._sock.send_multipart(frames, zmq.NOBLOCK, copy=copy)
                break
            except zmq.Again:
                self.check_alive(header["op"], to)
                if time.monotonic() > deadline:
                    raise DeadlineError(f"{header['op']}: {names(to)} on this host took nothing for "
                                        f"{self._config.timeout:g}s (KVSTORE_TIMEOUT)") from None
                self._sock.poll(SLICE * 1000, zmq.POLLOUT)
            except zmq.ZMQError as e:    # ROUTER_MANDATORY: the peer is gone
                raise NodeFailedError(f"{header['op']}: {names(to)} on this host cannot be reached "
                                      f"({e}): it is gone") from None
        # arrays by reference count as sent too, as the data plane counts them (traffic.py)
        self.bytes_sent += sum(memoryview(f).nbytes for f in frames) + sum(
            a.nbytes for a, place in zip(arrays, places) if place is not None)

    def receive(self, deadline: float | None, what: str, peers):
        """The next message (ROUTER identity or None, header, arrays), waiting until
        ``deadline`` (None: it has arrived) while ``peers`` are alive and the job runs."""
        while not self._sock.poll(SLICE * 1000):
            self.check_alive(what, peers)
            if deadline is not None and time.monotonic() > deadline:
                raise DeadlineError(f"{what}: nothing from {names(peers)} on this host within "
                                    f"{self._config.timeout:g}s (KVSTORE_TIMEOUT)")
        frames = self._sock.recv_multipart(copy=False)
        ident = None
        if self._sock.type == zmq.ROUTER:
            ident, frames = frames[0].bytes, frames[1:]
        header, arrays = decode(frames, self._config.max_message_bytes, resolve=self.resolve)
        self.bytes_received += len(frames[0]) + sum(a.nbytes for a in arrays)
        if type(header.get("id")) is not int:
            raise ProtocolError(f"{what}: a message without an integer id from {names(peers)} on this host")
        return ident, header, arrays

    def check_alive(self, what: str, peers) -> None:
        """NodeFailedError if the job aborted or one of ``peers`` (ranks) died."""
        if self._membership is not None and self._membership.aborted.is_set():
            raise NodeFailedError(f"the job was aborted: {self._membership.abort_reason}")
        for rank in peers:
            if not alive(self.pids.get(rank)):
                raise NodeFailedError(f"{what}: worker {rank} (pid {self.pids.get(rank)}) on this host "
                                      "died; it was part of this host's sum (KVSTORE_HOST_REDUCE)")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=self.linger)
            self._sock = None
            if self._auth is not None:
                self._auth.stop()
            self._ctx.term()


def pid_of(worker: str) -> int | None:
    """The pid of a registration's "host:pid"."""
    tail = str(worker).rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else None


def alive(pid: int | None) -> bool:
    """Whether process ``pid`` (on this host) runs: not gone, not a zombie."""
    if pid is None:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:      # no /proc: signal 0 tells whether it exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def names(ranks) -> str:
    ranks = list(ranks)
    return f"worker{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}" if ranks else "no worker"
