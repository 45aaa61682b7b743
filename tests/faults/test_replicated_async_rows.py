"""Row-sparse and dynamic keys in dist_async on replicated servers
(KVSTORE_REPLICAS=1, docs/reliability.md): a real job through ``python -m
tracker.local -n 2 -s 3`` running tests/scripts/replicated_async_rows.py (integer
row-sparse pushes to a row-sparse table and to a dynamic one under SGD with
learning rate 1). A server SIGKILLed by worker 0 right after its pushes of a step,
while pushes are in flight: the job ends with exit 0 and every row of both tables
is exactly its initial value minus every push of it, each applied exactly once
(counted); with ``--restart-servers`` a second server killed after a replacement
rebuilt the replicas too. (The state machine's side:
tests/server/test_async_row_replication.py.)"""

from __future__ import annotations

import os
import re
import sys

import pytest

from test_replicated_servers import ROOT, run

SCRIPT = os.path.join(ROOT, "tests", "scripts", "replicated_async_rows.py")


def exact(out) -> None:
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert sorted(re.findall(r"\[worker:(\d)\] exact", out.stdout)) == ["0", "1"], log


@pytest.mark.parametrize("kill", ["1:8", "0:20"])
def test_dist_async_row_pushes_are_applied_exactly_once_across_a_failover(kill):
    out = run(sys.executable, SCRIPT, KVSTORE_REPLICAS="1", KVSTORE_DETERMINISTIC="0", KILL=kill)
    exact(out)
    server, step = kill.split(":")
    assert f"killed server {server} at step {step}" in out.stdout, out.stdout + out.stderr
    assert "served by their backups" in out.stdout + out.stderr


def test_a_replacement_rebuilds_the_row_tables_so_a_second_kill_applies_every_push_once_too():
    """2 servers: server 1 dies, server 2 (the replacement) backs up both shares (server
    0 serves them, and rebuilds their replicas on it); server 0 dies and server 2 serves both."""
    out = run("--restart-servers", "1", sys.executable, SCRIPT, servers=2, timeout=150, KVSTORE_REPLICAS="1",
              KVSTORE_DETERMINISTIC="0", KILL="1:4,0:22", REBUILT="22")
    exact(out)
    log = out.stdout + out.stderr
    assert "killed server 0 at step 22" in out.stdout and "owners [2, 2]" in log, log
