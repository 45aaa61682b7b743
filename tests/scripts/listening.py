"""The TCP sockets this process listens on, read from /proc (Linux): what the test
jobs (torch_job.py, lightning_job.py) print, so that their tests can check that no
process of a job listens on every interface (0.0.0.0, ::).

    from listening import listening
    print("listens on", listening())        # e.g. ['127.0.0.1:40213']
"""

from __future__ import annotations

import os
import socket

WILDCARDS = ("0.0.0.0:", "[::]:")   # how listening() writes an address of every interface


def _address(hexed: str, v6: bool) -> str:
    raw = bytes.fromhex(hexed)
    if not v6:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    # four 32-bit words, each in host (little-endian) order
    return "[" + socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))) + "]"


def listening() -> list[str]:
    """``address:port`` of every TCP socket of this process in the LISTEN state, sorted."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:       # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    found = []
    for table, v6 in (("/proc/self/net/tcp", False), ("/proc/self/net/tcp6", True)):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:       # no IPv6 in this kernel
            continue
        for row in rows:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:      # 0A: TCP_LISTEN
                hexed, port = local.split(":")
                found.append(f"{_address(hexed, v6)}:{int(port, 16)}")
    return sorted(found)


def on_every_interface(addresses: list[str]) -> list[str]:
    """Those of ``addresses`` (as :func:`listening` writes them) that listen on every interface."""
    return [a for a in addresses if a.startswith(WILDCARDS)]
