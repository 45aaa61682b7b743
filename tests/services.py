"""Real services for the remote-launcher tests, started and stopped by the tests:
an sshd listening on 127.0.0.1-5 (a random port), a single-node Slurm cluster
(munged + slurmctld + slurmd, random ports), helpers to run a launcher and
to find processes a job left behind, and a probe for network namespaces (the
emulated-link benchmarks' tests).

Each ``start_*`` returns None with a reason when the programs are missing, so
the tests can skip cleanly; ``.ci/run`` installs them.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")
FAST_FAILURE = {"KVSTORE_HEARTBEAT_INTERVAL": "0.2", "KVSTORE_HEARTBEAT_TIMEOUT": "2",
                "KVSTORE_ABORT_GRACE": "2"}


STARTED: list["Proc"] = []   # every Proc of the running test (tests/conftest.py ends what is left)


class Proc:
    """A subprocess whose output lines are collected so tests can wait on them."""

    def __init__(self, argv, env=None, tag=None, cwd=ROOT):
        STARTED.append(self)
        self.tag = tag or uuid.uuid4().hex
        full_env = {**os.environ, "KVSTORE_TEST_TAG": self.tag, "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": ROOT, **(env or {})}
        self.popen = subprocess.Popen(argv, env=full_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, cwd=cwd)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.popen.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, pattern, count=1, timeout=60):
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while sum(bool(regex.search(line)) for line in self.lines) < count:
                left = deadline - time.monotonic()
                if left <= 0 or (self.popen.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"{pattern!r} x{count} not seen; output:\n{self.text}")
                self._cond.wait(min(left, 0.5))

    def wait(self, timeout=60):
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            raise AssertionError(f"did not exit within {timeout}s; output:\n{self.text}")
        self._reader.join(5)
        return code

    @property
    def text(self):
        return "\n".join(self.lines)

    def stop(self, timeout=30):
        """End it if it still runs (a failed test): SIGTERM, which a launcher takes to
        stop its job's processes, then wait."""
        if self.popen.poll() is None:
            self.popen.terminate()
            self.wait(timeout)

    def scheduler_port(self, timeout=30) -> int:
        """The port of the scheduler a launcher said it started (tracker.local's log)."""
        self.wait_for(r"scheduler listening on 127\.0\.0\.1:\d+", timeout=timeout)
        return int(re.search(r"scheduler listening on 127\.0\.0\.1:(\d+)", self.text).group(1))


def end_leftovers(since: int) -> None:
    """Kill whatever the Procs started since ``STARTED[since]`` (by one test) left
    running: a test that failed before it waited for its job would leave a looping
    job behind, slowing every later test. (Procs of module-scoped fixtures, started
    before the test's own set-up, stay.)"""
    while len(STARTED) > since:
        proc = STARTED.pop()
        for pid in tagged(proc.tag):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.popen.poll() is None:
            proc.popen.kill()
            proc.popen.wait(10)


def tagged(tag):
    """Live processes (other than us) whose environment carries ``tag``."""
    found = []
    needle = f"KVSTORE_TEST_TAG={tag}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0") and not _zombie(pid):
                    found.append(int(pid))
        except OSError:
            continue
    return found


def environ_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = [item.partition(b"=") for item in f.read().split(b"\0") if item]
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, _, v in items}


def command_lines_containing(text: str) -> list[str]:
    """Command lines of live processes that contain ``text`` (for secrets)."""
    found, needle = [], text.encode()
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    line = f.read()
            except OSError:
                continue
            if needle in line:
                found.append(line.replace(b"\0", b" ").decode(errors="replace")[:300])
    return found


def check_environments(tag: str, secret_name: str = "MY_TOKEN") -> None:
    """While a job runs: every process of it has KVSTORE_SECRET; workers have
    ``secret_name``, servers do not; neither value is on any command line."""
    envs = [environ_of(pid) for pid in tagged(tag)]
    roles = {e.get("KVSTORE_ROLE") for e in envs}
    assert {"worker", "server"} <= roles, roles
    for e in envs:
        if e.get("KVSTORE_ROLE") in ("worker", "server"):
            assert e.get("KVSTORE_SECRET"), e
            assert (secret_name in e) == (e["KVSTORE_ROLE"] == "worker"), e
            assert command_lines_containing(e["KVSTORE_SECRET"]) == []
            if secret_name in e:
                assert command_lines_containing(e[secret_name]) == []


def _zombie(pid) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as s:
            return s.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def alive(pid: int) -> bool:
    """True while process ``pid`` exists and is not a zombie."""
    return not _zombie(pid)


def descendants(root: int) -> list[int]:
    """Live processes below ``root`` (e.g. ssh sessions under an sshd)."""
    parent = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as s:
                    fields = s.read().rsplit(")", 1)[1].split()
                if fields[0] != "Z":
                    parent[int(pid)] = int(fields[1])
            except (OSError, IndexError):
                continue
    found, frontier = [], [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found += kids
        frontier += kids
    return found


def eventually_empty(probe, timeout=10.0):
    """``probe()`` until it returns an empty list or the deadline passes (processes
    being reaped right after the launcher returned); returns the last result."""
    deadline = time.monotonic() + timeout
    while True:
        found = probe()
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)  # polling process state: there is no event to wait on


def run_local_job(script: str, *args: str, cwd: str | os.PathLike[str], env: dict[str, str] | None = None, timeout: float = 120) -> str:
    """Run ``script`` as a 2-worker, 2-server job (``python -m tracker.local -n 2 -s 2
    python script args``) in ``cwd``, with this environment less its KVSTORE_/DMLC_
    variables, the repository on PYTHONPATH, a fresh KVSTORE_TEST_TAG, a 30 s
    KVSTORE_TIMEOUT, quick heartbeats, and then ``env``. Fails the test unless the job
    exits 0 within ``timeout`` seconds and leaves no process behind; returns its output
    (stdout and stderr)."""
    tag = uuid.uuid4().hex
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "DMLC_"))},
           "PYTHONPATH": path, "KVSTORE_TEST_TAG": tag, "KVSTORE_TIMEOUT": "30",
           "KVSTORE_HEARTBEAT_INTERVAL": "0.2", "KVSTORE_HEARTBEAT_TIMEOUT": "3", **(env or {})}
    p = subprocess.run([sys.executable, "-m", "tracker.local", "-n", "2", "-s", "2", sys.executable, script, *args],
                       cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=timeout, check=False)
    assert p.returncode == 0, p.stdout
    assert not eventually_empty(lambda: tagged(tag)), "processes of the job outlived it"
    return p.stdout


def import_script(name: str) -> types.ModuleType:
    """The module ``name`` of tests/scripts (what a job script shares with its test)."""
    sys.path.insert(0, SCRIPTS)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def run_with_output_closed(argv, env, timeout: float) -> tuple[str, int, str]:
    """Run a launcher as ``... | head -1`` does: read one line of its output, then
    close the pipe. Returns (that line, the exit status, its stderr); fails the test
    if the job does not end within ``timeout`` seconds."""
    popen = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=ROOT)
    errors = []
    reader = threading.Thread(target=lambda: errors.append(popen.stderr.read()), daemon=True)
    reader.start()
    first = popen.stdout.readline()
    popen.stdout.close()
    try:
        code = popen.wait(timeout)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait(10)
        reader.join(10)
        raise AssertionError(f"the job hung after its output pipe closed:\n{errors}")
    reader.join(10)
    return first, code, "".join(errors)


def which(name: str) -> str | None:
    """A program on PATH, or in the sbin directories (daemons live there and a
    non-login PATH may lack them)."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/local/sbin")


def free_port(host="127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_pair(host="127.0.0.1", tries: int = 50) -> int:
    """A port ``p`` with ``p + 1`` free too (a PyTorchJob's scheduler takes
    MASTER_PORT + 1); as racy as :func:`free_port`, not more."""
    for _ in range(tries):
        port = free_port(host)
        with socket.socket() as s:
            try:
                s.bind((host, port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no two consecutive free ports on {host} in {tries} tries")


def _wait_lines(popen, pattern, count, timeout, what, text=None):
    """Read ``popen``'s stderr until ``count`` lines match; raise with the text if
    not. Every line read, now and later, is appended to ``text``."""
    regex, text = re.compile(pattern), [] if text is None else text
    deadline = time.monotonic() + timeout
    result = {}

    def read():
        for line in popen.stderr:
            text.append(line)
            if regex.search(line):
                result["n"] = result.get("n", 0) + 1
                if result["n"] >= count:
                    return
    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(max(0.0, deadline - time.monotonic()))
    if result.get("n", 0) < count:
        raise RuntimeError(f"{what} did not start: {''.join(text)[-2000:]}")
    # keep draining so the daemon never blocks on a full pipe
    threading.Thread(target=lambda: [text.append(line) for line in popen.stderr], daemon=True).start()


# -- sshd -------------------------------------------------------------------------

ADDRESSES = tuple(f"127.0.0.{i}" for i in range(1, 6))   # 4, 5: dedicated server hosts (test_ssh, test_mpi)


class Sshd:
    """sshd on a random port of 127.0.0.1-5 with its own host and client keys."""

    def __init__(self, workdir: str):
        self.dir = workdir
        keygen = shutil.which("ssh-keygen")
        for name in ("host_key", "client_key"):
            subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-f",
                            os.path.join(workdir, name)], check=True)
        self.client_config = os.path.join(workdir, "ssh_config")
        with open(self.client_config, "w") as f:
            f.write(f"Host *\n  IdentityFile {workdir}/client_key\n  StrictHostKeyChecking no\n"
                    "  UserKnownHostsFile /dev/null\n  BatchMode yes\n  LogLevel ERROR\n")
        self.popen = None
        self.log: list[str] = []   # sshd's own log lines (-e: to stderr)
        for _ in range(5):   # a random port may be taken on one of the addresses
            self.port = free_port()
            config = os.path.join(workdir, "sshd_config")
            with open(config, "w") as f:
                f.write(f"Port {self.port}\n" + "".join(f"ListenAddress {a}\n" for a in ADDRESSES) +
                        f"HostKey {workdir}/host_key\nAuthorizedKeysFile {workdir}/client_key.pub\n"
                        "PermitRootLogin yes\nUsePAM no\nStrictModes no\nPasswordAuthentication no\n"
                        f"PidFile {workdir}/sshd.pid\nMaxSessions 100\nMaxStartups 100\n")
            self.popen = subprocess.Popen([which("sshd"), "-D", "-e",
                                           "-f", config], stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            try:
                _wait_lines(self.popen, r"Server listening on 127\.0\.0\.\d port", len(ADDRESSES), 20, "sshd",
                            self.log)
                return
            except RuntimeError:
                self.popen.kill()
                self.popen.wait()
        raise RuntimeError("sshd could not listen on a free port")

    def hostfile(self, *lines: str) -> str:
        """Write a host file; ``{port}`` in a line is this sshd's port."""
        path = os.path.join(self.dir, f"hosts-{uuid.uuid4().hex[:6]}")
        with open(path, "w") as f:
            f.write("\n".join(line.format(port=self.port) for line in lines) + "\n")
        return path

    def sessions(self) -> list[int]:
        return descendants(self.popen.pid)

    def stop(self):
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


def start_sshd(workdir: str) -> tuple[Sshd | None, str]:
    """An :class:`Sshd`, or None and the reason it cannot run here."""
    if not which("sshd") or not shutil.which("ssh") or not shutil.which("ssh-keygen"):
        return None, "openssh-server / openssh-client not installed (.ci/run installs them)"
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    try:
        return Sshd(workdir), ""
    except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
        return None, f"sshd cannot run here: {e}"


# -- Slurm ------------------------------------------------------------------------

SLURM_PROGRAMS = ("munged", "slurmctld", "slurmd", "srun", "sinfo")


class Slurm:
    """A single-node Slurm cluster (node 'kvnode' at 127.0.0.1, 8 CPUs declared)
    with its own munge daemon; SLURM_CONF points the client commands at it."""

    def __init__(self, workdir: str):
        self.dir = workdir
        os.chmod(workdir, 0o755)   # munged wants its socket's directory world-executable
        self.procs: list[subprocess.Popen] = []
        key = os.path.join(workdir, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o600)
        sock = os.path.join(workdir, "munge.sock")
        munged = subprocess.Popen(
            [which("munged"), "-F", "-f", f"--socket={sock}", f"--key-file={key}",
             f"--pid-file={workdir}/munged.pid", f"--log-file={workdir}/munged.log",
             f"--seed-file={workdir}/munged.seed"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.procs.append(munged)
        self._wait_path(sock, munged, f"{workdir}/munged.log")
        host = socket.gethostname()
        ports = (free_port(), free_port())
        for sub in ("state", "spool"):
            os.makedirs(os.path.join(workdir, sub), exist_ok=True)
        self.conf = os.path.join(workdir, "slurm.conf")
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=kvtest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
StateSaveLocation={workdir}/state
SlurmdSpoolDir={workdir}/spool
SlurmctldPidFile={workdir}/slurmctld.pid
SlurmdPidFile={workdir}/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait=5
SlurmctldLogFile={workdir}/slurmctld.log
SlurmdLogFile={workdir}/slurmd.log
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
NodeName=kvnode NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=debug Nodes=kvnode Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        self.env = {"SLURM_CONF": self.conf}
        env = {**os.environ, **self.env}
        for argv in ([which("slurmctld"), "-D", "-f", self.conf],
                     [which("slurmd"), "-D", "-N", "kvnode", "-f", self.conf]):
            self.procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                               stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 60
        while True:   # the node turns idle once slurmd registered with slurmctld
            r = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True)
            if r.stdout.strip() == "idle":
                break
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"slurm did not come up (exited: {dead}); sinfo: "
                                   f"{r.stdout.strip()} {r.stderr.strip()}; " + self._logs())
            time.sleep(0.2)  # polling the cluster state: sinfo has no wait option

    def _wait_path(self, path, proc, log):
        deadline = time.monotonic() + 20
        while not os.path.exists(path):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {proc.stderr.read() if proc.poll() is not None else ''}"
                                   f" {open(log).read()[-1000:] if os.path.exists(log) else ''}")
            time.sleep(0.05)  # polling for the socket file munged creates

    def _logs(self) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = os.path.join(self.dir, name)
            if os.path.exists(path):
                out.append(f"{name}: {open(path).read()[-1500:]}")
        return "\n".join(out)

    def stop(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def start_slurm(workdir: str) -> tuple[Slurm | None, str]:
    missing = [p for p in SLURM_PROGRAMS if not which(p)]
    if missing:
        return None, f"Slurm not installed ({', '.join(missing)} missing; .ci/run installs slurm-wlm and munge)"
    if os.geteuid() != 0:
        return None, "the test Slurm cluster runs its daemons as root (SlurmUser=root)"
    try:
        return Slurm(workdir), ""
    except (RuntimeError, OSError) as e:
        return None, f"Slurm cannot run here: {e}"


def python_launcher(module: str, *args, env=None, cwd=ROOT) -> Proc:
    return Proc([sys.executable, "-m", module, *args], env=env, cwd=cwd)


NETNS_PREFIX = "kvlink-"   # the emulated-link benchmarks' namespaces (benchmarks/harness/netns.py)


def namespaces() -> set[str]:
    """The network namespaces that exist now."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def netns_unavailable() -> str | None:
    """Why this machine cannot create (and delete) a network namespace, or None."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} (iproute2) is not installed"
    name = f"{NETNS_PREFIX}probe-{uuid.uuid4().hex[:8]}"
    try:
        p = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot run ip netns add: {e}"
    if p.returncode != 0:
        return f"cannot create network namespaces here (needs root): {p.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    assert name not in namespaces()
    return None


def killed_while_writing(path: str, nbytes: int = 1 << 20) -> None:
    """A process killed (SIGKILL) inside ``kvstore.fileio.atomic_write`` after writing
    ``nbytes`` of ``path``: it leaves the temporary a server killed during its save
    leaves (tests/faults/test_recovery.py, tests/server/test_checkpoint_sets.py)."""
    code = ("import os, signal, sys; from kvstore.fileio import atomic_write\n"
            "with atomic_write(sys.argv[1]) as f:\n"
            "    f.write(b'x' * int(sys.argv[2])); f.flush(); os.kill(os.getpid(), signal.SIGKILL)")
    done = subprocess.run([sys.executable, "-c", code, path, str(nbytes)], cwd=ROOT, timeout=60,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == -signal.SIGKILL
