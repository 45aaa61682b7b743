"""Where an exchange's time goes on the emulated links: how busy every host's link
is, direction by direction, every few milliseconds (benchmarks.link --timeline).

One sampler process runs in the cluster's switch namespace, where every host's link
ends in a port of the bridge: the port's rx bytes are what the host sent, its tx
bytes what the host received. It reads their counters (sysfs, which ``ip netns
exec`` mounts for the namespace) every ``interval`` seconds and appends them to a
file until its stdin closes:

    python benchmarks/link/timeline.py _sample OUT INTERVAL PORT...

:func:`render` turns the samples into a table of 100 ms windows for the last
exchange: each host's sent / received bytes as a percentage of the link rate.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

THIS = os.path.abspath(__file__)


def _sample_main(argv: list[str]) -> int:
    out, interval, ports = argv[0], float(argv[1]), argv[2:]
    files = [[open(f"/sys/class/net/{p}/statistics/{d}_bytes", "rb") for d in ("rx", "tx")]
             for p in ports]
    t0 = time.monotonic()
    ready = False
    with open(out, "w") as f:
        while not select.select([sys.stdin], [], [], 0 if not ready else interval)[0]:   # stdin closed: stop
            row = [round(time.monotonic() - t0, 4)]
            for pair in files:
                for fd in pair:
                    fd.seek(0)
                    row.append(int(fd.read()))
            f.write(json.dumps(row) + "\n")
            if not ready:     # the first sample is taken: the measured run may start
                ready = True
                sys.stdout.write("ready\n")
                sys.stdout.flush()
    return 0


class Sampler:
    """Samples every host link of ``cluster`` (a benchmarks.harness.netns.Cluster) into
    ``path`` while in a ``with`` block."""

    def __init__(self, cluster, path: str, interval: float = 0.02):
        self.cluster, self.path, self.interval = cluster, path, interval
        self.popen: subprocess.Popen[bytes] | None = None    # the sampler, in the with block

    def __enter__(self) -> "Sampler":
        ports = [self.cluster.port[h] for h in self.cluster.hosts]
        popen = self.popen = subprocess.Popen(
            ["ip", "netns", "exec", self.cluster.switch, sys.executable, THIS, "_sample",
             self.path, str(self.interval), *ports],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert popen.stdout is not None and popen.stderr is not None   # PIPE
        # wait for its first sample: started late (a loaded machine), it would miss the run
        ready, _, _ = select.select([popen.stdout], [], [], 30)
        if not ready or popen.stdout.readline().strip() != b"ready":
            popen.kill()
            popen.wait()
            raise RuntimeError(f"the link sampler did not start: {popen.stderr.read().decode()[-500:]}")
        return self

    def __exit__(self, *exc) -> None:
        popen = self.popen
        assert popen is not None, "__exit__ without __enter__"
        assert popen.stdin is not None and popen.stdout is not None and popen.stderr is not None   # PIPE
        popen.stdin.close()
        try:
            popen.wait(10)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()
        popen.stderr.close()
        popen.stdout.close()


def windows(path: str, hosts: list[str], bytes_per_s: float, width: float = 0.1) -> list:
    """[(t, {host: (sent %, received %)})] per ``width`` seconds window."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    out, last = [], None
    for row in rows:
        if last is None or row[0] - last[0] >= width:
            if last is not None:
                dt = row[0] - last[0]
                out.append((last[0], {h: tuple(100 * (row[1 + 2 * i + d] - last[1 + 2 * i + d])
                                               / dt / bytes_per_s for d in (0, 1))
                                      for i, h in enumerate(hosts)}))
            last = row
    return out


def render(path: str, hosts: list[str], shown: list[str], workers: list[str],
           bytes_per_s: float, most: int = 80) -> str:
    """The last exchange as a text table, 100 ms a row (at most ``most`` rows):
    each of the ``shown`` hosts' link use in % of the rate, sent/received. The
    last exchange starts where the ``workers`` (on average over them) began to
    send after a pause (the barrier between exchanges), or, where they never sent
    hard enough to tell, where the last stretch of traffic began; it ends with the
    last traffic."""
    rows = windows(path, hosts, bytes_per_s)
    busy = [max(max(v) for v in u.values()) > 5 for _, u in rows]
    # an exchange starts when the workers, together, go from silent to sending
    sending = [sum(u[h][0] for h in workers) / len(workers) > 30 for _, u in rows]
    end = max((i for i, b in enumerate(busy) if b), default=-1)
    if end < 0:
        return "(no traffic sampled)\n"
    start = max((i for i in range(end + 1) if sending[i] and (i == 0 or not sending[i - 1])),
                default=None)
    if start is None:
        # no window where the workers sent hard (a short exchange split over two windows,
        # or samples spaced out on a loaded machine): the last exchange is the busy
        # stretch that ends at ``end``, whose first windows hold the workers' sending
        start = end
        while start > 0 and busy[start - 1]:
            start -= 1
    start = max(start, end + 1 - most)
    lines = ["   t s  " + "  ".join(f"{h:>9}" for h in shown)]
    for t, u in rows[start:end + 1]:
        lines.append(f"{t - rows[start][0]:6.1f}  " + "  ".join(
            f"{u[h][0]:4.0f}/{u[h][1]:<4.0f}" for h in shown))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_sample":
        sys.exit(_sample_main(sys.argv[2:]))
    sys.exit(f"usage: {sys.argv[0]} _sample OUT INTERVAL PORT...")
