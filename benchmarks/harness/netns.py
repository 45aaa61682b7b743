"""Emulated machines on one host: network namespaces joined to one bridge, each by
its own rate-limited link (a veth pair, a token bucket, tc tbf, on both ends).

The layer that benchmarks.link (the gradient exchange over layouts of W workers
and S servers), benchmarks.trainer --link (a training step) and benchmarks.chaos
share: building and removing the namespaces (:class:`Cluster` of H hosts;
:class:`HostPair`, its two-host case A and B), deleting the namespaces that runs
killed before they could clean up left behind (:func:`reap_stale`), the byte
counters of every host's link, and a raw TCP bulk transfer that checks the
emulated rate is real (:func:`raw_check`). Which process runs where is
benchmarks/harness/placement.py (re-exported here: :func:`ps_job`, :func:`gloo_ranks`).
Needs root; without it :meth:`Cluster.up` raises :class:`SetupFailed`.

Also run as a file, inside a namespace, by :func:`measure_raw`:
``python benchmarks/harness/netns.py _bulk recv HOST PORT`` / ``_bulk send HOST PORT NBYTES``.
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
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    __package__ = "benchmarks.harness"

from benchmarks.harness.contenders.base import Failed  # noqa: E402,F401  (a launch failed: crash, timeout, wrong sum or transport)
from benchmarks.harness.procs import stop  # noqa: E402

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


def run_checked(argv, what: str) -> str:
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


class Cluster:
    """H emulated hosts: a network namespace each, joined to one bridge by a veth
    pair, both ends rate-limited by tbf (:meth:`set_rate`): every host has its
    own full-duplex link of the same rate to a switch (the bridge, in a namespace
    of its own), as machines on one top-of-rack switch. The host's end of its veth
    (``dev``) is its network interface; the switch's end (``port``) limits what
    the switch sends to the host. Everything lives inside the namespaces: the
    host's own interfaces are untouched, and deleting the namespaces removes it all.

    Names carry this process's id (``kvlink-PID-TAG-HOST``): :meth:`up` first
    deletes the namespaces of runs whose process is gone (killed before it could
    clean up; :func:`reap_stale`)."""

    def __init__(self, hosts=("A", "B")):
        if not 1 <= len(hosts) <= 250:
            raise ValueError(f"{len(hosts)} hosts: 1 to 250")
        tag = secrets.token_hex(3)
        self.tag = f"{NS_PREFIX}{os.getpid()}-{tag}"
        self.hosts = list(hosts)
        self.ns = {h: f"{self.tag}-{h.lower()}" for h in self.hosts}
        self.switch = f"{self.tag}-switch"
        self.dev = {h: f"kv{tag}h{i}" for i, h in enumerate(self.hosts)}    # <= 15 characters
        self.port = {h: f"kv{tag}p{i}" for i, h in enumerate(self.hosts)}
        net = f"10.{random.randint(1, 254)}.{random.randint(0, 255)}"
        self.addr = {h: f"{net}.{i + 1}" for i, h in enumerate(self.hosts)}
        self.created: list[str] = []
        self.qdisc: dict = {}

    def up_or_skip(self) -> bool:
        """:meth:`up`, or False after printing the "skipped" line that the benchmarks
        print where they cannot run (no root or no network namespaces)."""
        try:
            self.up()
        except SetupFailed as e:
            print(f"skipped: the emulated network cannot be set up here (needs root and "
                  f"network namespaces): {e}", flush=True)
            return False
        return True

    def up(self) -> None:
        """Create the switch, then every host and its link. Raises SetupFailed."""
        reap_stale()
        run_checked(["ip", "netns", "add", self.switch], "cannot create a network namespace")
        self.created.append(self.switch)
        sw = ["ip", "-n", self.switch]
        run_checked([*sw, "link", "add", "br0", "type", "bridge"], "cannot create a bridge")
        run_checked([*sw, "link", "set", "br0", "up"], "ip link set br0 up")
        for h in self.hosts:
            ns, dev, port = self.ns[h], self.dev[h], self.port[h]
            run_checked(["ip", "netns", "add", ns], "cannot create a network namespace")
            self.created.append(ns)
            run_checked(["ip", "-n", ns, "link", "add", dev, "type", "veth", "peer", "name", port,
                  "netns", self.switch], "cannot create a veth pair")
            run_checked([*sw, "link", "set", port, "master", "br0", "up"], "cannot attach to the bridge")
            run_checked(["ip", "-n", ns, "addr", "add", f"{self.addr[h]}/24", "dev", dev], "ip addr")
            run_checked(["ip", "-n", ns, "link", "set", dev, "up"], "ip link set up")
            run_checked(["ip", "-n", ns, "link", "set", "lo", "up"], "ip link set lo up")

    def set_rate(self, rate: str) -> dict:
        """Limit every host's link to ``rate`` in each direction (tc syntax)."""
        bps = parse_rate(rate)
        burst = max(256 << 10, int(bps / 8 / 1000))     # >= 1 ms worth of bytes, >= a GSO packet
        args = ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]
        for h in self.hosts:
            for ns, dev in ((self.ns[h], self.dev[h]), (self.switch, self.port[h])):
                run_checked(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *args],
                     "cannot set the rate limit (tc tbf)")
        self.qdisc = {"rate": rate, "bits_per_s": bps, "burst_bytes": burst, "latency": "50ms",
                      "tc": " ".join(args)}
        return self.qdisc

    def host_counters(self) -> dict:
        """{host: {"tx": bytes the host sent, "rx": bytes it received}} so far (its
        interface's counters; None where one could not be read)."""
        out: dict[str, dict[str, int | None]] = {}
        for h in self.hosts:
            try:
                info = json.loads(run_checked(["ip", "-n", self.ns[h], "-s", "-j", "link", "show", "dev",
                                        self.dev[h]], "ip -s link"))[0]["stats64"]
                out[h] = {"tx": int(info["tx"]["bytes"]), "rx": int(info["rx"]["bytes"])}
            except (SetupFailed, ValueError, KeyError, IndexError):
                out[h] = {"tx": None, "rx": None}
        return out

    @staticmethod
    def counted(before: dict, after: dict, hosts=None) -> dict:
        """{host: {"tx", "rx"}}: the bytes each host's interface sent and received
        between two :meth:`host_counters` (None where a counter could not be read);
        ``hosts``: only these."""
        return {h: {d: (after[h][d] - before[h][d]) if None not in (after[h][d], before[h][d])
                    else None for d in ("tx", "rx")} for h in (after if hosts is None else hosts)}

    def exec_argv(self, host: str, argv) -> list[str]:
        return ["ip", "netns", "exec", self.ns[host], *argv]

    def down(self) -> list[str]:
        """Delete every namespace created (the veth pairs and the bridge go with
        them). Returns errors."""
        errors = []
        for ns in reversed(self.created):
            p = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True,
                               timeout=30)
            if p.returncode != 0:
                errors.append(f"ip netns del {ns}: {p.stderr.strip()}")
        self.created = []
        return errors


class HostPair(Cluster):
    """Two emulated machines, A and B (benchmarks.trainer --link, benchmarks.chaos):
    a :class:`Cluster` of two hosts, counted per direction between them."""

    def __init__(self):
        super().__init__(("A", "B"))

    def counters(self) -> dict:
        """Bytes sent by A (A->B) and by B (B->A) so far."""
        c = self.host_counters()
        return {"a_to_b": c["A"]["tx"], "b_to_a": c["B"]["tx"]}

    def sent_since(self, before: dict) -> dict:
        """Bytes each side sent since ``before`` (an earlier :meth:`counters`); None
        where a counter could not be read."""
        after = self.counters()
        return {k: (after[k] - before[k]) if None not in (after[k], before[k]) else None
                for k in after}


STALE_UNOWNED_S = 3600   # a namespace without a pid in its name is stale after this long


def reap_stale() -> list[str]:
    """Delete the ``kvlink-`` namespaces of runs that are gone: the process whose
    id the name carries no longer exists (``kvlink-PID-...``), or, for names
    without one (older runs), it was created over an hour ago; either way only
    when no process runs inside it. Returns the names deleted."""
    gone = []
    for ns in list_namespaces():
        m = re.match(re.escape(NS_PREFIX) + r"(\d+)-", ns)
        if not ns.startswith(NS_PREFIX) or (m and _alive(int(m.group(1)))):
            continue
        if m is None:
            try:
                if time.time() - os.stat(f"/run/netns/{ns}").st_mtime < STALE_UNOWNED_S:
                    continue
            except OSError:
                continue
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                              timeout=30)
        if pids.returncode == 0 and not pids.stdout.strip():
            if subprocess.run(["ip", "netns", "del", ns], capture_output=True,
                              timeout=30).returncode == 0:
                gone.append(ns)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
        assert self.p.stdout is not None   # a pipe
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


def measure_raw(link: Cluster, nbytes: int, timeout: float) -> dict:
    """A TCP bulk transfer of ``nbytes`` in each direction at once between the
    first two hosts (A and B below); payload Gbit/s."""
    A, B = link.hosts[:2]
    port = random.randint(20000, 60000)
    deadline = time.monotonic() + timeout
    popens = []
    try:
        receivers = {}
        for side in (A, B):   # A receives what B sends, and the other way round
            p = subprocess.Popen(
                link.exec_argv(side, [sys.executable, THIS, "_bulk", "recv", link.addr[side],
                                      str(port)]),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True)
            popens.append(p)
            receivers[side] = _Lines(p, f"bulk receiver in {side}")
        for side in (A, B):
            if receivers[side].next(deadline) != "ready":
                raise Failed(f"bulk receiver in {side}: unexpected output")
        senders = []
        for side, peer in ((A, B), (B, A)):
            senders.append(subprocess.Popen(
                link.exec_argv(side, [sys.executable, THIS, "_bulk", "send", link.addr[peer],
                                      str(port), str(nbytes)]),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                start_new_session=True))
            popens.append(senders[-1])
        got = {}
        for side, name in ((B, "a_to_b"), (A, "b_to_a")):
            got[name] = json.loads(receivers[side].next(deadline))
        for s in senders:
            if s.wait(max(0.1, deadline - time.monotonic())) != 0:
                assert s.stderr is not None   # stderr=PIPE
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


def raw_check(link: Cluster, rate: str, seconds: float) -> dict:
    """:func:`measure_raw` with ``seconds`` worth of bytes at the nominal ``rate`` (at
    least 4 MiB) each way."""
    nbytes = max(4 << 20, int(parse_rate(rate) / 8 * seconds))
    return measure_raw(link, nbytes, timeout=60 + 10 * seconds)


# the placement of jobs on the hosts, where benchmarks.trainer and benchmarks.chaos look for it
from benchmarks.harness.placement import (child_env, expected_transports, gloo_ranks,  # noqa: E402,F401
                                  ps_job, server_urls, side_of)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_bulk":
        sys.exit(_bulk_main(sys.argv[2:]))
    sys.exit(f"usage: {sys.argv[0]} _bulk recv HOST PORT | _bulk send HOST PORT NBYTES")
