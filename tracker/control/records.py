"""The records :class:`~.scheduler_state.SchedulerState` keeps and returns:
a registered :class:`Node`, the workers' :class:`Barrier` (who waits, with what
payload, and how a barrier ends for all of them), a message to :class:`Send`; and
:func:`describe_exit` for the exit statuses launchers report, and
:func:`absent_at_barrier`, which reads back the absent workers a barrier's
timeout names. No I/O."""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field

from . import disagreement, wire
from .errors import RendezvousError


@dataclass(frozen=True)
class Send:
    """One control message to send: to ROUTER identity ``ident``, ``op`` and its fields."""
    ident: bytes
    op: str
    fields: dict = field(default_factory=dict)


@dataclass
class Node:
    """A registered worker or server."""
    node_id: str
    role: str
    rank: int | None
    host: str
    addr: str
    pid: int
    ident: bytes
    last_seen: float
    hb_ident: bytes | None = None
    finished: bool = False
    finished_at: float | None = None   # when a worker said `finish`
    removed: str | None = None   # why a worker was removed from an elastic job (not by `finish`)
    epoch: int = 0               # a server: the membership epoch it acknowledged
    last_request: int = 0        # the highest id of its requests handled (a copy sent again is dropped)

    @classmethod
    def registering(cls, msg: dict, role: str, rank: int | None, ident: bytes, now: float,
                    hb_idents: dict) -> "Node":
        """The node of a ``register`` request (RendezvousError if malformed)."""
        node_id, host, addr, pid = msg["node"], msg["host"], msg.get("addr", ""), msg["pid"]
        if not (isinstance(node_id, str) and isinstance(host, str) and isinstance(addr, str)
                and type(pid) is int):
            raise RendezvousError("register needs string 'node', 'host', 'addr' and an integer 'pid'")
        return cls(node_id, role, rank, host, addr, pid, ident, now, hb_ident=hb_idents.get(node_id))

    @property
    def ranked(self) -> int:
        """Its rank, which every node has once the job formed (a worker that joins a
        running job: once it took a rank); before that, one registered without a
        rank (registration order) has none."""
        assert self.rank is not None, f"{self.name()} has no rank yet"
        return self.rank

    def name(self) -> str:
        rank = "?" if self.rank is None else self.rank
        return f"{self.role} {rank} (pid {self.pid} on {self.host})"

    def removal(self) -> str:
        """What a removed worker hears (its heartbeats get it as ``abort``)."""
        return f"{self.role} {self.rank} was removed from the job: {self.removed}"


# A barrier may carry a payload from each waiter (an all-gather: the workers'
# Membership.allgather); ``barrier_done`` then hands every waiter all of them, so the
# scheduler holds one barrier's payloads and sends them once per waiter. Bounds:
GATHER_BYTES = 768 << 10       # the payloads of one barrier together: each barrier_done carries
                               # them all, within the control plane's frame (wire.MAX_BYTES, 1 MiB)
GATHER_SEND_BYTES = 64 << 20   # what one barrier's replies may queue in all (payloads x waiters)


def gather_budget(waiters: int) -> int:
    """The most the payloads of a barrier of ``waiters`` workers may add up to:
    GATHER_BYTES, less with many waiters (GATHER_SEND_BYTES / waiters), so that
    the replies of one barrier never queue more than GATHER_SEND_BYTES."""
    return min(GATHER_BYTES, GATHER_SEND_BYTES // max(waiters, 1))


@dataclass(frozen=True)
class Released:
    """A barrier's release, as the scheduler sent it: the job's ``number``-th barrier
    (from 1), the ``token`` its waiters agreed on, and ``barrier_done``'s ``fields``
    (its ``members`` among them: the worker ranks it was released to). A worker
    keeps the last one it heard and reports it to a restarted scheduler, which
    answers a worker its predecessor did not reach with it (:meth:`Barrier.replay`)."""
    number: int
    token: str
    fields: dict

    @property
    def members(self) -> list:
        return self.fields.get("members") or []

    def report(self) -> dict:
        """As a worker's rejoin report carries it (:func:`read_released` reads it back)."""
        return {"number": self.number, "token": self.token, "fields": self.fields}


def read_released(value, worker_ranks: int) -> Released | None:
    """A rejoin report's ``barrier`` (nil, or :meth:`Released.report`'s map) validated
    for a job of ``worker_ranks`` worker ranks; RendezvousError names the first bad field."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RendezvousError(f"rejoin's 'barrier' must be a map or nil, not {type(value).__name__}")
    number, token, fields = value.get("number"), value.get("token"), value.get("fields")
    if type(number) is not int or not 1 <= number < 2 ** 62 or not isinstance(token, str):
        raise RendezvousError("rejoin's 'barrier' needs a positive integer 'number' and a string 'token'")
    if not isinstance(fields, dict) or type(fields.get("epoch")) is not int \
            or not isinstance(fields.get("progress"), dict) or fields.get("barrier") != number:
        raise RendezvousError("rejoin's 'barrier' needs the barrier_done 'fields' (epoch, members, "
                              "progress and its number) of that barrier")
    members, data = fields.get("members"), fields.get("data")
    if not (isinstance(members, list) and all(type(r) is int and 0 <= r < worker_ranks for r in members)):
        raise RendezvousError(f"rejoin's 'barrier' members must be worker ranks below {worker_ranks}")
    if data is not None and not (isinstance(data, list) and len(data) == len(members)
                                 and all(isinstance(d, bytes) for d in data)):
        raise RendezvousError("rejoin's 'barrier' data must hold one bytes payload per member")
    return Released(number, token, fields)


@dataclass
class Barrier:
    """The workers waiting at the current barrier, their payloads and deadlines, and
    the job's last release (a restarted scheduler: as its workers reported it)."""
    # node_id -> (ident, req_id, token, payload: bytes, or None for a barrier without one)
    waiting: dict = field(default_factory=dict)
    deadlines: dict = field(default_factory=dict)  # node_id -> (deadline, its timeout)
    released: int = 0                 # the barriers released in this job
    last: Released | None = None      # the newest release

    def restore(self, last: Released | None) -> None:
        """A restarted scheduler: the newest release any worker reported (or none)."""
        self.released, self.last = (0, None) if last is None else (last.number, last)

    def replay(self, node: Node, ident: bytes, req_id, token, after) -> list[Send] | None:
        """A barrier request from ``node`` that saw ``after`` releases: when the
        scheduler before a restart released the job's last barrier to some workers
        and died before it reached this one, this one is answered with that release
        (or, for another token, alone with the disagreement). None: an ordinary arrival
        (this node saw every release it took part in, or sent no count)."""
        if type(after) is not int or self.last is None or after >= self.released:
            return None
        if node.rank not in self.last.members:   # a joiner: it took no part in that barrier
            return None
        if after != self.released - 1:
            raise RendezvousError(f"{node.name()} says it saw {after} barriers, but it took part in "
                                  f"barrier {self.released}, the job's last")
        if token != self.last.token:
            ref = min((r for r in self.last.members if r != node.rank), default=node.rank)
            return [Send(ident, wire.ERROR, {"id": req_id, "kind": wire.MISMATCH, "message": (
                f"{disagreement.PHRASE}: worker {node.rank} differs from worker {ref}: worker {ref}: "
                f"{self.last.token!r}; worker {node.rank}: {token!r} (barrier {self.released}, released "
                "to the others before the scheduler's restart)")})]
        return [Send(ident, wire.BARRIER_DONE, {"id": req_id, **self.last.fields})]

    def arrive(self, node_id: str, ident: bytes, req_id, token, limit, now: float, nodes: dict,
               data=None, budget: int = GATHER_BYTES) -> list[Send]:
        """A worker waits; ``limit``: its timeout (seconds), or no deadline unless a sane
        number; ``data``: its payload (bytes) or None. Raises RendezvousError for a
        payload that is not bytes or alone exceeds ``budget`` (nothing changes then).
        When the waiters' payloads together exceed ``budget`` (:func:`gather_budget`),
        the barrier fails for all of them, naming each one's size (``nodes``: every
        node by id)."""
        if data is not None and not isinstance(data, bytes):
            raise RendezvousError(f"a barrier's data must be bytes, not {type(data).__name__}")
        if data is not None and len(data) > budget:
            raise RendezvousError(f"a barrier's data of {len(data)} bytes exceeds the {budget} "
                                  "bytes the workers' payloads may take together")
        self.waiting[node_id] = (ident, req_id, token, data)
        if isinstance(limit, (int, float)) and not isinstance(limit, bool) and 0 < limit < 1e9:
            self.deadlines[node_id] = (now + limit, limit)
        else:
            self.deadlines.pop(node_id, None)
        sizes = {nodes[nid].rank: len(w[3]) for nid, w in self.waiting.items() if w[3] is not None}
        if sum(sizes.values()) <= budget:
            return []
        detail = ", ".join(f"worker {rank}: {n}" for rank, n in sorted(sizes.items()))
        return self.end(wire.ERROR, kind=wire.INVALID, message=(
            f"a gather's payloads take {sum(sizes.values())} bytes together, more than the "
            f"{budget} bytes one barrier may carry ({detail})"))

    def leave(self, node_id: str) -> None:
        """A waiter left the job: it is no longer waited for, nor answered."""
        self.waiting.pop(node_id, None)
        self.deadlines.pop(node_id, None)

    def release(self, expected: list[Node], nodes: dict, /, **done) -> list[Send]:
        """Once every one of ``expected`` waits: ``barrier_done`` (with the fields
        ``done``) to all if their tokens agree, else an error naming each one's token."""
        if not expected or any(n.node_id not in self.waiting for n in expected):
            return []
        if len({w[2] for w in self.waiting.values()}) == 1:
            payloads = [self.waiting[n.node_id][3] for n in sorted(expected, key=lambda n: n.ranked)]
            if any(p is not None for p in payloads):   # a gather: every one's payload, by rank
                done["data"] = [b"" if p is None else p for p in payloads]
            return self.end(wire.BARRIER_DONE, **done)
        detail = "; ".join(f"worker {nodes[nid].rank}: {w[2]!r}" for nid, w in
                           sorted(self.waiting.items(), key=lambda kv: nodes[kv[0]].rank))
        ref, odd = disagreement.odd_ones({nodes[nid].rank: w[2] for nid, w in self.waiting.items()})
        return self.end(wire.ERROR, kind=wire.MISMATCH, message=(
            f"{disagreement.PHRASE}: worker {odd[0]} differs from worker {ref}: {detail}"))

    def expire(self, now: float, members: list[Node], nodes: dict) -> list[Send]:
        """A waiter whose deadline passed: the barrier fails for every waiter, naming
        the ``members`` that did not arrive (the waiters know only that they waited)."""
        late = [nid for nid, (deadline, _) in self.deadlines.items() if now >= deadline]
        if not late:
            return []
        limit, token = self.deadlines[late[0]][1], self.waiting[late[0]][2]
        waiters = sorted(self.waiting, key=lambda nid: nodes[nid].rank)
        absent = sorted((n for n in members if n.node_id not in self.waiting), key=lambda n: n.ranked)
        names = ", ".join(n.name() for n in absent) or "no worker"
        return self.end(wire.ERROR, kind=wire.TIMEOUT, message=(
            f"a barrier ({token!r}) timed out after {limit:g}s: {names} did not arrive "
            f"(worker{'s' if len(waiters) > 1 else ''} {', '.join(str(nodes[nid].rank) for nid in waiters)} "
            "waited). A worker missing at a collective call failed before it or is stuck; "
            "raise KVSTORE_TIMEOUT if it is just slow"))

    def end(self, op: str, **fields) -> list[Send]:
        """Answer every waiter with ``op`` (``barrier_done``, ``error``) and start afresh.
        A ``barrier_done`` counts a release, carries its number (``barrier``) and is kept
        as :attr:`last`."""
        if op == wire.BARRIER_DONE:
            self.released += 1
            fields["barrier"] = self.released
            token = next(iter(self.waiting.values()))[2] if self.waiting else ""
            self.last = Released(self.released, token, dict(fields))
        sends = [Send(ident, op, {"id": req_id, **fields}) for ident, req_id, *_ in self.waiting.values()]
        self.waiting.clear()
        self.deadlines.clear()
        return sends


# what expire() writes, wherever it is quoted (a waiter's failure report):
# "a barrier ('x') timed out after 10s: worker 1 (pid 42 on h), ... did not arrive ("
_TIMED_OUT = re.compile(r"a barrier \(.*?\) timed out after \S+s: (.*?) did not arrive \(")
_WORKER_NAME = re.compile(r"\bworker (\d+) \(pid \d+ on ")


def absent_at_barrier(text: str | None) -> list[str]:
    """The workers (``'worker 1'``) a barrier timeout quoted in ``text`` names as
    absent, in order; [] if ``text`` quotes none. The launcher marks them as the
    root cause, not the waiter that reported the timeout."""
    found: list[str] = []
    for m in _TIMED_OUT.finditer(text or ""):
        found += [f"worker {rank}" for rank in _WORKER_NAME.findall(m[1])
                  if f"worker {rank}" not in found]
    return found


def describe_exit(code: int) -> str:
    """'exited with status 1' / 'was killed by SIGKILL'."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


_REGISTERED = re.compile(r"(\d+) of (\d+) (worker|server)s registered(?: \(missing ranks ([\d, ]+)\))?")


def absent_at_registration(text: str | None) -> list[str]:
    """The processes (``'server 1'``) a registration timeout quoted in ``text``
    (written by :func:`missing`) names as never registered; [] if it quotes none.
    The launcher marks them as the root cause of the timeout."""
    if not text or "registration did not complete" not in text:
        return []
    found: list[str] = []
    for got, total, role, ranks in _REGISTERED.findall(text):
        if ranks:
            found += [f"{role} {r.strip()}" for r in ranks.split(",") if r.strip()]
        elif int(got) == 0:
            found += [f"{role} {r}" for r in range(int(total))]
    return found


def missing(nodes, num_workers: int, num_servers: int) -> str:
    """Who registered so far: '1 of 2 workers registered (missing ranks 1); ...'."""
    nodes = list(nodes)
    have = {(n.role, n.rank) for n in nodes}
    parts = []
    for role, total in (("worker", num_workers), ("server", num_servers)):
        got = sum(1 for n in nodes if n.role == role)
        gone = [str(r) for r in range(total) if (role, r) not in have]
        detail = f" (missing ranks {', '.join(gone)})" if got and 0 < len(gone) < total else ""
        parts.append(f"{got} of {total} {role}s registered{detail}")
    return "; ".join(parts)
