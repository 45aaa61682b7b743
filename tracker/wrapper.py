"""The node-side wrapper that every remote launcher runs around each process.

It is sent as source (``python -c``) so a remote host needs nothing but a Python
interpreter for it; it uses the standard library only and imports nothing from
this package. It:

- starts the process (an argv list, in its own session, stdin closed, output
  merged) with ``PR_SET_PDEATHSIG`` so the process dies if the wrapper is killed;
- copies the output line by line with a ``[role:rank@host] `` prefix;
- reports ``@kvstore-node {json}`` lines: ``started`` (pid, host, address) and
  ``exit`` (the status; negative = killed by that signal);
- tears the process group down (SIGTERM, then SIGKILL after ``grace`` seconds)
  when it gets SIGTERM/SIGINT/SIGHUP, and in ``ssh`` mode also when its stdin
  reaches EOF (the launcher or its ssh connection went away) or the launcher
  writes ``TERM``, ``KILL`` or ``SIG <n>`` lines to it;
- is a child subreaper (Linux): a descendant that left the session (``setsid()``)
  and lost its parent is re-parented to the wrapper, not to init, and every
  process below the wrapper is ended with the process (SIGKILL once it exited).

:func:`processes`, :func:`descendants` and :func:`subreaper` serve the local
launcher too (``tracker.process``): this file must run alone on remote hosts.

Modes::

    python -c SRC ssh JOB ROLE RANK -- ARGV...   header (JSON, one line) on stdin:
        {"env": {...}, "label": host, "node_host": addr|null,
         "scheduler": [host, port], "grace": s}
    python -c SRC rank JOB PLAN_JSON             one process per MPI/Slurm rank:
        PLAN = {"num_servers", "rank_vars": [...], "argv": {role: [...]},
                "env": {role: {...}}, "drop": {role: [names]}, "rank_names": [...],
                "host_names": [...], "node_host": {role: addr}, "scheduler": [h, p], "grace": s}
        global rank r < num_servers -> server r, else worker r - num_servers.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

STATUS = "@kvstore-node "
_out_lock = threading.Lock()
PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37


def emit(text):
    with _out_lock:
        try:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
        except (OSError, ValueError):   # the launcher is gone; teardown follows
            pass


def status(role, rank, **fields):
    emit(STATUS + json.dumps({"role": role, "rank": rank, **fields}))


def route_address(host, port):
    """This machine's address on the route to ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, int(port)))
            return s.getsockname()[0]
    except OSError:
        return None


def bindable(addr):
    try:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
        return True
    except (OSError, ValueError):
        return False


def node_address(wanted, scheduler):
    """The address to bind and advertise: ``wanted`` if this machine has it,
    else the one that routes to the scheduler. Returns (address, warning)."""
    if wanted and bindable(wanted):
        return wanted, None
    found = route_address(*scheduler) or socket.gethostbyname(socket.gethostname())
    if wanted:
        return found, f"address {wanted} is not on this machine; using {found} instead"
    return found, None


def parent_death_signal(sig=signal.SIGKILL):
    """Ask Linux to send ``sig`` to this process when its parent dies."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: teardown then relies on stdin EOF and signals
        pass


def subreaper(on=True):
    """Make this process a child subreaper, or stop being one (Linux >= 3.4): a
    descendant whose parent dies is re-parented to it instead of init, so it stays
    below this process (setsid() cannot take it out of the tree). Returns whether
    it was one before, or None where this is not possible (not Linux)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        was = ctypes.c_int(0)
        if libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(was), 0, 0, 0) != 0:
            return None
        if libc.prctl(PR_SET_CHILD_SUBREAPER, int(bool(on)), 0, 0, 0) != 0:
            return None
        return bool(was.value)
    except (OSError, AttributeError):   # no prctl: teardown reaches groups and sessions only
        return None


def processes():
    """(pid, state, parent pid, session id) of every process, state 'Z' for a
    zombie (Linux /proc; [] elsewhere)."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            found.append((int(entry), fields[0].decode(), int(fields[1]), int(fields[3])))
        except (OSError, IndexError, ValueError):
            continue
    return found


def session_members(sid):
    """Live (not zombie) processes whose session id is ``sid`` ([] without /proc).
    A session id is not reused while the session has members."""
    return [pid for pid, state, _, session in processes() if state != "Z" and session == sid]


def descendants(root, table=None):
    """Live processes below ``root`` (its children, theirs, ...) by their parent
    links; ``table``: pid -> parent pid of the live processes (default: read now)."""
    if table is None:
        table = {pid: ppid for pid, state, ppid, _ in processes() if state != "Z"}
    children = {}
    for pid, ppid in table.items():
        children.setdefault(ppid, []).append(pid)
    found, seen, frontier = [], {root}, [root]
    while frontier:   # ``seen``: /proc is not read atomically; a reused pid must not loop
        kids = [pid for pid in children.get(frontier.pop(), ()) if pid not in seen]
        seen.update(kids)
        found += kids
        frontier += kids
    return found


def reap_orphans():
    """Collect the exit status of every child that ended (orphans this subreaper
    received); only once the wrapped process was waited for."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def stopping(role, rank, reason):
    """The line a kvstore process logs when it stops for a reason of the job's, not a
    bug of its own (a server that lost the scheduler, or was told the job aborted):
    :class:`Exceptions` takes ``reason`` from it, as from a worker's traceback."""
    return f"{role} {rank} stopping: {reason}"


class Exceptions:
    """Watches a process's output lines for why it failed: :attr:`last` is the last
    line of the last Python traceback (the exception, ``ValueError: bad value``) or
    the reason of the last :func:`stopping` line, whichever came later, or None.
    Lines of other threads between a traceback's frames (a log line) are skipped:
    the exception's line names a class (``name.Name: message`` or ``Name``)."""

    LINE = re.compile(r"^[A-Za-z_][\w.]*(?::(?: .*)?)?$")
    STOPPING = re.compile(r"\b(?:server|worker) \d+ stopping: (.+)$")

    def __init__(self):
        self.last = None
        self._inside = False

    def feed(self, line):
        if line.startswith("Traceback (most recent call last):"):
            self._inside = True
        elif self._inside and self.LINE.match(line):
            self.last, self._inside = line.strip()[:500], False
        elif not self._inside:
            said = self.STOPPING.search(line)
            if said:
                self.last = said.group(1).strip()[:500]


class Wrapped:
    def __init__(self, role, rank, label, argv, env, grace):
        self.role, self.rank, self.grace = role, rank, grace
        self.prefix = f"[{role}:{rank}@{label}] "
        self.stop = threading.Event()
        self.kill = threading.Event()
        self.forward = []
        self.exceptions = Exceptions()
        try:
            self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=parent_death_signal)
        except OSError as e:
            self.proc = None
            emit(self.prefix + f"could not start {' '.join(argv)}: {e}")
            status(role, rank, event="exit", code=127, error=f"could not start {argv[0]}: {e}")
            return
        self.pump = threading.Thread(target=self._copy, daemon=True)
        self.pump.start()

    def _copy(self):
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.exceptions.feed(line)
            emit(self.prefix + line)

    def group(self, sig):
        """``sig`` to the process's group, every member of its session (a
        grandchild may have moved to a group of its own) and every process below
        this wrapper (one may have left the session: setsid())."""
        for kill, target in ([(os.killpg, self.proc.pid)]
                             + [(os.kill, p) for p in session_members(self.proc.pid)]
                             + [(os.kill, p) for p in descendants(os.getpid())]):
            try:
                kill(target, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def leftovers(self):
        """What still lives of the process's session or below this wrapper."""
        return session_members(self.proc.pid) + descendants(os.getpid())

    def run(self):
        """Wait for the process, honouring stop/kill requests. Returns its status."""
        deadline = None
        while True:
            try:
                code = self.proc.wait(0.1)   # the wrapper's monitor tick
                break
            except subprocess.TimeoutExpired:
                pass
            while self.forward:
                self.group(self.forward.pop(0))
            if self.kill.is_set():
                self.group(signal.SIGKILL)
            elif self.stop.is_set():
                if deadline is None:
                    self.group(signal.SIGTERM)
                    deadline = time.monotonic() + self.grace
                elif time.monotonic() > deadline:
                    self.group(signal.SIGKILL)
        end = time.monotonic() + 2.0
        # whatever it left behind (session, orphans), until none is left; before the
        # output is drained: a leftover may hold the output pipe open
        while self.leftovers() and time.monotonic() < end:
            self.group(signal.SIGKILL)
            reap_orphans()
            time.sleep(0.05)   # a poll interval while they die, not synchronisation
        reap_orphans()
        self.pump.join(2.0)
        return code


def _watch_stdin(w):
    for line in sys.stdin:
        word = line.split()
        if word[:1] == ["TERM"]:
            w.stop.set()
        elif word[:1] == ["KILL"]:
            w.kill.set()
        elif word[:1] == ["SIG"] and len(word) == 2 and word[1].isdigit():
            w.forward.append(int(word[1]))
    w.stop.set()  # EOF: the launcher (or the connection to it) is gone


def main(argv):
    mode = argv[0]   # argv[1]: the job id, shown in ps
    parent = os.getppid()
    parent_death_signal(signal.SIGTERM)   # sshd session / orted / slurmstepd gone: stop
    if os.getppid() != parent:
        return 1
    subreaper()   # orphans of the process's tree come to us, and end with it
    if mode == "ssh":
        role, rank = argv[2], int(argv[3])
        command = argv[5:]
        line = sys.stdin.readline()
        if not line.strip():   # the launcher went away before it sent the header
            return 1
        header = json.loads(line)
        env = {**os.environ, **header.get("env", {})}
        label, grace = header.get("label", socket.gethostname()), float(header.get("grace", 3))
        scheduler, wanted = header.get("scheduler"), header.get("node_host")
        host_names = header.get("host_names", [])
    else:
        plan = json.loads(argv[2])
        value = next((os.environ[n] for n in plan["rank_vars"] if os.environ.get(n)), None)
        if value is None:
            sys.stderr.write(f"kvstore node wrapper: none of {plan['rank_vars']} is set; "
                             "is this running under the right launcher?\n")
            return 2
        index = int(value)
        role = "server" if index < plan["num_servers"] else "worker"
        rank = index if role == "server" else index - plan["num_servers"]
        command = plan["argv"][role]
        env = {k: v for k, v in os.environ.items() if k not in set(plan["drop"][role])}
        env.update(plan["env"][role])
        for name in plan["rank_names"]:
            env[name] = str(rank)
        label, grace = socket.gethostname(), float(plan["grace"])
        scheduler, host_names = plan["scheduler"], plan["host_names"]
        wanted = (plan.get("node_host") or {}).get(role)
    address, warning = node_address(wanted, scheduler)
    for name in host_names:
        env[name] = address
    stop_signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    for sig in stop_signals:  # until the process exists, a signal just ends the wrapper
        signal.signal(sig, lambda *_: sys.exit(128 + 15))
    w = Wrapped(role, rank, label, command, env, grace)
    if w.proc is None:
        return 127
    for sig in stop_signals:
        signal.signal(sig, lambda *_: w.stop.set())
    if warning:
        emit(w.prefix + "warning: " + warning)
    status(role, rank, event="started", pid=w.proc.pid, host=socket.gethostname(), address=address)
    if mode == "ssh":
        threading.Thread(target=_watch_stdin, args=(w,), daemon=True).start()
    code = w.run()
    status(role, rank, event="exit", code=code, **({"exception": w.exceptions.last}
                                                    if code and w.exceptions.last else {}))
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
