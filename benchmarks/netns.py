"""Two emulated "machines" on one host: network namespaces A and B joined by a veth
pair, each end rate-limited by a token bucket (tc tbf).

The layer that benchmarks.link (the gradient exchange) and benchmarks.trainer
--link (a training step) share: building and removing the namespaces
(:class:`Link`), the byte counters of the veth ends, a raw TCP bulk transfer that
checks the emulated rate is real (:func:`raw_check`), and the process lists that
place a kvstore job (:func:`ps_job`) or gloo ranks (:func:`gloo_ranks`) on the two
sides. Every process is started as ``ip netns exec NS PYTHON ...`` (an argument list,
never a shell string). Needs root; without it :meth:`Link.up` raises
:class:`SetupFailed`.

Also run as a file, inside a namespace, by :func:`measure_raw`:
``python benchmarks/netns.py _bulk recv HOST PORT`` / ``_bulk send HOST PORT NBYTES``.
"""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import selectors
import socket
import subprocess
import sys
import time

if __package__ in (None, ""):  # run as a file (_bulk): make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "benchmarks"

from benchmarks.contenders.base import Failed  # noqa: E402,F401  (a launch failed: crash, timeout, wrong sum or transport)
from benchmarks.procs import stop  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIS = os.path.abspath(__file__)
NS_PREFIX = "kvlink-"
UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


class SetupFailed(RuntimeError):
    """The emulated network could not be built here (no root, no veth/tbf)."""


def parse_rate(text: str) -> float:
    """'1gbit' -> 1e9 bits/s (tc's units: bit, kbit, mbit, gbit, tbit)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)\s*", text.lower())
    if not m:
        raise ValueError(f"{text!r} is not a rate like 500mbit, 1gbit, 4gbit")
    value = float(m.group(1)) * UNITS[m.group(2)]
    if value <= 0:
        raise ValueError(f"{text!r}: a rate must be > 0")
    return value


def _run(argv, what: str) -> str:
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SetupFailed(f"{what}: {' '.join(argv)}: {e}") from None
    if p.returncode != 0:
        raise SetupFailed(f"{what}: {' '.join(argv)} exited with {p.returncode}: "
                          f"{(p.stderr or p.stdout).strip()}")
    return p.stdout


def list_namespaces() -> list[str]:
    try:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.split()[0] for line in out.splitlines() if line.strip()]


class Link:
    """Two network namespaces joined by a veth pair, each end rate-limited by tbf."""

    def __init__(self):
        tag = secrets.token_hex(4)
        self.ns = {"A": f"{NS_PREFIX}{tag}-a", "B": f"{NS_PREFIX}{tag}-b"}
        self.dev = {"A": f"kvl{tag}a", "B": f"kvl{tag}b"}          # <= 15 characters
        net = f"10.{random.randint(1, 254)}.{random.randint(0, 255)}"
        self.addr = {"A": f"{net}.1", "B": f"{net}.2"}
        self.created: list[str] = []
        self.qdisc: dict = {}

    def up(self) -> None:
        for side in "AB":
            _run(["ip", "netns", "add", self.ns[side]], "cannot create a network namespace")
            self.created.append(self.ns[side])
        # both ends are created inside the namespaces: the host's own interfaces are untouched
        _run(["ip", "-n", self.ns["A"], "link", "add", self.dev["A"], "type", "veth", "peer",
              "name", self.dev["B"], "netns", self.ns["B"]], "cannot create a veth pair")
        for side in "AB":
            ns, dev = self.ns[side], self.dev[side]
            _run(["ip", "-n", ns, "addr", "add", f"{self.addr[side]}/24", "dev", dev], "ip addr")
            _run(["ip", "-n", ns, "link", "set", dev, "up"], "ip link set up")
            _run(["ip", "-n", ns, "link", "set", "lo", "up"], "ip link set lo up")

    def set_rate(self, rate: str) -> dict:
        bps = parse_rate(rate)
        burst = max(256 << 10, int(bps / 8 / 1000))     # >= 1 ms worth of bytes
        args = ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]
        for side in "AB":
            _run(["tc", "-n", self.ns[side], "qdisc", "replace", "dev", self.dev[side], "root",
                  *args], "cannot set the rate limit (tc tbf)")
        self.qdisc = {"rate": rate, "bits_per_s": bps, "burst_bytes": burst, "latency": "50ms",
                      "tc": " ".join(args)}
        return self.qdisc

    def counters(self) -> dict:
        """Bytes sent by A's end (A->B) and by B's end (B->A) so far."""
        out = {}
        for side, name in (("A", "a_to_b"), ("B", "b_to_a")):
            try:
                text = _run(["ip", "-n", self.ns[side], "-s", "-j", "link", "show", "dev",
                             self.dev[side]], "ip -s link")
                info = json.loads(text)[0]
                out[name] = int(info["stats64"]["tx"]["bytes"])
            except (SetupFailed, ValueError, KeyError, IndexError):
                out[name] = None
        return out

    def sent_since(self, before: dict) -> dict:
        """Bytes each end sent since ``before`` (an earlier :meth:`counters`); None where
        a counter could not be read."""
        after = self.counters()
        return {k: (after[k] - before[k]) if None not in (after[k], before[k]) else None
                for k in after}

    def exec_argv(self, side: str, argv) -> list[str]:
        return ["ip", "netns", "exec", self.ns[side], *argv]

    def down(self) -> list[str]:
        """Delete every namespace created (the veth pair goes with them). Returns errors."""
        errors = []
        for ns in reversed(self.created):
            p = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True,
                               timeout=30)
            if p.returncode != 0:
                errors.append(f"ip netns del {ns}: {p.stderr.strip()}")
        self.created = []
        return errors


def on_sigterm(signum, frame):
    """A SIGTERM handler: unwinds (as Ctrl-C does) through the link's clean-up."""
    raise KeyboardInterrupt(f"signal {signum}")


# -- raw TCP check of the emulated link ------------------------------------------------------

def _bulk_main(argv: list[str]) -> int:
    """``netns.py _bulk recv HOST PORT`` / ``_bulk send HOST PORT NBYTES`` (inside a namespace)."""
    mode, host, port = argv[0], argv[1], int(argv[2])
    if mode == "recv":
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((host, port))
        srv.listen(1)
        print("ready", flush=True)
        conn, _ = srv.accept()
        buf, got, t0 = bytearray(1 << 20), 0, None
        while True:
            n = conn.recv_into(buf)
            if not n:
                break
            if t0 is None:
                t0 = time.perf_counter()
            got += n
        seconds = time.perf_counter() - (t0 or time.perf_counter())
        print(json.dumps({"bytes": got, "seconds": seconds}), flush=True)
        return 0
    nbytes = int(argv[3])
    block = bytes(4 << 20)
    with socket.create_connection((host, port), timeout=60) as s:
        left = nbytes
        while left > 0:
            s.sendall(block[:min(left, len(block))])
            left -= len(block)
    return 0


class _Lines:
    """Lines from a child's stdout (binary pipe), each awaited with a deadline."""

    def __init__(self, p: subprocess.Popen, what: str):
        self.p, self.what, self.buf = p, what, b""

    def next(self, deadline: float) -> str:
        fd = self.p.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            with selectors.DefaultSelector() as sel:
                sel.register(fd, selectors.EVENT_READ)
                if left <= 0 or not sel.select(left):
                    raise Failed(f"{self.what}: no answer in time")
            chunk = os.read(fd, 65536)
            if not chunk:
                err = self.p.stderr.read().decode("utf-8", "replace") if self.p.stderr else ""
                raise Failed(f"{self.what}: exited ({self.p.wait()}) without answering: {err}")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode().strip()


def measure_raw(link: Link, nbytes: int, timeout: float) -> dict:
    """A TCP bulk transfer of ``nbytes`` in each direction at once; payload Gbit/s."""
    port = random.randint(20000, 60000)
    deadline = time.monotonic() + timeout
    popens = []
    try:
        receivers = {}
        for side in "AB":   # A receives what B sends, and the other way round
            p = subprocess.Popen(
                link.exec_argv(side, [sys.executable, THIS, "_bulk", "recv", link.addr[side],
                                      str(port)]),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True)
            popens.append(p)
            receivers[side] = _Lines(p, f"bulk receiver in {side}")
        for side in "AB":
            if receivers[side].next(deadline) != "ready":
                raise Failed(f"bulk receiver in {side}: unexpected output")
        senders = []
        for side, peer in (("A", "B"), ("B", "A")):
            senders.append(subprocess.Popen(
                link.exec_argv(side, [sys.executable, THIS, "_bulk", "send", link.addr[peer],
                                      str(port), str(nbytes)]),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                start_new_session=True))
            popens.append(senders[-1])
        got = {}
        for side, name in (("B", "a_to_b"), ("A", "b_to_a")):
            got[name] = json.loads(receivers[side].next(deadline))
        for s in senders:
            if s.wait(max(0.1, deadline - time.monotonic())) != 0:
                raise Failed(f"bulk sender failed: {s.stderr.read().decode('utf-8', 'replace')}")
    except subprocess.TimeoutExpired:
        raise Failed("bulk transfer timed out") from None
    finally:
        stop(popens, grace=2.0)
        for p in popens:
            for f in (p.stdout, p.stderr):
                if f is not None:
                    f.close()
    out = {"bytes_each_way": nbytes}
    for name, r in got.items():
        out[f"{name}_gbit"] = r["bytes"] * 8 / max(r["seconds"], 1e-9) / 1e9
        out[f"{name}_seconds"] = r["seconds"]
        if r["bytes"] != nbytes:
            raise Failed(f"bulk transfer {name}: received {r['bytes']} of {nbytes} bytes")
    return out


def raw_check(link: Link, rate: str, seconds: float) -> dict:
    """:func:`measure_raw` with ``seconds`` worth of bytes at the nominal ``rate`` (at
    least 4 MiB) each way."""
    nbytes = max(4 << 20, int(parse_rate(rate) / 8 * seconds))
    return measure_raw(link, nbytes, timeout=60 + 10 * seconds)


# -- placing processes on the two machines ---------------------------------------------------

def child_env(extra: dict) -> dict:
    """The environment of a process on either side: this repository importable,
    unbuffered output, and ``extra``."""
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": REPO + (os.pathsep + path if path else ""), "PYTHONUNBUFFERED": "1",
            **extra}


def side_of(rank: int) -> str:
    """The emulated machine of server/worker/gloo rank ``rank`` (A: even, B: odd; W=2,
    S=2: server 0 and worker 0 with the scheduler on A, server 1 and worker 1 on B)."""
    return "AB"[rank % 2]


def expected_transports(num_servers: int) -> list[str]:
    """What worker 0 (on A) must report per server of :func:`ps_job`: shared memory to
    the servers on its own machine, tcp across the link."""
    return ["shm" if side_of(r) == "A" else "tcp" for r in range(num_servers)]


def server_urls(link: Link, num_servers: int) -> list[str]:
    """The URL prefix at which each server of :func:`ps_job` must be reached (tcp)."""
    return [f"tcp://{link.addr[side_of(r)]}:" for r in range(num_servers)]


def ps_job(link: Link, num_workers: int, num_servers: int, server_argv, worker_argv,
           extra: dict) -> list[tuple]:
    """A kvstore job across the link as run_group's [(label, argv, env)]: the scheduler
    on A, server r and worker r on side_of(r), the default transport (shared memory
    within a machine, since the host identity includes the network namespace; tcp
    across the link, as between machines); each process with the environment a launcher would
    set (tracker/control/env.py ``for_process``), the job secret in the environment only."""
    from tracker.control import env as tracker_env
    from tracker.control.security import new_secret
    port = random.randint(20000, 60000)   # a fresh namespace: nothing else listens there
    shared = {"KVSTORE_SECRET": new_secret(),   # the environment, never argv
              "KVSTORE_SECURE": "0", **extra}

    def env(role, rank, side):
        return child_env(tracker_env.for_process(
            role=role, rank=rank, scheduler_host=link.addr["A"], scheduler_port=port,
            num_workers=num_workers, num_servers=num_servers, node_host=link.addr[side],
            extra=shared))
    procs = [("scheduler", link.exec_argv("A", [sys.executable, "-m", "tracker.scheduler"]),
              env("scheduler", None, "A"))]
    procs += [(f"server {r}", link.exec_argv(side_of(r), server_argv), env("server", r, side_of(r)))
              for r in range(num_servers)]
    procs += [(f"worker {r}", link.exec_argv(side_of(r), worker_argv), env("worker", r, side_of(r)))
              for r in range(num_workers)]
    return procs


def gloo_ranks(link: Link, argv, ranks: int, label: str, extra: dict) -> list[tuple]:
    """torch.distributed ranks across the link as run_group's [(label, argv, env)]:
    rank r on side_of(r), the rendezvous on A's address, each rank's gloo on the veth
    of its own "machine" (not the host name's address)."""
    init = f"tcp://{link.addr['A']}:{random.randint(20000, 60000)}"
    return [(f"{label} {r}", link.exec_argv(side_of(r), argv),
             child_env({"RANK": str(r), "WORLD_SIZE": str(ranks), "BENCH_INIT_METHOD": init,
                        "MASTER_ADDR": link.addr["A"],
                        "GLOO_SOCKET_IFNAME": link.dev[side_of(r)], **extra}))
            for r in range(ranks)]


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_bulk":
        sys.exit(_bulk_main(sys.argv[2:]))
    sys.exit(f"usage: {sys.argv[0]} _bulk recv HOST PORT | _bulk send HOST PORT NBYTES")
