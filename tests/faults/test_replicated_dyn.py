"""Dynamic rows (kvstore.DynamicRows) on replicated servers (KVSTORE_REPLICAS=1,
docs/reliability.md): a real job through ``python -m tracker.local -n 2 -s 3``
running tests/scripts/replicated_dyn.py (dist_sync, deterministic sums, lazy Adam
on the servers, rows created and evicted by budget and by age every few steps).
A server SIGKILLed by worker 0 right after its pushes of a step: the job ends with
exit 0 and the final table (every id pushed, pulled) and its counters equal the
same job's without replicas, bit for bit; with ``--restart-servers`` a second
server killed after a replacement rebuilt the replicas (every table sent whole)
too. (The state machine's side:
tests/server/test_dyn_replication.py.)"""

from __future__ import annotations

import os
import sys

import pytest

from test_replicated_servers import ROOT, digests, reference_digest, run

SCRIPT = os.path.join(ROOT, "tests", "scripts", "replicated_dyn.py")


@pytest.fixture(scope="module")
def uninterrupted() -> str:
    """The final table of the job without replicas and without a fault."""
    return reference_digest(run(sys.executable, SCRIPT))


@pytest.mark.parametrize("kill", ["1:5", "0:0"])
def test_a_server_killed_mid_training_leaves_the_uninterrupted_dynamic_table(uninterrupted, kill):
    out = run(sys.executable, SCRIPT, KVSTORE_REPLICAS="1", KILL=kill)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    server, step = kill.split(":")
    assert f"killed server {server} at step {step}" in out.stdout, log
    assert "counters" in out.stdout and digests(out) == [uninterrupted, uninterrupted], log


def test_a_replacement_rebuilds_the_dynamic_tables_so_a_second_kill_keeps_the_uninterrupted_table(uninterrupted):
    """Server 1 dies at step 2: server 2 serves its share; server 3, its replacement,
    backs up shares 0 and 1, rebuilt (each table as it is, with its rounds applied).
    Server 2 dies at step 7: server 3 serves server 1's share, server 0 server 2's."""
    out = run("--restart-servers", "2", sys.executable, SCRIPT, KVSTORE_REPLICAS="1", KILL="1:2,2:7", REBUILT="7",
              timeout=120)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert "started server 3 in place of server 1" in log and "[worker:0] replicas rebuilt" in out.stdout, log
    assert "killed server 2 at step 7" in out.stdout, log
    assert digests(out) == [uninterrupted, uninterrupted], log
