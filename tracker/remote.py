"""Launcher side of processes that run elsewhere: output sinks, the node
wrapper's status lines, processes started over ssh, and the address the nodes
reach the scheduler at. (The checks of the hosts before a job starts are in
:mod:`tracker.preflight`.)

Every remote process runs inside the node wrapper (:mod:`tracker.wrapper`), sent as
source with ``python -c``. Over ssh the remote command line carries only the
interpreter, the wrapper, the job id, role, rank and the user's argv, each quoted
with :func:`shlex.quote`; the environment travels as one JSON line on the ssh
channel's stdin (never on a command line, never in a file). Then stdin stays
open: the launcher writes ``TERM``/``KILL`` to it, and EOF (the launcher or the
connection died) makes the wrapper stop its process group.
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import IO, cast

from . import wrapper
from .hostfile import Host
from .process import ProcSpec, write_out

STATUS = wrapper.STATUS
PREFIXED = re.compile(r"^\[(worker|server):(\d+)@[^\]]*\] ?")
exit_counter = itertools.count(1)


def wrapper_source() -> str:
    """The source of :mod:`tracker.wrapper`, for ``python -c``."""
    with open(wrapper.__file__, encoding="utf-8") as f:
        return f.read()


class Sink:
    """Where output lines go: this process's stdout (as they come, already
    prefixed) and optionally one log file per process (without the prefix)."""

    _lock = threading.Lock()

    def __init__(self, out: IO[str] | None = None, log_dir: str | None = None):
        self.out = out if out is not None else sys.stdout
        self.log_dir = log_dir
        self._logs: dict[tuple[str, int], IO[str]] = {}
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)

    def write(self, line: str) -> None:
        """Never raises: output that cannot be written (``| head -1`` closed the
        pipe, a full disk) is dropped, and the callers keep draining their
        processes' output, so no process blocks on a full pipe."""
        with self._lock:
            write_out(self.out, line + "\n")
            if self.log_dir and (m := PREFIXED.match(line)):
                key = (m[1], int(m[2]))
                try:
                    f = self._logs.get(key)
                    if f is None:
                        f = self._logs[key] = open(
                            os.path.join(self.log_dir, f"{key[0]}-{key[1]}.log"), "a",
                            encoding="utf-8")
                    f.write(line[m.end():] + "\n")
                    f.flush()
                except (OSError, ValueError):
                    pass

    def close(self) -> None:
        with self._lock:
            for f in self._logs.values():
                try:
                    f.close()
                except OSError:
                    pass
            self._logs.clear()


def parse_status(line: str) -> dict | None:
    """The wrapper's ``@kvstore-node {json}`` line as a dict, else None."""
    if not line.startswith(STATUS):
        return None
    try:
        msg = json.loads(line[len(STATUS):])
    except ValueError:
        return None
    return msg if isinstance(msg, dict) else None


# -- ssh -----------------------------------------------------------------------

@dataclass(frozen=True)
class SshOptions:
    """How to run ssh: ``-F config``, ``-i identity``, ``-o`` options."""
    config_file: str | None = None
    identity: str | None = None
    options: tuple[str, ...] = ()
    connect_timeout: float = 10.0
    program: str = "ssh"

    def base(self, host: Host | None = None) -> list[str]:
        """ssh and its options, without the destination."""
        argv = [self.program, "-T", "-o", "BatchMode=yes",
                "-o", f"ConnectTimeout={max(1, round(self.connect_timeout))}",
                "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3",
                "-o", "LogLevel=ERROR"]
        if self.config_file:
            argv += ["-F", self.config_file]
        if self.identity:
            argv += ["-i", self.identity]
        for option in self.options:
            argv += ["-o", option]
        if host is not None and host.port is not None:
            argv += ["-p", str(host.port)]
        return argv

    def argv(self, host: Host, remote_command: str) -> list[str]:
        return [*self.base(host), "--", host.destination, remote_command]


def remote_command(python: str, directory: str, job: str, proc: ProcSpec, argv: list[str],
                   source: str | None = None) -> str:
    """The shell command line run on the remote host: ``cd DIR && exec PYTHON -c
    WRAPPER ssh JOB ROLE RANK -- ARGV...``, every word quoted for the remote
    shell. ``source`` None shows ``<wrapper>`` instead of the wrapper's source."""
    wrapper = shlex.quote(source) if source is not None else "<wrapper>"
    words = " ".join(shlex.quote(w) for w in [job, proc.role, str(proc.rank), "--", *argv])
    return f"cd {shlex.quote(directory)} && exec {shlex.quote(python)} -c {wrapper} ssh {words}"


class RemoteChild:
    """A process started over ssh inside the node wrapper; the interface of
    :class:`tracker.process.Child` (``poll``, ``signal``, ``finish_output``)."""

    def __init__(self, spec: ProcSpec, host: Host, ssh_argv: list[str], header: dict, sink: Sink):
        self.spec = spec
        self.host = host.name
        self.detail: str | None = None
        self.exit_order: int | None = None
        self.remote_pid: int | None = None
        self._sink = sink
        self._code: int | None = None
        self._ssh_errors: list[str] = []
        self._stdin_lock = threading.Lock()
        self.popen = subprocess.Popen(ssh_argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, start_new_session=True)
        self._send(json.dumps(header))
        self._pumps = [threading.Thread(target=self._read_stdout, daemon=True,
                                        name=f"output-{spec.role}-{spec.rank}"),
                       threading.Thread(target=self._read_stderr, daemon=True,
                                        name=f"output-{spec.role}-{spec.rank}-ssh")]
        for t in self._pumps:
            t.start()

    @property
    def pid(self) -> int | None:
        """The process id on the remote host, once the wrapper reported it."""
        return self.remote_pid

    def _send(self, line: str, close: bool = False) -> None:
        with self._stdin_lock:
            stdin = self.popen.stdin
            assert stdin is not None   # a pipe (stdin=PIPE)
            try:
                if not stdin.closed:
                    stdin.write(line.encode() + b"\n")
                    stdin.flush()
                    if close:
                        stdin.close()
            except (BrokenPipeError, OSError):
                pass

    def _read_stdout(self) -> None:
        stdout = self.popen.stdout
        assert stdout is not None   # a pipe (stdout=PIPE)
        for raw in iter(stdout.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            msg = parse_status(line)
            if msg is None:
                self._sink.write(line)
            elif msg.get("event") == "started":
                self.remote_pid = msg.get("pid")
            elif msg.get("event") == "exit":
                if msg.get("error"):
                    self.detail = str(msg["error"])
                self.exit_order = next(exit_counter)
                try:
                    self._code = int(msg.get("code", 1))
                except (TypeError, ValueError):
                    self._code = 1
        stdout.close()

    def _read_stderr(self) -> None:
        prefix = f"[{self.spec.role}:{self.spec.rank}@{self.host}] "
        stderr = self.popen.stderr
        assert stderr is not None   # a pipe (stderr=PIPE)
        for raw in iter(stderr.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            self._ssh_errors = (self._ssh_errors + [line])[-5:]
            self._sink.write(prefix + line)
        stderr.close()

    def running(self) -> bool:
        """True until ssh ended, i.e. the wrapper confirmed its process group ended."""
        return self.popen.poll() is None

    def poll(self) -> int | None:
        if self._code is not None:
            return self._code
        if self.popen.poll() is None:
            return None
        for t in self._pumps:
            t.join(2.0)
        if self._code is None:  # no status from the wrapper: ssh or the remote shell failed
            self._code = self.popen.returncode
            self.exit_order = next(exit_counter)
            errors = "; ".join(e for e in self._ssh_errors if e.strip())
            what = "ssh failed" if self._code == 255 else "the remote command failed"
            self.detail = f"{what}: {errors}" if errors else what
        return self._code

    def signal(self, sig: int) -> None:
        """SIGTERM: graceful stop; SIGKILL: kill now; else forward the signal."""
        if self.popen.poll() is not None:
            return
        if sig == signal.SIGTERM:
            self._send("TERM")
        elif sig == signal.SIGKILL:
            self._send("KILL", close=True)
        else:
            self._send(f"SIG {int(sig)}")

    def finish_output(self, timeout: float = 10.0) -> None:
        """Wait for ssh to end (the remote side has then ended too); if it does
        not within ``timeout``, kill the local ssh (the wrapper then sees EOF)."""
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.popen.wait(5)
        for t in self._pumps:
            t.join(2.0)


# -- addresses -------------------------------------------------------------------

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
