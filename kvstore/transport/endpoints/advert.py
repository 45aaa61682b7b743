"""What a server advertises: its transports by name, and the host and process
they live in.

A server registers one advert string with the scheduler. Each transport it serves
(:mod:`kvstore.transport.registry`, from the one ``KVSTORE_TRANSPORT`` names on)
adds its fields under its name (:meth:`~kvstore.transport.endpoints.Endpoint.bind`);
the tcp URL comes first so that a tool that knows only tcp can use the first word::

    tcp://127.0.0.1:41234 ipc://@kvstore-5c0e...d1 shm host=9c1e44d0a1b2c3d4 pid=1234

One word per transport: its URL when its only field is a ``url`` whose scheme is
the transport's name (``tcp``, ``ipc``), its bare name when it has no fields
(``shm``: control on the tcp URL), else ``NAME.FIELD=VALUE`` per field (e.g.
``cuda_ipc.device=GPU-...``). Unknown words are ignored; a bare URL is an advert
of that one transport.

``host`` identifies the machine *and* the namespaces the peers must share (boot
id; network namespace, for abstract ipc endpoints; pid namespace, for
``/proc/<pid>/fd``). Mount namespaces are left out: ``ip netns exec`` gives every
process its own, and whether a peer's memory can really be mapped is proven by
the shared-memory handshake anyway. A worker whose own identity matches is
co-located with that server; which of the advertised transports it uses is the
links' choice (:mod:`kvstore.transport.links`, from ``KVSTORE_TRANSPORT``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import secrets
import sys
from dataclasses import dataclass, field

import zmq

log = logging.getLogger(__name__)

_NAME = re.compile(r"[a-z][a-z0-9_]*")


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
    """A server's data-plane endpoints as registered with the scheduler:
    ``transports`` maps the name of each transport it serves to that transport's
    fields (e.g. ``{"tcp": {"url": "tcp://h:1"}, "shm": {}}``), in its order."""
    transports: dict[str, dict[str, str]] = field(default_factory=dict)
    host: str | None = None
    pid: int | None = None

    def offers(self, name: str) -> bool:
        """Whether the server serves transport ``name``."""
        return name in self.transports

    def url(self, name: str) -> str | None:
        """The ``url`` field of transport ``name``, or None."""
        return self.transports.get(name, {}).get("url")

    def format(self) -> str:
        names = sorted(self.transports, key=lambda n: n != "tcp")    # tcp first, else in order
        words = [word for name in names for word in _words(name, self.transports[name])]
        if self.host:
            words.append(f"host={self.host}")
        if self.pid is not None:
            words.append(f"pid={self.pid}")
        return " ".join(words)

    @classmethod
    def parse(cls, text: str) -> "Advert":
        """Parse an advert; a bare URL (e.g. from another tool) is an advert of that
        one transport. Unknown words are ignored so that later versions may add some."""
        words = str(text).split()
        if not words:
            raise ValueError("empty server address")
        transports: dict[str, dict[str, str]] = {}
        host = pid = None
        for word in words:
            key, eq, value = word.partition("=")
            if eq and "://" not in key:
                name, dot, name_field = key.partition(".")
                if key == "host":
                    host = value
                elif key == "pid" and value.isdigit():
                    pid = int(value)
                elif dot and _NAME.fullmatch(name) and name_field:
                    transports.setdefault(name, {})[name_field] = value
            elif "://" in word:
                scheme = word.split("://", 1)[0]
                if _NAME.fullmatch(scheme):
                    transports.setdefault(scheme, {})["url"] = word
            elif _NAME.fullmatch(word):
                transports.setdefault(word, {})
        return cls(transports, host, pid)


def _words(name: str, fields: dict[str, str]) -> list[str]:
    """The advert's words for transport ``name`` with ``fields``."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"a transport's name is lower-case letters, digits and _: {name!r}")
    for key, value in fields.items():
        if not _NAME.fullmatch(key) or not value or any(c.isspace() for c in value):
            raise ValueError(f"transport {name!r} advertises {key}={value!r}: a field is a name "
                             "and a value without spaces")
    if not fields:
        return [name]
    if list(fields) == ["url"] and fields["url"].startswith(f"{name}://"):
        return [fields["url"]]
    return [f"{name}.{key}={value}" for key, value in fields.items()]


def bind_tcp(sock: zmq.Socket, host: str) -> str:
    """Bind ``sock`` to a random tcp port on ``host``; its URL."""
    port = sock.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{port}"


def bind_ipc(sock: zmq.Socket) -> str | None:
    """Bind ``sock`` (Linux) to a fresh abstract ipc endpoint whose name cannot be
    guessed; its URL, or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    url = f"ipc://@kvstore-{secrets.token_hex(16)}"
    try:
        sock.bind(url)
    except zmq.ZMQError as e:   # e.g. a libzmq built without ipc
        log.info("no ipc endpoint (%s); co-located workers use tcp", e)
        return None
    return url


def bind(sock: zmq.Socket, host: str, ipc: bool = True, label: str = "") -> Advert:
    """Bind ``sock`` to a random tcp port on ``host`` and (Linux, ``ipc``) to a fresh
    abstract ipc endpoint; the advert of those two (its host identity is
    :func:`host_identity` of ``label``). For sockets outside the data plane (the
    host group of ``KVSTORE_HOST_REDUCE``); servers bind their registered endpoints."""
    transports = {"tcp": {"url": bind_tcp(sock, host)}}
    ipc_url = bind_ipc(sock) if ipc else None
    if ipc_url is not None:
        transports["ipc"] = {"url": ipc_url}
    return Advert(transports, host_identity(label), os.getpid())
