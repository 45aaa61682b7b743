"""Layouts of benchmarks.link: which emulated host runs which process, and the
bytes every host's link must carry per exchange (the wire model of
docs/performance.md, "Dedicated server hosts").

- ``ring:W``: gloo all_reduce over W worker hosts (rank r on worker host r);
- ``colo:W``: co-located, W hosts each with a worker and a server (server r and
  worker r on worker host r; shared memory within a host, tcp between hosts);
- ``dedicated:WxS``: W worker hosts with a worker each, S server hosts with a
  server each (every byte crosses a link: tcp).

Worker hosts are named A, B, C, ... and server hosts S0, S1, ...; a layout's
scheduler runs on worker host A. With N the bytes of one worker's gradients and f
the fraction of them a push carries (2bit: 1/16, fp16: 1/2), per exchange:

  ring        every worker host sends and receives 2N(W-1)/W
  colo        every host sends and receives (f+1)N(W-1)/W: its worker's pushes to
              the W-1 remote servers, its server's replies to the W-1 remote workers
  dedicated   a worker host sends fN and receives N; a server host receives W*fN/S
              and sends W*N/S

and the wire bound of an exchange is the busiest link direction's bytes / the link
rate (full duplex: the two directions do not share it).
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass

KINDS = ("ring", "colo", "dedicated")
# the exchanges a layout runs, as the link experiments (benchmarks.link, benchmarks.model) name them
VARIANTS = {"flat": "one flat all_reduce", "buckets": "25 MB buckets (DDP)",
            "pushpull": "pushpull", "pushpull_2bit": "pushpull, 2bit compression",
            "pushpull_fp16": "pushpull, fp16 compression"}
# fraction of the gradient bytes one push carries on the wire (2bit: 4 values per byte)
PUSH_FRACTION = {"pushpull": 1.0, "pushpull_2bit": 1 / 16, "pushpull_fp16": 0.5,
                 "flat": 1.0, "buckets": 1.0}


def worker_host(rank: int) -> str:
    return string.ascii_uppercase[rank]


def server_host(rank: int) -> str:
    return f"S{rank}"


@dataclass(frozen=True)
class Layout:
    kind: str       # ring | colo | dedicated
    workers: int
    servers: int    # 0 for ring; = workers for colo

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.workers}" + (f"x{self.servers}" if self.kind == "dedicated" else "")

    @property
    def contender(self) -> str:
        return "gloo" if self.kind == "ring" else "ours"

    @property
    def worker_hosts(self) -> list[str]:
        return [worker_host(r) for r in range(self.workers)]

    @property
    def server_hosts(self) -> list[str]:
        if self.kind == "dedicated":
            return [server_host(r) for r in range(self.servers)]
        return self.worker_hosts[:self.servers]

    @property
    def hosts(self) -> list[str]:
        return list(dict.fromkeys(self.worker_hosts + self.server_hosts))

    def describe(self) -> str:
        if self.kind == "ring":
            return f"gloo ring, {self.workers} worker hosts"
        if self.kind == "colo":
            return f"co-located, {self.workers} hosts with a worker and a server each"
        return f"dedicated, {self.workers} worker hosts + {self.servers} server hosts"

    def link_bytes(self, mode: str, nbytes: float) -> dict:
        """{host: (bytes it sends, bytes it receives)} per exchange."""
        w, s, n = self.workers, self.servers, nbytes
        f = PUSH_FRACTION[mode]
        if self.kind == "ring":
            return {h: (2 * n * (w - 1) / w,) * 2 for h in self.hosts}
        if self.kind == "colo":
            return {h: ((f + 1) * n * (w - 1) / w,) * 2 for h in self.hosts}
        out = {h: (f * n, n) for h in self.worker_hosts}
        out.update({h: (w * n / s, w * f * n / s) for h in self.server_hosts})
        return out

    def init_bytes(self, nbytes: float) -> dict:
        """{host: (sent, received)} of ours' kv.init: worker 0 sends every value
        to the servers (the share of a server on its own host stays there)."""
        if self.kind == "ring":
            return {}
        remote = [h for h in self.server_hosts if h != self.worker_hosts[0]]
        out = {h: (0.0, nbytes / self.servers) for h in remote}
        out[self.worker_hosts[0]] = (nbytes * len(remote) / self.servers, 0.0)
        return out

    def bound_bytes(self, mode: str, nbytes: float) -> float:
        """Bytes on the busiest link direction per exchange."""
        return max(max(pair) for pair in self.link_bytes(mode, nbytes).values())

    def bound_ms(self, mode: str, nbytes: float, bytes_per_s: float) -> float:
        return 1e3 * self.bound_bytes(mode, nbytes) / bytes_per_s


def parse(text: str) -> Layout:
    """``ring:W``, ``colo:W`` or ``dedicated:WxS``; raises ValueError."""
    m = re.fullmatch(r"\s*(ring|colo|dedicated):(\d+)(?:x(\d+))?\s*", text)
    if not m or (m.group(1) == "dedicated") != (m.group(3) is not None):
        raise ValueError(f"{text!r} is not ring:W, colo:W or dedicated:WxS")
    kind, w = m.group(1), int(m.group(2))
    s = int(m.group(3)) if kind == "dedicated" else (w if kind == "colo" else 0)
    if not 2 <= w <= 26 or (kind == "dedicated" and not 1 <= s <= 32):
        raise ValueError(f"{text!r}: W must be 2..26 (and S 1..32)")
    return Layout(kind, w, s)


def parse_list(text: str) -> list[Layout]:
    layouts = [parse(t) for t in text.split(",") if t.strip()]
    if len({layout.key for layout in layouts}) != len(layouts):
        raise ValueError(f"{text!r} names a layout twice")
    return layouts


def hosts_for(layouts) -> list[str]:
    """Every host the layouts use, worker hosts first (A, B, ...), then S0, S1, ..."""
    w = max((layout.workers for layout in layouts), default=0)
    s = max((layout.servers for layout in layouts if layout.kind == "dedicated"), default=0)
    return [worker_host(r) for r in range(w)] + [server_host(r) for r in range(s)]
