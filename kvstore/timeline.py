"""A timeline users can open: with ``KVSTORE_TIMELINE=DIR`` every worker and server
writes a Chrome trace-event file, ``DIR/worker-R.json`` and ``DIR/server-R.json``,
which Perfetto (https://ui.perfetto.dev) and ``chrome://tracing`` open; ``python -m
kvstore.tools.timeline DIR`` merges them into ``DIR/timeline.json`` and summarises
them (docs/training.md, "Timeline").

What each process records (``cat`` and ``name`` of the events; ``ph`` "X" spans,
"i" instants, "M" names of processes and lanes):

- worker, one lane per thread that calls the store: ``worker`` ``send OP`` (from the
  call to its last request handed to a link: grouping, staging copies, compression),
  ``wait OP`` (blocked for replies), ``copy out OP``; ``OP`` alone for a call without
  those phases (``push``, ``init``). ``trainer`` (:class:`kvstore.torch.Trainer`):
  ``first gradient``, ``bucket ready`` (args ``keys``/``bytes``) and ``backward
  ended`` (instants: a request before it overlapped the backward),
  ``step``, ``wait for exchanges``, ``optimizer step``.
- worker, lanes "calls": ``call`` ``OP`` from the call to its outputs filled (for
  ``pushpull_async``: to the end of ``wait()``), args ``keys``.
- worker, lanes "to server S": ``request`` ``queued`` (the call's start to this
  message's send) and ``OP`` (sent to its reply taken in), args ``server``, ``id``,
  ``chunks`` (``[key, index]`` pairs), ``bytes``.
- server: ``server`` ``OP`` per request (taken from the sequencer to handled and its
  replies sent: a push's sum, and the update when it completes a round), args
  ``worker``, ``id``, ``chunks``, ``replies``; ``round complete`` (instant) when it
  completed a round; ``reply`` ``reply`` per reply sent, args ``worker``, ``id``, ``bytes``.

Clock: microseconds since the Unix epoch: ``time.perf_counter_ns()`` (monotonic,
cheap) plus this process's offset to ``time.time_ns()`` taken once when the file is
opened, so every process of one host is on the host's wall clock (to a few
microseconds); across hosts, to the hosts' clock synchronisation (NTP: about a
millisecond).

Cost: events are tuples appended to a list; they are encoded and written every
:data:`FLUSH_EVENTS` events (a few hundred milliseconds, bounded memory), when a
server has been idle for :data:`IDLE_FLUSH_S`, and at close. With the variable unset
there is no :class:`Timeline`: each hook is one ``is not None`` check
(docs/performance.md, "The timeline's cost").
"""

from __future__ import annotations

import json
import os
import threading
import time

from .errors import ConfigError

FLUSH_EVENTS = 50_000     # events kept in memory before they are written out
IDLE_FLUSH_S = 2.0        # a server idle this long writes what it holds
LANES = 64                # overlapping spans of one group spread over at most this many lanes
SERVER_LOOP = 1           # the server's lane (its single I/O thread)
THREADS, CALLS, REQUESTS = 1, 100, 1000   # first lane id of each group (worker)


class Call:
    """One store call being traced (:meth:`Timeline.begin`): its phases, in order
    (each optional), are :meth:`sent`, :meth:`waiting`, :meth:`copying`, :meth:`done`."""
    __slots__ = ("copy_start", "keys", "op", "sent_at", "start", "timeline", "wait_start")

    def __init__(self, timeline: Timeline, op: str, keys: list):
        self.timeline, self.op, self.keys = timeline, op, keys
        self.start = timeline.call_start = time.perf_counter_ns()
        self.sent_at = self.wait_start = self.copy_start = 0

    def sent(self) -> None:
        """Every request of the call is on its way."""
        self.sent_at = self.timeline.span("worker", f"send {self.op}", self.start)
        self.timeline.call_start = None

    def waiting(self) -> None:
        self.wait_start = time.perf_counter_ns()

    def copying(self) -> None:
        """The replies are in; the outputs are filled next."""
        self.copy_start = self.timeline.span("worker", f"wait {self.op}", self.wait_start)

    def done(self) -> None:
        tl, end = self.timeline, time.perf_counter_ns()
        if self.copy_start:
            tl.span("worker", f"copy out {self.op}", self.copy_start, end)
        elif not self.sent_at:
            tl.span("worker", self.op, self.start, end)
        tl.call_start = None
        tl.span("call", self.op, self.start, end, {"keys": self.keys},
                tl.lane("calls", CALLS, "calls", self.start, end))


class Timeline:
    """The trace of one process, written to ``DIRECTORY/ROLE-RANK.json``. A worker's
    is its store's :attr:`~kvstore.KVStoreBase.timeline`, where integrations add
    their events with :meth:`now`, :meth:`span` and :meth:`instant`.

    Example::

        tl = Timeline("/tmp/trace", "worker", 0)
        start = tl.now()
        ...
        tl.span("trainer", "step", start)
        tl.close()
    """

    now = staticmethod(time.perf_counter_ns)   # the timestamps every method takes

    def __init__(self, directory: str, role: str, rank: int, flush_events: int = FLUSH_EVENTS):
        self.path = os.path.join(directory, f"{role}-{rank}.json")
        try:
            os.makedirs(directory, exist_ok=True)
            self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 (open until close())
        except OSError as e:
            raise ConfigError(f"KVSTORE_TIMELINE={directory}: cannot write {self.path}: {e}") from None
        self.role, self.rank = role, rank
        self._pid = os.getpid()
        self._offset = time.time_ns() - time.perf_counter_ns()
        self._events: list[tuple] = []
        self._flush_events = flush_events
        self._last_flush = time.monotonic()
        self._names: list[tuple] = [("process_name", 0, {"name": f"{role} {rank}"}),
                                    ("process_sort_index", 0, {"sort_index": (role != "worker") * 1000 + rank})]
        self._threads: dict[int, int] = {}       # thread ident -> lane
        self._lanes: dict[object, list] = {}      # group -> the end of each lane's last span
        self._requests: dict[int, tuple] = {}     # worker: request id -> (sent, server, op, chunks, bytes, queued from)
        self._peers: dict[bytes, object] = {}     # server: peer identity -> worker rank
        self.call_start: int | None = None        # worker: the start of the call now sending
        self._closed = False
        self._file.write('{"traceEvents":[\n')
        if role == "server":
            self._name_lane(SERVER_LOOP, "requests", 0)

    # -- recording --------------------------------------------------------------------
    def span(self, cat: str, name: str, start: int, end: int | None = None, args: dict | None = None,
             tid: int | None = None) -> int:
        """An "X" event from ``start`` to ``end`` (now when None) on ``tid`` (the
        calling thread's lane when None); returns ``end``."""
        end = time.perf_counter_ns() if end is None else end
        self._add(("X", cat, name, self._thread() if tid is None else tid, start, end - start, args))
        return end

    def instant(self, cat: str, name: str, args: dict | None = None, tid: int | None = None) -> None:
        """An "i" event (a moment) now, on ``tid`` (the calling thread's lane when None)."""
        self._add(("i", cat, name, self._thread() if tid is None else tid, time.perf_counter_ns(), 0, args))

    def _add(self, event: tuple) -> None:
        self._events.append(event)
        if len(self._events) >= self._flush_events:
            self.flush()

    def _thread(self) -> int:
        ident = threading.get_ident()
        tid = self._threads.get(ident)
        if tid is None:
            tid = self._threads[ident] = THREADS + len(self._threads)
            self._name_lane(tid, f"thread {threading.current_thread().name}", tid)
        return tid

    def lane(self, group: object, base: int, label: str, start: int, end: int) -> int:
        """A lane of ``group`` free at ``start`` (spans are recorded in the order they
        end, so a lane whose last span ended by ``start`` takes this one)."""
        ends = self._lanes.setdefault(group, [])
        for i, last in enumerate(ends):
            if last <= start:
                ends[i] = end
                return base + i
        if len(ends) < LANES:
            ends.append(end)
            self._name_lane(base + len(ends) - 1, label if len(ends) == 1 else f"{label} ({len(ends)})",
                            base + len(ends) - 1)
            return base + len(ends) - 1
        i = min(range(len(ends)), key=ends.__getitem__)    # all busy: they overlap there
        ends[i] = max(ends[i], end)
        return base + i

    def _name_lane(self, tid: int, name: str, order: int) -> None:
        self._names.append(("thread_name", tid, {"name": name}))
        self._names.append(("thread_sort_index", tid, {"sort_index": order}))

    # -- a worker's store calls (kvstore.worker.dist) and requests (kvstore.worker.client) ---------------
    def begin(self, op: str, keys: list) -> Call:
        """A store call starts: the requests sent until its ``sent()`` or ``done()`` belong to it."""
        return Call(self, op, keys)

    def request(self, req_id: int, server: int, op: str, chunks, nbytes: int) -> None:
        """A request was handed to ``server``'s link."""
        self._requests[req_id] = (time.perf_counter_ns(), server, op, chunks, nbytes, self.call_start)

    def reply(self, req_id: int, error: bool) -> None:
        """The reply to ``req_id`` was taken in."""
        sent = self._requests.pop(req_id, None)
        if sent is None:
            return
        end = time.perf_counter_ns()
        at, server, op, chunks, nbytes, queued = sent
        start = at if queued is None or queued >= at else queued
        tid = self.lane(server, REQUESTS + LANES * server, f"to server {server}", start, end)
        if start < at:
            self._add(("X", "request", "queued", tid, start, at - start, None))
        args = {"server": server, "id": req_id, "bytes": nbytes}
        if chunks:
            args["chunks"] = chunks
        if error:
            args["error"] = True
        self._add(("X", "request", op, tid, at, end - at, args))

    # -- a server's requests (kvstore.server.node) ------------------------------------------
    def served(self, start: int, peer: bytes, header: dict, replies) -> None:
        """A request taken at ``start`` is handled (``replies``: the state machine's,
        or None when the node answered it itself)."""
        end = time.perf_counter_ns()
        worker = header.get("src")
        self._peers[peer] = worker
        args = {"worker": worker, "id": header.get("id")}
        chunks = header.get("chunks")
        if chunks:
            args["chunks"] = chunks
        if replies is not None:
            args["replies"] = len(replies)
            if any(r.header.get("id") != args["id"] or r.peer != peer for r in replies):
                self._add(("i", "server", "round complete", SERVER_LOOP, end, 0,
                           {"chunks": chunks} if chunks else None))
        self._add(("X", "server", str(header.get("op")), SERVER_LOOP, start, end - start, args))

    def replied(self, start: int, peer: bytes, header: dict, arrays) -> None:
        nbytes = sum(getattr(a, "nbytes", None) or memoryview(a).nbytes for a in arrays)
        self.span("reply", "reply", start, None,
                  {"worker": self._peers.get(peer), "id": header.get("id"), "bytes": nbytes}, SERVER_LOOP)

    def idle(self) -> None:
        """Called by a server with nothing to do: write what it holds now and then."""
        if self._events and time.monotonic() - self._last_flush > IDLE_FLUSH_S:
            self.flush()

    # -- writing -----------------------------------------------------------------------
    def flush(self) -> None:
        """Encode and write the events held so far."""
        events, self._events = self._events, []
        names, self._names = self._names, []
        self._last_flush = time.monotonic()
        if self._closed:
            return
        pid, offset = self._pid, self._offset
        lines = [json.dumps({"ph": "M", "name": name, "pid": pid, "tid": tid, "args": args})
                 for name, tid, args in names]
        for ph, cat, name, tid, start, dur, args in events:
            event = {"ph": ph, "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": (start + offset) / 1e3}
            if ph == "X":
                event["dur"] = dur / 1e3
            else:
                event["s"] = "t"
            if args:
                event["args"] = args
            lines.append(json.dumps(event, default=_jsonable))
        if lines:
            self._file.write(",\n".join(lines) + ",\n")
            self._file.flush()

    def close(self, other: dict | None = None) -> None:
        """Write everything and end the file; ``other`` goes to its ``otherData``
        (e.g. a worker's bytes by transport). Later events are dropped."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        other = {"role": self.role, "rank": self.rank, "pid": self._pid, "clock": "unix_us",
                 **(other or {})}
        end = {"ph": "M", "name": "trace_end", "pid": self._pid, "tid": 0, "args": {}}
        try:
            self._file.write(json.dumps(end) + '\n],"displayTimeUnit":"ms","otherData":'
                             + json.dumps(other, default=_jsonable) + "}\n")
        finally:
            self._file.close()


def open_timeline(directory: str | None, role: str, rank: int) -> Timeline | None:
    """The process's :class:`Timeline` when ``KVSTORE_TIMELINE`` (``directory``) is
    set, else None. Raises ConfigError when the file cannot be written."""
    return None if not directory else Timeline(directory, role, rank)


def _jsonable(value):
    item = getattr(value, "item", None)      # numpy scalars
    if callable(item):
        return item()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    return str(value)
