"""A worker's ZeroMQ sockets: one DEALER per server, and one poller over them and
over the file descriptors that links' own reader threads wake it through."""

from __future__ import annotations

from typing import Any

import zmq


class Sockets:
    """``sockets[server]`` is that server's DEALER (None until :meth:`connect`).

    Example::

        socks = Sockets(config, num_servers)
        socks.connect(0, "tcp://10.0.0.1:5000")
        for server, sock in socks.poll(0.1):   # sock None: a watched descriptor is readable
            ...
    """

    def __init__(self, config, count: int):
        self._config = config
        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
        self._socks: list = [None] * count
        self._index: dict = {}        # socket or file descriptor -> server

    def __getitem__(self, server: int):
        return self._socks[server]

    def __len__(self) -> int:
        return len(self._socks)

    def grow(self, count: int) -> None:
        """Room for ``count`` servers (a replacement server joined a replicated job)."""
        self._socks += [None] * (count - len(self._socks))

    def connect(self, server: int, url: str) -> None:
        """(Re)connect ``server``'s socket to ``url``; an old one is closed."""
        old = self._socks[server]
        if old is not None:
            self._poller.unregister(old)
            del self._index[old]
            old.close(linger=0)
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._config.max_message_bytes)
        # replies (mostly acknowledgements of pushes) are never dropped for want of
        # room, however many requests are in flight: the server's sends never block
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.copy_threshold = self._config.zero_copy_bytes
        self._config.security().connect(sock)
        sock.connect(url)
        self._poller.register(sock, zmq.POLLIN)
        self._socks[server], self._index[sock] = sock, server

    def watch(self, fd: int, server: int) -> None:
        """Poll ``fd`` too (a link's wake-up pipe) and report it as ``server``'s."""
        self._poller.register(fd, zmq.POLLIN)
        self._index[fd] = server

    def poll(self, timeout: float) -> list[tuple[int, Any]]:
        """(server, its socket, or None for a watched descriptor) for each that is
        readable within ``timeout`` seconds."""
        return [(self._index[what], what if what is self._socks[self._index[what]] else None)
                for what, _ in self._poller.poll(int(timeout * 1000))]   # (pyzmq truncates too)

    def close(self) -> None:
        for sock in self._socks:
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
