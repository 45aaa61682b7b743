"""Dynamic rows (kvstore.DynamicRows) on replicated servers (KVSTORE_REPLICAS=1,
docs/reliability.md): a real job through ``python -m tracker.local -n 2 -s 3``
running tests/scripts/replicated_dyn.py (dist_sync, deterministic sums, lazy Adam
on the servers, rows created and evicted by budget and by age every few steps).
A server SIGKILLed by worker 0 right after its pushes of a step: the job ends with
exit 0 and the final table (every id pushed, pulled) and its counters equal the
same job's without replicas, bit for bit. (The state machine's side:
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
