"""Processes started over ssh: the ssh command line (:class:`SshOptions`,
:func:`remote_command`) and :class:`RemoteChild`, the launcher's handle on one. (Their
output and status lines are :mod:`tracker.node_output`, the scheduler's address
:mod:`tracker.addresses`, the checks of the hosts before a job starts
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

import json
import os
import shlex
import signal
import subprocess
import threading
from dataclasses import dataclass

from .hostfile import Host
from .node_output import Sink, exit_counter, parse_status
from .process import ProcSpec


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
        self.exception: str | None = None   # the last traceback's exception (the wrapper saw it)
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
                if msg.get("exception"):
                    self.exception = str(msg["exception"])
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
