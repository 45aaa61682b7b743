"""The records :class:`~.scheduler_state.SchedulerState` keeps and returns:
a registered :class:`Node`, the workers' :class:`Barrier`, a message to
:class:`Send`; and :func:`describe_exit` for the exit statuses launchers report.
Plain data, no I/O."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field


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

    def name(self) -> str:
        rank = "?" if self.rank is None else self.rank
        return f"{self.role} {rank} (pid {self.pid} on {self.host})"


@dataclass
class Barrier:
    """The workers waiting at the current barrier, and their deadlines."""
    waiting: dict = field(default_factory=dict)  # node_id -> (ident, req_id, token)
    deadlines: dict = field(default_factory=dict)  # node_id -> (deadline, its timeout)


def describe_exit(code: int) -> str:
    """'exited with status 1' / 'was killed by SIGKILL'."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"
