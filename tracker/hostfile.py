"""Host files and the placement of servers and workers over their hosts.

Format (one host per line)::

    # comments and blank lines are ignored
    node1                  # a host name or address
    node2:2222             # ... with an ssh port
    alice@node3 slots=4    # ... with a user, and at most 4 processes on it
    [fe80::1%eth0]:22      # IPv6 addresses go in brackets when a port follows

Placement (:func:`place`) is deterministic: servers 0..S-1 first, then workers
0..W-1, are dealt round-robin over the hosts in file order, skipping hosts whose
``slots`` are used up. A host without ``slots=`` takes any number of processes.
When every host is full, the job is refused unless oversubscription is allowed,
in which case the dealing goes on round-robin over all hosts.

Dedicated server hosts (:func:`place_apart`, ``--server-hosts FILE``): servers
0..S-1 are dealt the same way over the server hosts, workers 0..W-1 over the
worker hosts; a host may not be in both files (it would be the co-located layout
again, with the slots of two files to reconcile).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from .outcome import plural


class HostfileError(ValueError):
    """A host file is missing, empty or malformed, or the job does not fit it."""


@dataclass(frozen=True)
class Host:
    """One line of a host file."""
    host: str
    port: int | None = None
    user: str | None = None
    slots: int | None = None   # None: no limit

    @property
    def name(self) -> str:
        """The host as shown to users (``user@host:port`` as written)."""
        text = f"[{self.host}]" if ":" in self.host else self.host
        if self.port is not None:
            text += f":{self.port}"
        return f"{self.user}@{text}" if self.user else text

    @property
    def destination(self) -> str:
        """What ssh and rsync are given (the port travels separately)."""
        return f"{self.user}@{self.host}" if self.user else self.host

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host.split("%")[0]).is_loopback
        except ValueError:
            return False


_LINE = re.compile(r"""^(?:(?P<user>[^@\s:\[\]]+)@)?
                        (?:\[(?P<v6>[^\]]+)\]|(?P<host>[^@\s:\[\]]+))
                        (?::(?P<port>\d+))?$""", re.X)


def parse_line(text: str, where: str = "") -> Host | None:
    """Parse one line; ``None`` for a blank or comment line."""
    text = text.split("#", 1)[0].strip()
    if not text:
        return None
    head, *options = text.split()
    m = _LINE.match(head)
    if m is None or (m["host"] or "").startswith("-") or (m["user"] or "").startswith("-"):
        raise HostfileError(f"{where}{head!r} is not host, host:port or user@host[:port]")
    port = None
    if m["port"] is not None:
        port = int(m["port"])
        if not 0 < port < 65536:
            raise HostfileError(f"{where}port {port} is not 1..65535")
    slots = None
    for option in options:
        key, sep, value = option.partition("=")
        if key in ("slots", "max_slots") and sep and value.isdigit() and int(value) > 0:
            slots = int(value) if slots is None else min(slots, int(value))
        else:
            raise HostfileError(f"{where}unknown option {option!r} (only slots=N, N >= 1)")
    return Host(m["v6"] or m["host"], port, m["user"], slots)


def parse(text: str, source: str = "hostfile") -> list[Host]:
    """Parse a whole host file. Raises :class:`HostfileError` if it lists no host
    or the same host (user, host and port) twice."""
    hosts: list[Host] = []
    seen = set()
    for number, line in enumerate(text.splitlines(), 1):
        host = parse_line(line, f"{source}:{number}: ")
        if host is None:
            continue
        key = (host.user, host.host, host.port)
        if key in seen:
            raise HostfileError(f"{source}:{number}: {host.name} is listed twice "
                                "(give it slots=N instead)")
        seen.add(key)
        hosts.append(host)
    if not hosts:
        raise HostfileError(f"{source} lists no host (only blank lines or comments)")
    return hosts


def read(path: str, option: str | None = None) -> list[Host]:
    """Read and parse the host file at ``path``; errors start with ``option``
    (e.g. ``--server-hosts``) when given."""
    try:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise HostfileError(f"cannot read host file {path!r}: {e.strerror or e}") from None
        return parse(text, path)
    except HostfileError as e:
        if option is None:
            raise
        raise HostfileError(f"{option}: {e}") from None


def capacity(hosts: list[Host]) -> int | None:
    """The slots of ``hosts`` in all; None when one of them has no limit."""
    slots = [h.slots for h in hosts if h.slots is not None]
    return sum(slots) if len(slots) == len(hosts) else None


def place(hosts: list[Host], num_servers: int, num_workers: int,
          oversubscribe: bool = False, source: str = "the host file") -> list[Host]:
    """The host of every process: servers 0..S-1, then workers 0..W-1 (the
    launch order). Round-robin over ``hosts``, skipping full ones. ``source``
    names the file in the error raised when the processes do not fit."""
    total = num_servers + num_workers
    slots = capacity(hosts)
    if slots is not None and total > slots and not oversubscribe:
        raise HostfileError(
            f"{_processes(num_servers, num_workers)} do not fit in the {slots} slots of "
            f"{source}; add hosts or slots, or allow --oversubscribe")
    used = [0] * len(hosts)
    placed = []
    turn = 0
    for _ in range(total):
        for step in range(len(hosts)):
            i = (turn + step) % len(hosts)
            limit = hosts[i].slots
            if limit is None or used[i] < limit:
                break
        else:  # every host is full: oversubscribe, round-robin
            i = turn % len(hosts)
        used[i] += 1
        placed.append(hosts[i])
        turn = i + 1
    return placed


def _processes(num_servers: int, num_workers: int) -> str:
    if not (num_servers and num_workers):
        return plural(num_servers, "server") if num_servers else plural(num_workers, "worker")
    return (f"{num_servers + num_workers} processes ({num_servers} servers + "
            f"{num_workers} workers)")


def place_apart(workers: list[Host], servers: list[Host], num_servers: int, num_workers: int,
                oversubscribe: bool = False,
                sources: tuple[str, str] = ("-H", "--server-hosts")) -> list[Host]:
    """The host of every process (servers, then workers) when servers have hosts
    of their own: servers round-robin over ``servers``, workers over ``workers``,
    each as :func:`place` deals them. ``sources`` name the two files in errors.
    Raises :class:`HostfileError` if a host (name and port) is in both lists."""
    ports = {(h.host, h.port): h for h in workers}
    both = [h.name for h in servers if (h.host, h.port) in ports]
    if both:
        raise HostfileError(
            f"{', '.join(both)} {'is' if len(both) == 1 else 'are'} in both {sources[0]} and "
            f"{sources[1]}: a host runs either workers or servers (to run servers on the "
            f"worker hosts, leave out {sources[1].split()[0]})")
    return (place(servers, num_servers, 0, oversubscribe, sources[1])
            + place(workers, 0, num_workers, oversubscribe, sources[0]))


def describe(labels: list[str], placed: list[Host]) -> str:
    """Placement as text, one host per line: ``127.0.0.2: server 0, worker 0``."""
    by_host: dict[str, list[str]] = {}
    for label, host in zip(labels, placed):
        by_host.setdefault(host.name, []).append(label)
    width = max(len(name) for name in by_host)
    return "\n".join(f"  {name:<{width}}  {', '.join(items)}" for name, items in by_host.items())
