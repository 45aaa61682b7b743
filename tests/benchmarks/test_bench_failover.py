"""benchmarks.failover at tiny size: a replicated job whose server is killed at a
random moment of a step ends with exit 0 and the reference run's weights, and its
pause is measured from the worker's own times; the table and JSON are written
where asked. Never asserts on speed."""

from __future__ import annotations

import os
import sys

import pytest

from experiments import run_experiment

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from benchmarks.failover import run  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_a_killed_server_is_measured_from_the_signal_to_the_next_round(tmp_path):
    [row], text = run_experiment(run.main, ["--runs", "1", "--steps", "9", "--keys", "2", "--size", "1024",
                                            "--variant", "SIGKILL"], tmp_path, "failover")
    assert (row["variant"], row["exit"], row["steps"]) == ("SIGKILL", 0, 9), row
    assert 3 <= row["at_step"] < 6 and 0 < row["pause_s"] < 60 and row["median_step_ms"] > 0
    assert row["same_weights"], "a failover with deterministic sums must leave the uninterrupted weights"
    assert "| SIGKILL | 1 | 1 | 1 |" in text



def test_over_an_emulated_link_each_layout_runs_without_and_with_replicas(tmp_path, netns_ok):
    """``--link 1gbit`` at tiny size: dedicated:2x2 without and with KVSTORE_REPLICAS=1
    (one launch round), the same final weights in both, each server host's link
    carrying the replica's copy (its share, N/S a step, more each way), and the
    ratio in the table."""
    steps, keys, size = 6, 2, 32768
    record, text = run_experiment(run.main, ["--link", "1gbit", "--layouts", "dedicated:2x2", "--launches", "1",
                                             "--steps", str(steps), "--keys", str(keys), "--size", str(size)],
                                  tmp_path, "failover-link")
    rows = record["rows"]
    assert [(r["layout"], r["replicas"]) for r in rows] == [("dedicated:2x2", False), ("dedicated:2x2", True)], rows
    assert not [r for r in rows if "failed" in r] and record["one_digest_per_w"], rows
    share = steps * keys * size * 4 / 2
    for host in ("S0", "S1"):
        plain, replicated = (r["bytes"][host] for r in rows)
        for d in ("tx", "rx"):
            assert 0.8 * share < replicated[d] - plain[d] < 1.5 * share, (host, d, plain, replicated)
    assert "| dedicated, 2 worker hosts + 2 server hosts | yes | 1 |" in text and "x** (" in text, text
