"""The address the nodes of a job reach its scheduler at, and the addresses of hosts
as this machine resolves them (the ssh, MPI and Slurm launchers)."""

from __future__ import annotations

import ipaddress
import socket
from typing import cast

from . import wrapper
from .hostfile import Host

def resolve(host: Host) -> str | None:
    """The address of ``host`` seen from here (IPv4 first), or None if it does
    not resolve here (e.g. an alias defined in an ssh config)."""
    try:
        infos = socket.getaddrinfo(host.host, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    # an IPv4 or IPv6 address (its sockaddr's host), the only families a host name resolves to
    return cast(str, infos[0][4][0]) if infos else None


def interface_address(name: str) -> str | None:
    """The IPv4 address of network interface ``name`` (Linux), or None."""
    import fcntl
    import struct
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                 struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None


def scheduler_address(host_ip: str | None, nodes: list[tuple[bool, str | None]]) -> str:
    """The address remote nodes use to reach the scheduler (which binds it).

    ``nodes``: for each host, (is it a loopback address, its address as resolved
    here or None). ``host_ip`` wins (an address, or a network interface name such
    as ``eth0``); else 127.0.0.1 when every node is on loopback, else this
    machine's address on the route to the first node that resolves here, else the
    address of this machine's host name. Raises ValueError if none is usable."""
    if host_ip:
        if _is_ipv6(host_ip):
            # the scheduler, the servers and every node's sockets speak IPv4 tcp
            raise ValueError(f"{host_ip} is an IPv6 address; the scheduler and servers use "
                             "IPv4 only: give an IPv4 address of this machine or an interface "
                             "that has one (hosts in the host file may still be IPv6 addresses)")
        if host_ip in {name for _, name in socket.if_nameindex()}:
            addr = interface_address(host_ip)
            if addr is None:
                raise ValueError(f"network interface {host_ip} has no IPv4 address")
            return addr
        if not wrapper.bindable(host_ip):
            raise ValueError(f"{host_ip} is not an address of this machine "
                             "(give one of its addresses or an interface name)")
        return host_ip
    remote = [addr for loopback, addr in nodes if not loopback]
    if not any(not loopback for loopback, _ in nodes):
        return "127.0.0.1"
    for addr in remote:
        if addr and not ipaddress_is_loopback(addr):
            found = wrapper.route_address(addr, 9)
            if found:
                return found
    try:
        own = socket.gethostbyname(socket.gethostname())
    except OSError:
        own = None
    if own and not ipaddress_is_loopback(own):
        return own
    raise ValueError("cannot tell which address of this machine the hosts can reach "
                     "(their names do not resolve here); give --host-ip ADDR or --host-ip IFACE")


def _is_ipv6(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.strip("[]").split("%")[0]).version == 6
    except ValueError:
        return False


def ipaddress_is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.split("%")[0]).is_loopback
    except ValueError:
        return addr == "localhost"
