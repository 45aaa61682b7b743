"""How large a worker's pipelined messages to its network links are
(``KVSTORE_PIPELINE_BYTES=auto``, the default): chosen from the rate the worker's
link has been seen to carry.

dist.py cuts each server's share of a call into messages and sends them round-robin
over the servers; a server answers a message once every worker's copy of it has
arrived. Two costs pull the size ``p`` in opposite directions:

- filling and draining the pipeline: no reply can start before each server has a
  whole message from every worker, and the last replies travel after the last push.
  With W workers and S servers that costs about ``max(W, S) * p / B`` per call (B
  the link rate; one round of messages: benchmarks/model/link.py), whatever the call's size: 8 MiB messages at 500 Mbit/s keep one
  direction of every link idle for ~1 s of a 2.5 s ResNet-50 exchange
  (docs/performance.md 2.6);
- every message costs the worker and the server some CPU (~0.3-0.7 ms here), which
  must stay small next to the message's transfer time ``p / B``.

Both scale with the link rate, so the size is a fixed time's worth of it:
``p = rate * PACE_SECONDS``, clamped to [MIN_BYTES, MAX_BYTES]. 10 ms makes the
per-message CPU a few per cent of the transfer; at 500 Mbit/s it gives ~0.5 MB
messages, on a 10 Gbit/s link or loopback TCP the 8 MiB maximum (where the CPU, not
the fill, limits). The rate is estimated from the calls themselves: bytes sent over
network links per second of a call that waited for its replies (a lower bound of the
link's rate: it includes the servers' time and other workers' lateness), the highest
of the last few calls so that one slow call does not shrink the messages. Until a
call has been timed, MAX_BYTES (the fixed default before this existed).
"""

from __future__ import annotations

import time
from collections import deque

PACE_SECONDS = 0.010      # a message is this much of the link's time
MIN_BYTES = 256 << 10     # below this the per-message CPU dominates on any link
MAX_BYTES = 8 << 20       # fast links: the CPU limits, fewer messages are cheaper
MIN_SAMPLE_BYTES = 4 << 20   # smaller calls measure latency, not the rate
SAMPLES = 8
WINDOW = 8                # messages in flight per server in a call that may wait (Flight)


class Pace:
    """The message size for a worker's network links (``links``: the client's list,
    one link per server; those whose ``pipeline_bytes`` is "auto" are paced).

    Example::

        pace = Pace(client.links)
        pace.limits()              # per server: MAX_BYTES until a call is timed
        flight = pace.start({0: (ids, parts)}, "pushpull of ...", client)
        for server, parts in messages:            # (kvstore.sharding.pieces)
            flight.admit(server)                  # may wait for earlier replies
            flight.sent(server, client.request(...)[0])
        ...                        # wait for every reply
        pace.done(flight)          # e.g. 102 MB in 2 s: 51 MB/s, 510 kB messages
    """

    def __init__(self, links: list):
        self._links = links
        self._rates: deque = deque(maxlen=SAMPLES)
        self.bytes = MAX_BYTES

    def limits(self) -> list[int]:
        """The message size per server: each link's own, or :attr:`bytes` if paced."""
        return [self.bytes if link.pipeline_bytes == "auto" else link.pipeline_bytes
                for link in self._links]

    def paced(self, server: int) -> bool:
        """Whether the link to ``server`` is paced (its ``pipeline_bytes`` is "auto")."""
        return self._links[server].pipeline_bytes == "auto"

    @property
    def rate(self) -> float | None:
        """Bytes per second: the highest of the recent calls' rates (None: none yet)."""
        return max(self._rates, default=None)

    def start(self, parts_by_server: dict, what: str, client=None) -> "Flight":
        """A call begins; ``parts_by_server``: {server: (ids, [arrays])}. With the
        ``client`` to wait on, the call keeps at most WINDOW messages in flight to each
        paced server."""
        return Flight(self, parts_by_server, what, client)

    def done(self, flight: "Flight") -> None:
        """The call that :meth:`start` began has every reply."""
        self.observe(flight.nbytes, time.monotonic() - flight.started)

    def observe(self, nbytes: int, seconds: float) -> None:
        """A call sent ``nbytes`` over paced links and had every reply ``seconds``
        after its first send."""
        if nbytes < MIN_SAMPLE_BYTES or seconds <= 0:
            return
        self._rates.append(nbytes / seconds)
        rate = max(self._rates)             # self.rate, which has a sample now
        self.bytes = int(min(MAX_BYTES, max(MIN_BYTES, rate * PACE_SECONDS)))


class Flight:
    """One call's requests to paced links: what it sends (for the rate) and, when it
    may wait (it has a client to wait on), a window of at most WINDOW messages per
    server in flight.

    Why a window: a server answers a message only once every worker's copy of it
    arrived, and the flows into one server are not fair (one worker's flow may run
    well ahead of another's). Without a window a worker queues its whole share at
    once; a lagging flow then holds back that server's replies while the others'
    data piles up, and the servers' replies bunch up at the end (the link timeline
    of benchmarks.link: ~0.4 s of a 2 s exchange with the workers' send direction
    idle). With it, a worker that is ahead on one server gives its link to the
    others until that server has answered. It cannot deadlock: every worker sends
    in the same order, so what a reply waits for was sent before anything waits on it.
    Calls whose sender must not block (pushes started from backward hooks) have no
    window.
    """

    def __init__(self, pace: Pace, parts_by_server: dict, what: str, client):
        self._paced = {server for server in parts_by_server if pace.paced(server)}
        self.nbytes = sum(part.nbytes for server in self._paced for part in parts_by_server[server][1])
        self.started = time.monotonic()
        self._window = WINDOW if client is not None else 0   # messages per server
        self._client, self._what = client, what
        self._ids: list = []         # every request of the call so far
        self._flying: dict = {}      # server -> its request ids in flight, oldest first

    def admit(self, server: int) -> None:
        """Before sending a message to ``server``: wait until it fits in the window.
        An error reply is left for the call's own wait; a deadline or an aborted job
        raises, and the call's requests so far are abandoned (client.abandon)."""
        flying = self._flying.get(server)
        try:
            while self._window and flying and len(flying) >= self._window:
                self._client.wait([flying.pop(0)], self._what, raising=False)
        except BaseException:
            self._client.abandon(self._ids)
            raise

    def sent(self, server: int, req_id: int) -> None:
        self._ids.append(req_id)
        if self._window and server in self._paced:
            self._flying.setdefault(server, []).append(req_id)
