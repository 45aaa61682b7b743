"""Where a server listens and what it advertises (which endpoint a worker uses is
kvstore.transport.links' choice, from the advert and ``KVSTORE_TRANSPORT``).

A server binds its one ROUTER socket to a tcp endpoint (reachable from any host)
and, on Linux, also to an abstract-namespace ipc endpoint (reachable only from
its own network namespace; no file to clean up). It registers one advert string
with the scheduler, the tcp URL first so that a tool that knows only tcp can use
the first word::

    tcp://127.0.0.1:41234 ipc://@kvstore-5c0e...d1 host=9c1e44d0a1b2c3d4 pid=1234

``host`` identifies the machine *and* the namespaces the peers must share (boot
id; network namespace, for abstract ipc endpoints; pid namespace, for
``/proc/<pid>/fd``). Mount namespaces are left out: ``ip netns exec`` gives every
process its own, and whether a peer's memory can really be mapped is proven by
the shared-memory handshake anyway. A worker whose own identity matches is
co-located with that server and, by ``KVSTORE_TRANSPORT`` (the links registry
implements this table, falling back along it after a failed handshake):

====== ==================================================================
auto   co-located: shared memory for array data, control messages on tcp
       (the same round trip as ipc here); otherwise tcp. The default.
shm    the same as auto
ipc    co-located: everything through the ipc endpoint; otherwise tcp
tcp    always tcp
====== ==================================================================

Shared memory is only used after a handshake proved that both sides can map each
other's memory (:mod:`kvstore.transport.shm`); otherwise the worker stays on tcp.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import secrets
import sys
from dataclasses import dataclass

import zmq

from tracker.control.env import TRANSPORTS

log = logging.getLogger(__name__)

MODES = TRANSPORTS   # the values of KVSTORE_TRANSPORT, defined with the variable


@functools.lru_cache(maxsize=4)
def host_identity(label: str = "") -> str:
    """16 hex digits naming this machine and the namespaces that ipc and shared
    memory need to share (equal for two processes iff they can use them).

    ``label`` (``KVSTORE_HOST_LABEL``) splits one machine into emulated hosts:
    processes with different labels get different identities, so they talk tcp
    to each other as they would between machines."""
    parts = [label] if label else []
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        import socket
        parts.append(socket.gethostname())
    for ns in ("net", "pid"):
        try:
            parts.append(str(os.stat(f"/proc/self/ns/{ns}").st_ino))
        except OSError:
            parts.append("?")
    return hashlib.sha256("/".join(parts).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Advert:
    """A server's data-plane endpoints as registered with the scheduler."""
    tcp: str
    ipc: str | None = None
    host: str | None = None
    pid: int | None = None

    def format(self) -> str:
        words = [self.tcp]
        if self.ipc:
            words.append(self.ipc)
        if self.host:
            words.append(f"host={self.host}")
        if self.pid is not None:
            words.append(f"pid={self.pid}")
        return " ".join(words)

    @classmethod
    def parse(cls, text: str) -> "Advert":
        """Parse an advert; a bare URL (e.g. from another tool) is a tcp-only advert.
        Unknown words are ignored so that later versions may add some."""
        words = str(text).split()
        if not words:
            raise ValueError("empty server address")
        ipc = host = pid = None
        for word in words[1:]:
            if word.startswith("ipc://"):
                ipc = word
            elif word.startswith("host="):
                host = word[5:]
            elif word.startswith("pid=") and word[4:].isdigit():
                pid = int(word[4:])
        return cls(words[0], ipc, host, pid)


def bind(sock: zmq.Socket, host: str, ipc: bool = True, label: str = "") -> Advert:
    """Bind ``sock`` to a random tcp port on ``host`` and (Linux, ``ipc``) to a fresh
    abstract ipc endpoint whose name cannot be guessed; return the advert (its host
    identity is :func:`host_identity` of ``label``)."""
    port = sock.bind_to_random_port(f"tcp://{host}")
    ipc_url = None
    if ipc and sys.platform.startswith("linux"):
        url = f"ipc://@kvstore-{secrets.token_hex(16)}"
        try:
            sock.bind(url)
            ipc_url = url
        except zmq.ZMQError as e:   # e.g. a libzmq built without ipc
            log.info("no ipc endpoint (%s); co-located workers use tcp", e)
    return Advert(f"tcp://{host}:{port}", ipc_url, host_identity(label), os.getpid())
