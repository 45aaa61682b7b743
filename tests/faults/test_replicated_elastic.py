"""Replicated servers in an elastic job (``KVSTORE_REPLICAS=1`` with ``--elastic``),
real jobs through ``python -m tracker.local``: worker 1 dies at step 5, the
launcher starts a new process in its rank, which joins the running job at step 8
and numbers its pushes from 1 again (kvstore.server.numbering); then server 1 is
killed (SIGKILL) at step 10, its backup takes over its chunks and the workers send
it what the dead server had not answered. The weights at every barrier and at the
end equal those of the same job without replicas and without the server's death,
bit for bit: no round lost or applied twice across the join and the failover."""

from __future__ import annotations

import os
import re
import sys

import pytest

from services import FAST_FAILURE, SCRIPTS, python_launcher

pytestmark = pytest.mark.timeout(120)

WORKER = os.path.join(SCRIPTS, "elastic_worker.py")
ENV = {**FAST_FAILURE, "KVSTORE_CHUNK_BYTES": "4096", "KVSTORE_TIMEOUT": "60"}
SCENARIO = ("train", "--steps", "16", "--every", "4", "--members", "2", "--die", "1", "--die-at", "5")


def job(*worker_args: str, **env: str) -> str:
    """The output of a 2-worker, 3-server elastic job that replaces one lost worker."""
    proc = python_launcher("tracker.local", "-n", "2", "-s", "3", "--elastic", "1:2", "--max-restarts", "1",
                           "--kill-grace", "1", sys.executable, WORKER, *SCENARIO, *worker_args,
                           env={**ENV, **env})
    assert proc.wait(100) == 0, proc.text
    return proc.text


def weights(text: str) -> list[tuple[str, str]]:
    """(who and when, digest) of every weights line the workers printed, sorted."""
    return sorted(re.findall(r"\[worker:\d\] (worker \d \w+ (?:step \d+ )?members \[[\d, ]+\]) weights (\w+)",
                             text))


def test_a_joiner_and_a_failover_keep_the_weights_of_the_job_without_replicas():
    reference = job()
    text = job("--kill-server", "1:10", KVSTORE_REPLICAS="1")
    assert "started worker 1 #1 in place of worker 1" in text, text
    assert re.search(r"worker 1 joined step 8 members \[0, 1\]", text), text
    assert "worker 0 killed server 1 at step 10" in text, text
    assert re.search(r"server 1 \(pid \d+ on [^)]+\) was killed by SIGKILL: its chunks are served by their "
                     r"backups", text), text
    got, want = weights(text), weights(reference)
    assert len(want) >= 8 and any("done" in who for who, _ in want), reference
    assert got == want, (got, want, text)
