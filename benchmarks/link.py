"""Gradient exchange of ResNet-50 over an emulated network link between two "machines".

    sudo python -m benchmarks.link                      # 1gbit and 4gbit, 2 interleaved launches
    python -m benchmarks.link --rates 10gbit --iters 20  # other rates (tc syntax: kbit, mbit, gbit)

Checks the step-time model of docs/performance.md section 6: with one worker per
machine and the servers co-located with the workers, a parameter server moves the
same bytes per link direction as a ring all-reduce, 2*(N-1)/N * M/B; and shows what
gradient compression (2bit, fp16: only the push half of the traffic shrinks) buys on
a slow link.

Two network namespaces ("machines" A and B, created here, removed at the end, even on
Ctrl-C or failure) joined by a veth pair, a token-bucket rate limit (tc tbf) on both
ends. First a raw TCP bulk transfer in both directions at once checks that the
emulated rate is real; then, per rate, interleaved launches of

  gloo  torch.distributed gloo, rank 0 in A (the rendezvous on A's address), rank 1 in B:
        one flat all_reduce (and DDP-style 25 MB buckets)
  ours  scheduler, server 0 and worker 0 in A; server 1 and worker 1 in B;
        KVSTORE_TRANSPORT=tcp (no shared memory across the emulated machines);
        pushpull of all 161 tensors: uncompressed, 2bit, fp16

Every process is started as ``ip netns exec NS PYTHON ...`` (an argument list) with the
environment a launcher would set (tracker/env.py ``for_process`` and a job secret, in
the environment only). The workers are benchmarks/contenders/{ours,gloo}_worker.py,
which verify every result. Writes link.md and link.json (every sample) to --out-dir.
Needs root (network namespaces); without it prints a "skipped" line and exits 0.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import re
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time

import click

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "benchmarks"

from benchmarks import common  # noqa: E402
from benchmarks.procs import GroupFailed, run_group, stop  # noqa: E402
from benchmarks.resnet50_shapes import model_shapes  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIS = os.path.abspath(__file__)
CONTENDERS_DIR = os.path.join(REPO, "benchmarks", "contenders")
OURS_WORKER = os.path.join(CONTENDERS_DIR, "ours_worker.py")
GLOO_WORKER = os.path.join(CONTENDERS_DIR, "gloo_worker.py")
SERVER = os.path.join(CONTENDERS_DIR, "server_wrapper.py")   # kvstore.server's main + CPU stats
DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "link")
NS_PREFIX = "kvlink-"

OURS_MODES = ("pushpull", "pushpull_2bit", "pushpull_fp16")
GLOO_MODES = ("flat", "buckets")
VARIANTS = {("gloo", "flat"): "one flat all_reduce",
            ("gloo", "buckets"): "25 MB buckets (DDP)",
            ("ours", "pushpull"): "tcp pushpull",
            ("ours", "pushpull_2bit"): "tcp pushpull, 2bit compression",
            ("ours", "pushpull_fp16"): "tcp pushpull, fp16 compression"}
# fraction of M that one push carries on the wire (2bit: 4 values per byte; fp16: 2 bytes)
PUSH_FRACTION = {"pushpull": 1.0, "pushpull_2bit": 1 / 16, "pushpull_fp16": 0.5,
                 "flat": 1.0, "buckets": 1.0}
UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


class SetupFailed(RuntimeError):
    """The emulated network could not be built here (no root, no veth/tbf)."""


class Failed(RuntimeError):
    """A launch failed (crash, timeout, wrong sum, wrong transport)."""


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


# -- raw TCP check of the emulated link ------------------------------------------------------

def _bulk_main(argv: list[str]) -> int:
    """``link.py _bulk recv HOST PORT`` / ``_bulk send HOST PORT NBYTES`` (inside a namespace)."""
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


# -- one launch of each contender ------------------------------------------------------------

def _child_env(extra: dict) -> dict:
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": REPO + (os.pathsep + path if path else ""), "PYTHONUNBUFFERED": "1",
            **extra}


def run_ours(link: Link, cfg: dict, tag: str) -> dict:
    from tracker import env as tracker_env
    from tracker.security import new_secret
    work = cfg["work"]
    out = os.path.join(work, f"{tag}.json")
    stats_dir = os.path.join(work, f"{tag}-servers")
    os.makedirs(stats_dir, exist_ok=True)
    port = random.randint(20000, 60000)   # a fresh namespace: nothing else listens there
    shared = {"KVSTORE_SECRET": new_secret(),   # the environment, never argv
              "KVSTORE_TRANSPORT": "tcp", "KVSTORE_SECURE": "0", "KVSTORE_LOG_LEVEL": "WARNING",
              "BENCH_SERVER_STATS": stats_dir}

    def env(role, rank, side):
        return _child_env(tracker_env.for_process(
            role=role, rank=rank, scheduler_host=link.addr["A"], scheduler_port=port,
            num_workers=2, num_servers=2, node_host=link.addr[side], extra=shared))
    worker = [sys.executable, OURS_WORKER, "--task", "sync", "--model", cfg["model"],
              "--modes", ",".join(OURS_MODES), "--iters", str(cfg["iters"]),
              "--warmup", str(cfg["warmup"]), "--latency-iters", "0", "--out", out]
    procs = [("scheduler", link.exec_argv("A", [sys.executable, "-m", "tracker.scheduler"]),
              env("scheduler", None, "A")),
             ("server 0", link.exec_argv("A", [sys.executable, SERVER]), env("server", 0, "A")),
             ("server 1", link.exec_argv("B", [sys.executable, SERVER]), env("server", 1, "B")),
             ("worker 0", link.exec_argv("A", worker), env("worker", 0, "A")),
             ("worker 1", link.exec_argv("B", worker), env("worker", 1, "B"))]
    try:
        run_group(procs, os.path.join(work, f"{tag}.log"), cfg["timeout"])
    except GroupFailed as e:
        raise Failed(f"ours ({tag}): {e}") from None
    res = _read_json(out, f"ours ({tag})")
    kinds, urls = res.get("transports"), res.get("server_urls") or []
    if kinds is not None and set(kinds) != {"tcp"}:
        raise Failed(f"ours ({tag}): the client used {kinds}, not tcp")
    want = [f"tcp://{link.addr['A']}:", f"tcp://{link.addr['B']}:"]
    if len(urls) != 2 or not all(u.startswith(w) for u, w in zip(urls, want)):
        raise Failed(f"ours ({tag}): servers at {urls}; expected server 0 on {link.addr['A']} "
                     f"and server 1 on {link.addr['B']} (tcp)")
    res["servers_usage"] = {f[:-5]: _read_json(os.path.join(stats_dir, f), "server stats")
                            for f in sorted(os.listdir(stats_dir)) if f.endswith(".json")}
    return res


def run_gloo(link: Link, cfg: dict, tag: str) -> dict:
    work = cfg["work"]
    out = os.path.join(work, f"{tag}.json")
    init = f"tcp://{link.addr['A']}:{random.randint(20000, 60000)}"
    argv = [sys.executable, GLOO_WORKER, "--model", cfg["model"], "--modes",
            ",".join(cfg["gloo_modes"]), "--iters", str(cfg["iters"]), "--warmup",
            str(cfg["warmup"]), "--latency-iters", "0", "--out", out]
    procs = [(f"gloo rank {r}", link.exec_argv(side, argv),
              _child_env({"RANK": str(r), "WORLD_SIZE": "2", "BENCH_INIT_METHOD": init,
                          "MASTER_ADDR": link.addr["A"],
                          # gloo's own address: the veth of this "machine", not the host name's
                          "GLOO_SOCKET_IFNAME": link.dev[side]}))
             for r, side in enumerate("AB")]
    try:
        run_group(procs, os.path.join(work, f"{tag}.log"), cfg["timeout"])
    except GroupFailed as e:
        raise Failed(f"gloo ({tag}): {e}") from None
    return _read_json(out, f"gloo ({tag})")


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise Failed(f"{what} finished but wrote no result ({path}): {e}") from None


# -- the model and the report ----------------------------------------------------------------

def model_ms(mode: str, nbytes: int, bytes_per_s: float, n: int = 2) -> float:
    """Wire time per exchange, docs/performance.md section 6, N machines, one worker each,
    servers co-located: 2*(N-1)/N * M/B; a compressed push shrinks its half of the traffic."""
    push = PUSH_FRACTION[mode] * nbytes
    return 1e3 * (n - 1) / n * (push + nbytes) / bytes_per_s


def expected_link_bytes(contender: str, modes, exchanges: int, nbytes: int) -> dict:
    """Payload bytes that should cross the link in each direction during one launch:
    every exchange, warm-up included; for ours, A->B also carries rank 0's init of the
    remote server's half (kv.init: rank 0's values win)."""
    total = sum(exchanges * (PUSH_FRACTION[m] * nbytes / 2 + nbytes / 2) for m in modes)
    return {"a_to_b": total + (nbytes / 2 if contender == "ours" else 0), "b_to_a": total}


def summarise(rows, rates_info, nbytes) -> dict:
    out = {}
    for rate, info in rates_info.items():
        b_nominal = info["qdisc"]["bits_per_s"] / 8
        raw = info.get("raw") or {}
        gbits = [raw.get("a_to_b_gbit"), raw.get("b_to_a_gbit")]
        b_raw = (sum(gbits) / 2 * 1e9 / 8) if all(gbits) else None
        groups = {}
        for r in rows:
            if r["rate"] == rate:
                groups.setdefault((r["contender"], r["mode"]), []).append(r)
        entries = []
        for (contender, mode), rs in groups.items():
            samples = [s for r in rs for s in r["samples"]]
            st = common.stats(samples)
            launch_medians = [common.stats(r["samples"])["median"] for r in rs]
            e = {"contender": contender, "mode": mode, "variant": VARIANTS[(contender, mode)],
                 **{k: (v * 1e3 if k != "n" else v) for k, v in st.items()},
                 "launch_medians_ms": [m * 1e3 for m in launch_medians],
                 "model_ms": model_ms(mode, nbytes, b_nominal),
                 "model_at_raw_ms": model_ms(mode, nbytes, b_raw) if b_raw else None,
                 "worker_cpu_s": _mean([r.get("cpu_s") for r in rs]),
                 "bytes_sent": _mean([r.get("bytes_sent") for r in rs]),
                 "bytes_received": _mean([r.get("bytes_received") for r in rs])}
            e["measured_over_model"] = e["median"] / e["model_ms"]
            if e["model_at_raw_ms"]:
                e["measured_over_model_at_raw"] = e["median"] / e["model_at_raw_ms"]
            entries.append(e)
        gloo = next((e for e in entries if (e["contender"], e["mode"]) == ("gloo", "flat")), None)
        for e in entries:
            e["vs_gloo_flat"] = e["median"] / gloo["median"] if gloo else None
        order = list(VARIANTS)
        entries.sort(key=lambda e: order.index((e["contender"], e["mode"])))
        out[rate] = entries
    return out


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _f(x, fmt="{:.1f}", none=""):
    return none if x is None else fmt.format(x)


def markdown(data: dict) -> str:
    m = data["machine"]
    cfg = data["config"]
    mb = data["nbytes"] / 1e6
    lines = [
        "# Gradient exchange over an emulated link (`python -m benchmarks.link`)",
        "",
        f"Run {data['started']} .. {data['finished']}, command: `{data['command']}`.",
        f"Machine: {m.get('cpu_model', m.get('processor'))}, {m['cpus']} cores (shared by both "
        f"\"machines\" and by other work), {m.get('mem_total', '?')}, {m['platform']}; "
        f"load average {data['load_start']:.2f} at the start, "
        f"{min(data['loads']):.2f}-{max(data['loads']):.2f} before the launches, "
        f"{data['load_end']:.2f} at the end.",
        "Versions: " + "; ".join(f"{k}: {v}" for k, v in data["versions"].items()) + ".",
        "",
        f"Workload: {cfg['model']} parameter set, {data['tensors']} fp32 tensors, M = {mb:.1f} MB "
        f"per worker; W = 2 workers, one per \"machine\" (network namespace), N = 2; ours with "
        f"S = 2 servers, one per machine, KVSTORE_TRANSPORT=tcp; gloo ranks 0 and 1 the same "
        f"way. Link: a veth pair with a tc tbf rate limit on both ends (MTU 1500). "
        f"{cfg['launches']} interleaved launches per contender and rate, {cfg['iters']} timed "
        f"exchanges each after {cfg['warmup']} warm-up; every result verified.",
        "",
        "Model (docs/performance.md section 6): wire time per exchange = 2*(N-1)/N * M/B = M/B "
        "at N=2 (each direction carries a worker's push of the remote half and its server's "
        "reply to the remote worker: the same bytes as a ring all-reduce); with a compressed "
        "push: (M_push/2 + M/2)/B, M_push = M/16 (2bit) or M/2 (fp16). B = the tbf rate "
        "(nominal); the 'at raw TCP rate' column uses the TCP payload rate measured between "
        "the namespaces with both directions busy (which excludes TCP/IP/Ethernet headers, "
        "~4.4 % at MTU 1500).",
        "",
    ]
    for rate, entries in data["summary"].items():
        info = data["rates"][rate]
        raw = info.get("raw") or {}
        lines += [f"## {rate}",
                  "",
                  f"tc: `{info['qdisc']['tc']}` on both veth ends. Raw TCP bulk transfer, both "
                  f"directions at once ({raw.get('bytes_each_way', 0) / 1e6:.0f} MB each): "
                  f"A->B **{_f(raw.get('a_to_b_gbit'), '{:.3f}')}** Gbit/s, B->A "
                  f"**{_f(raw.get('b_to_a_gbit'), '{:.3f}')}** Gbit/s "
                  f"(nominal {info['qdisc']['bits_per_s'] / 1e9:g})."
                  + (f" **Warning: {info['warning']}**" if info.get("warning") else ""),
                  "",
                  "| contender | variant | median ms | p10-p90 ms | launch medians ms | model ms "
                  "| measured/model | model at raw TCP rate ms | measured/that | vs gloo flat "
                  "| worker MB sent/recv per exchange | worker CPU s/exchange | n |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for e in entries:
            sent = (f"{e['bytes_sent'] / 1e6:.1f} / {e['bytes_received'] / 1e6:.1f}"
                    if e.get("bytes_sent") is not None else "")
            lines.append(
                f"| {e['contender']} | {e['variant']} | **{e['median']:.1f}** | "
                f"{e['p10']:.1f}-{e['p90']:.1f} | "
                f"{min(e['launch_medians_ms']):.1f}-{max(e['launch_medians_ms']):.1f} | "
                f"{e['model_ms']:.1f} | {e['measured_over_model']:.2f} | "
                f"{_f(e['model_at_raw_ms'])} | {_f(e.get('measured_over_model_at_raw'), '{:.2f}')} | "
                f"{_f(e['vs_gloo_flat'], '{:.2f}x')} | {sent} | "
                f"{_f(e['worker_cpu_s'], '{:.3f}')} | {e['n']} |")
        lines += ["", _reading(entries), ""]
    lines += ["## Bytes on the link per launch",
              "",
              "Counted by the veth ends (`ip -s link` tx bytes: packets as the device sees them; "
              "with TSO/GSO one set of headers per segment of up to 64 KB, so ~payload), every "
              "exchange of the launch (warm-up too) plus set-up and barriers; 'model' is the "
              "payload the model says must cross in that direction (ours A->B: + rank 0's init "
              "of the remote half).",
              "",
              "| rate | launch | contender | A->B MB | model MB | ratio | B->A MB | model MB | ratio "
              "| launch s | servers' CPU s | load before |",
              "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for L in data["launches"]:
        c = L.get("link_bytes") or {}
        cells = []
        for d in ("a_to_b", "b_to_a"):
            got, want = c.get(d), L["model_link_bytes"][d]
            cells += [_f(got and got / 1e6), f"{want / 1e6:.1f}", _f(got and got / want, "{:.3f}")]
        servers = L.get("servers_usage") or {}
        cpu = sum(u.get("cpu_s", 0) for u in servers.values()) if servers else None
        lines.append(f"| {L['rate']} | {L['launch'] + 1} | {L['contender']} | "
                     + " | ".join(cells) + f" | {L['seconds']:.1f} | {_f(cpu)} | "
                     f"{L['load_before']:.2f} |")
    if data["failures"]:
        lines += ["", "## Failures", ""] + [f"- {f}" for f in data["failures"]]
    return "\n".join(lines) + "\n"


def _reading(entries) -> str:
    """One computed sentence per rate: ours vs gloo, and what compression bought vs the model."""
    by = {(e["contender"], e["mode"]): e for e in entries}
    gloo, ours = by.get(("gloo", "flat")), by.get(("ours", "pushpull"))
    parts = []
    if gloo and ours:
        parts.append(f"Uncompressed, ours/gloo flat = {ours['median'] / gloo['median']:.2f}; "
                     f"measured/model at the raw TCP rate: gloo "
                     f"{_f(gloo.get('measured_over_model_at_raw'), '{:.2f}')}, ours "
                     f"{_f(ours.get('measured_over_model_at_raw'), '{:.2f}')}.")
    if ours:
        for mode, name in (("pushpull_2bit", "2bit"), ("pushpull_fp16", "fp16")):
            e = by.get(("ours", mode))
            if e:
                got = 1 - e["median"] / ours["median"]
                want = 1 - e["model_ms"] / ours["model_ms"]
                parts.append(f"{name}: {abs(got) * 100:.0f} % {'faster' if got >= 0 else 'slower'} "
                             f"than ours uncompressed (the wire model: {want * 100:.0f} % faster).")
    return "Reading: " + " ".join(parts) if parts else ""


def _versions() -> dict:
    v = {"python": platform.python_version(), "kernel": platform.release()}
    try:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "kvstore", "tracker"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        v["ours"] = f"kvstore {commit or '?'}{' + uncommitted changes' if dirty else ''}"
    except (OSError, subprocess.SubprocessError):
        v["ours"] = "kvstore ?"
    try:
        import zmq
        v["pyzmq"] = f"pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()})"
    except ImportError:
        pass
    import numpy
    v["numpy"] = numpy.__version__
    try:
        import torch
        v["gloo"] = f"torch {torch.__version__}"
    except ImportError:
        pass
    try:
        v["iproute2"] = subprocess.run(["ip", "-V"], capture_output=True, text=True,
                                       timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return v


def _gloo_available() -> str | None:
    try:
        import torch.distributed as dist
    except ImportError as e:
        return f"torch is not installed ({e})"
    if not dist.is_available() or not dist.is_gloo_available():
        return "this torch build has no gloo backend"
    return None


def _on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--rates", default="1gbit,4gbit", show_default=True,
              help="Link rates to emulate (tc units, comma-separated).")
@click.option("--model", type=click.Choice(["resnet50", "tiny"]), default="resnet50",
              show_default=True, help="Parameter set (tiny: for tests).")
@click.option("--iters", type=click.IntRange(min=1), default=10, show_default=True,
              help="Timed exchanges per launch and variant.")
@click.option("--warmup", type=click.IntRange(min=0), default=3, show_default=True,
              help="Untimed exchanges before them.")
@click.option("--launches", type=click.IntRange(min=1), default=2, show_default=True,
              help="Launches of each contender per rate, interleaved (the order alternates).")
@click.option("--gloo-modes", default=",".join(GLOO_MODES), show_default=True,
              help="gloo variants: flat and/or buckets.")
@click.option("--check-seconds", type=click.FloatRange(min=0.01), default=None,
              help="Duration of the raw TCP check per direction at the nominal rate "
                   "[default: 1.0, tiny: 0.1].")
@click.option("--out-dir", type=click.Path(file_okay=False), default=DEFAULT_OUT,
              show_default=True, help="Where link.md and link.json go.")
@click.option("--timeout", type=click.FloatRange(min=1), default=600, show_default=True,
              help="Seconds one launch may take before it is stopped and the run fails.")
def main(rates, model, iters, warmup, launches, gloo_modes, check_seconds, out_dir, timeout):
    """Time the gradient exchange of ResNet-50 between two emulated machines (network
    namespaces joined by a rate-limited veth pair): gloo against ours over tcp,
    uncompressed and compressed, against the wire time the step-time model predicts."""
    rate_list = [r.strip().lower() for r in rates.split(",") if r.strip()]
    try:
        for r in rate_list:
            parse_rate(r)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--rates")
    if not rate_list:
        raise click.BadParameter("no rate given", param_hint="--rates")
    gmodes = tuple(m.strip() for m in gloo_modes.split(",") if m.strip())
    bad = [m for m in gmodes if m not in GLOO_MODES]
    if bad or "flat" not in gmodes:
        raise click.BadParameter(f"choose from {', '.join(GLOO_MODES)} (flat is required)",
                                 param_hint="--gloo-modes")
    if check_seconds is None:
        check_seconds = 0.1 if model == "tiny" else 1.0
    shapes = model_shapes(model)
    nbytes = 4 * sum(math.prod(s) for s in shapes)
    signal.signal(signal.SIGTERM, _on_sigterm)
    link = Link()
    work = tempfile.mkdtemp(prefix="kvlink-")
    cfg = {"model": model, "iters": iters, "warmup": warmup, "launches": launches,
           "gloo_modes": gmodes, "timeout": timeout, "work": work}
    data = {"command": " ".join(["python -m benchmarks.link", *sys.argv[1:]]),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "load_start": os.getloadavg()[0],
            "machine": common.machine(), "versions": _versions(), "nbytes": nbytes,
            "tensors": len(shapes), "namespaces": list(link.ns.values()),
            "addresses": dict(link.addr), "devices": dict(link.dev),
            "config": {k: v for k, v in cfg.items() if k != "work"} | {"rates": rate_list,
                                                                      "check_seconds": check_seconds},
            "rates": {}, "launches": [], "rows": [], "failures": [], "skipped": {}}
    gloo_why = _gloo_available()
    if gloo_why:
        data["skipped"]["gloo"] = gloo_why
        click.echo(f"skipped: gloo: {gloo_why}", err=True)
    interrupted = False
    try:
        try:
            link.up()
        except SetupFailed as e:
            click.echo(f"skipped: the emulated network cannot be set up here (needs root and "
                       f"network namespaces): {e}")
            return
        click.echo(f"link: namespaces {link.ns['A']} ({link.addr['A']}, {link.dev['A']}) <-> "
                   f"{link.ns['B']} ({link.addr['B']}, {link.dev['B']}); work dir {work}", err=True)
        contenders = ["gloo", "ours"] if not gloo_why else ["ours"]
        for rate in rate_list:
            info = {"qdisc": link.set_rate(rate)}
            data["rates"][rate] = info
            nbits = parse_rate(rate)
            check_bytes = max(4 << 20, int(nbits / 8 * check_seconds))
            try:
                info["raw"] = measure_raw(link, check_bytes, timeout=60 + 10 * check_seconds)
            except Failed as e:
                data["failures"].append(f"raw TCP check at {rate}: {e}")
                click.echo(f"  {rate}: raw TCP check FAILED: {e}", err=True)
                continue
            raw = info["raw"]
            low = min(raw["a_to_b_gbit"], raw["b_to_a_gbit"]) * 1e9
            if low < 0.85 * nbits:
                info["warning"] = (f"the raw TCP rate ({low / 1e9:.2f} Gbit/s) is below 85 % of "
                                   f"the nominal {nbits / 1e9:g} Gbit/s: this machine cannot "
                                   "drive the emulated link at full rate")
            click.echo(f"  {rate}: raw TCP both ways at once: A->B {raw['a_to_b_gbit']:.3f}, "
                       f"B->A {raw['b_to_a_gbit']:.3f} Gbit/s"
                       + (f" (warning: {info['warning']})" if info.get("warning") else ""),
                       err=True)
            for launch_no in range(launches):
                order = contenders if launch_no % 2 == 0 else contenders[::-1]
                for c in order:
                    tag = f"{c}-{rate}-{launch_no}"
                    load = os.getloadavg()[0]
                    before = link.counters()
                    t0 = time.monotonic()
                    try:
                        res = (run_gloo if c == "gloo" else run_ours)(link, cfg, tag)
                    except Failed as e:
                        data["failures"].append(f"{c} at {rate} (launch {launch_no + 1}): {e}")
                        click.echo(f"  {rate} launch {launch_no + 1} {c}: FAILED: {e}", err=True)
                        continue
                    after = link.counters()
                    modes = OURS_MODES if c == "ours" else gmodes
                    counted = {k: (after[k] - before[k]) if None not in (after[k], before[k])
                               else None for k in after}
                    data["launches"].append({
                        "rate": rate, "launch": launch_no, "contender": c, "load_before": load,
                        "seconds": time.monotonic() - t0, "link_bytes": counted,
                        "model_link_bytes": expected_link_bytes(c, modes, iters + warmup, nbytes),
                        "worker_usage_total": res.get("usage_total"),
                        "servers_usage": res.get("servers_usage"),
                        "transports": res.get("transports"), "server_urls": res.get("server_urls"),
                        "torch_threads": res.get("torch_threads")})
                    for mode in modes:
                        d = res["modes"][mode]
                        data["rows"].append({
                            "rate": rate, "contender": c, "mode": mode, "launch": launch_no,
                            "samples": d["times"], "unit": "s", "cpu_s": d.get("cpu_s"),
                            "minor_faults": d.get("minor_faults"),
                            "bytes_sent": d.get("bytes_sent"),
                            "bytes_received": d.get("bytes_received"), "load_before": load})
                    click.echo(f"  {rate} launch {launch_no + 1}/{launches} {c}: "
                               f"{time.monotonic() - t0:.1f}s (load average before: {load:.2f})",
                               err=True)
    except KeyboardInterrupt:
        interrupted = True
        data["failures"].append("interrupted")
        click.echo("interrupted: cleaning up", err=True)
    finally:
        errors = link.down()
        for e in errors:
            click.echo(f"cleanup: {e}", err=True)
        data["failures"] += [f"cleanup: {e}" for e in errors]
    if interrupted:   # leave the results of an earlier, complete run in place
        click.echo("interrupted: no results written", err=True)
        sys.exit(130)
    data["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    data["load_end"] = os.getloadavg()[0]
    data["loads"] = [L["load_before"] for L in data["launches"]] or [data["load_start"]]
    data["summary"] = summarise(data["rows"], {r: i for r, i in data["rates"].items()
                                               if "raw" in i}, nbytes)
    table = markdown(data)
    os.makedirs(out_dir, exist_ok=True)
    common.write_json(os.path.join(out_dir, "link.json"), data)
    with open(os.path.join(out_dir, "link.md"), "w") as f:
        f.write(table)
    click.echo(table)
    click.echo(f"md: {os.path.relpath(os.path.join(out_dir, 'link.md'))}")
    click.echo(f"json: {os.path.relpath(os.path.join(out_dir, 'link.json'))}")
    if data["failures"]:
        click.echo("\nFAILED:\n" + "\n".join(data["failures"]), err=True)
        sys.exit(1)
    click.echo(f"(logs in {work})", err=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_bulk":
        sys.exit(_bulk_main(sys.argv[2:]))
    main()
