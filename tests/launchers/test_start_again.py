"""The launcher's side of starting a server again in place before a replicated job
formed (tracker.control.start_again): with real processes, a stopped server is
killed and its command started again under the same rank, once per request the
scheduler made. The scheduler's decisions: tests/scheduler/test_scheduler_start_again.py;
a whole job whose server is killed as soon as it exists: tests/faults/test_chaos.py."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys

import pytest

from tracker.launcher import _StartsAgain
from tracker.process import Child, ProcSpec, terminate_all

pytestmark = pytest.mark.timeout(60)

SLEEPER = (sys.executable, "-c", "import os, signal; print('up', os.environ['KVSTORE_RANK'], flush=True); "
                                 "signal.pause()")


def ended(child: Child, within: float = 10.0) -> int | None:
    """The child's status once it ended (waited for up to ``within`` s); None if it still runs."""
    try:
        return child.popen.wait(within)
    except subprocess.TimeoutExpired:
        return None


def test_a_stopped_server_is_killed_and_started_again_under_its_rank_once_per_request():
    out = io.StringIO()
    spawn = lambda proc: Child(proc, out)      # noqa: E731
    worker = spawn(ProcSpec("worker", 0, SLEEPER, env={"KVSTORE_RANK": "0"}))
    server = spawn(ProcSpec("server", 1, SLEEPER, env={"KVSTORE_RANK": "1", "MARK": "x"}))
    children, codes = [worker, server], {}
    again = _StartsAgain(spawn, children, codes)
    try:
        server.signal(signal.SIGSTOP)
        again({})
        assert len(children) == 2 and server.poll() is None, "nothing asked, nothing done"
        again({1: 1})
        assert ended(server) == -signal.SIGKILL and codes == {"server 1": -signal.SIGKILL}
        assert [c.spec.label for c in children] == ["worker 0", "server 1", "server 1 #1"]
        new = children[-1]
        assert (new.spec.argv, new.spec.env, new.spec.rank) == (server.spec.argv, server.spec.env, 1)
        assert new.poll() is None and worker.poll() is None
        again({1: 1})                                 # the same request, read again: nothing more
        assert len(children) == 3
        os.kill(new.pid, signal.SIGKILL)              # it died by itself: recorded by the monitor
        assert ended(new) == -signal.SIGKILL
        codes[new.spec.label] = -signal.SIGKILL
        again({1: 2})
        assert [c.spec.label for c in children][-1] == "server 1 #2" and codes["server 1 #1"] == -signal.SIGKILL
    finally:
        terminate_all([c for c in children if c.poll() is None], 1.0, lambda: False)
