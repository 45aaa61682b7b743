"""Replicated servers (KVSTORE_REPLICAS=1, docs/reliability.md): real jobs through
``python -m tracker.local -n 2 -s 3`` running tests/scripts/replicated.py (dist_sync,
keys cut over every server, SGD with momentum on the servers, deterministic sums).

A server killed (SIGKILL, by worker 0 right after its push of a step, so that the
step's rounds are open or unanswered, or between init and set_optimizer) or stopped (SIGSTOP: found by heartbeats)
mid-training: the job ends with exit 0 and every worker's final weights equal the
uninterrupted run's bit for bit. dist_async (tests/scripts/replicated_async.py):
every push applied exactly once across a failover (exact integer sums); dist_ssp
(tests/scripts/replicated_ssp.py): the same, and every read within the bound. Two
failures of one replication chain end the job naming both servers; what is not
built is refused at start, naming the setting."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "replicated.py")
# a killed server is seen by the launcher at once; the heartbeat timeout (10 s: a loaded
# machine starves a live process for seconds) matters only to the SIGSTOP test, which lowers it
BASE = {"KVSTORE_DETERMINISTIC": "1", "KVSTORE_CHUNK_BYTES": "4096", "KVSTORE_HEARTBEAT_INTERVAL": "0.2",
        "KVSTORE_HEARTBEAT_TIMEOUT": "10", "KVSTORE_TIMEOUT": "30", "KVSTORE_ABORT_GRACE": "2"}


def run(*command, servers=3, timeout=90, **env) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    full = {**{k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}, "PYTHONPATH": path,
            **BASE, **env}
    cmd = [sys.executable, "-m", "tracker.local", "-n", "2", "-s", str(servers), "--kill-grace", "1",
           *(command or (sys.executable, SCRIPT))]
    return subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def digests(out: subprocess.CompletedProcess) -> list[str]:
    found = sorted(re.findall(r"\[worker:(\d)\] digest (\w+)", out.stdout))
    assert [w for w, _ in found] == ["0", "1"], out.stdout + out.stderr
    return [d for _, d in found]


def reference_digest(out: subprocess.CompletedProcess) -> str:
    """The final weights of a job that must end well with both workers agreeing."""
    assert out.returncode == 0, out.stdout + out.stderr
    first, second = digests(out)
    assert first == second
    return first


@pytest.fixture(scope="module")
def uninterrupted() -> str:
    """The final weights of the job without replicas and without a fault."""
    return reference_digest(run())


@pytest.mark.parametrize("kill", ["1:4", "0:2", "2:8", "1:-1"])
def test_a_server_killed_mid_training_leaves_the_uninterrupted_weights(uninterrupted, kill):
    server, step = kill.split(":")
    out = run(KVSTORE_REPLICAS="1", KILL=kill)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert f"killed server {server} at step {step}" in out.stdout
    assert re.search(rf"server {server} \(pid \d+ on [^)]+\) was killed by SIGKILL: its chunks are served by their "
                     r"backups", log), log
    assert re.search(rf"server \d serves server {server}'s chunks now", log), log
    assert digests(out) == [uninterrupted, uninterrupted], log


@pytest.mark.parametrize("kill", ["1:4"])
def test_host_groups_push_their_sums_to_replicated_servers_and_a_failover_keeps_the_uninterrupted_weights(
        uninterrupted, kill):
    """KVSTORE_HOST_REDUCE=1: the two workers form one host group, whose leader pushes
    their sum of every pushpull (odd steps); each worker's push and pull of the even
    steps goes on its own. A server counts a chunk's pushes per worker, so the group's
    push counts for each member (else worker 1's own next push would carry a number
    the server had applied already, and its round would never complete). A server
    killed after a push of its own: the weights of the job without groups, replicas or
    fault."""
    server, step = kill.split(":")
    out = run(KVSTORE_REPLICAS="1", KVSTORE_HOST_REDUCE="1", KILL=kill)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert "host group=[0, 1]" in out.stdout, log
    assert f"killed server {server} at step {step}" in out.stdout, log
    assert digests(out) == [uninterrupted, uninterrupted], log


def test_compressed_pushes_are_sent_again_as_they_were_compressed():
    reference = run(COMPRESS="1")
    assert reference.returncode == 0, reference.stdout + reference.stderr
    out = run(KVSTORE_REPLICAS="1", KILL="1:4", COMPRESS="1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert digests(out) == digests(reference)


@pytest.mark.parametrize("kill", ["1:8", "0:8"])
def test_loaded_optimizer_states_reach_the_replicas_so_a_later_failover_keeps_the_uninterrupted_weights(
        tmp_path, kill):
    """load_optimizer_states after step 6 (states saved after step 3: the momentum
    changes), a server killed in step 8: the promoted backup's replicas had the loaded
    state, so the weights are those of the same job without replicas or fault."""
    reference = run(STATES=str(tmp_path / "reference.states"))
    assert reference.returncode == 0, reference.stdout + reference.stderr
    out = run(KVSTORE_REPLICAS="1", KILL=kill, STATES=str(tmp_path / "replicated.states"))
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert f"killed server {kill.split(':')[0]} at step 8" in out.stdout
    assert digests(out) == digests(reference), log


def test_the_trainers_load_state_dict_with_the_servers_updating_reaches_the_replicas():
    """kvstore.torch.Trainer (torch Adam's twin on the servers): state_dict() after
    step 3 loaded back after step 6, server 1 killed after step 8: the weights of
    the same job without replicas or fault."""
    script = os.path.join(ROOT, "tests", "scripts", "replicated_trainer.py")
    reference = run(sys.executable, script, timeout=120)
    assert reference.returncode == 0, reference.stdout + reference.stderr
    out = run(sys.executable, script, timeout=120, KVSTORE_REPLICAS="1", KILL="1:8")
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert "killed server 1 at step 8" in out.stdout and "served by their backups" in log, log
    assert digests(out) == digests(reference), log


def saved_chunks(folder) -> list[list[tuple]]:
    """The chunk ids in each server's committed checkpoint file, by server rank."""
    from kvstore.server import checkpoint
    names = sorted(n for n in os.listdir(folder) if n.endswith(".ckpt"))
    assert names == [f"server-{r}.ckpt" for r in range(3)], names
    return [[(c[0], c[1]) for c in checkpoint.load(os.path.join(folder, n))["chunks"]] for n in names]


@pytest.mark.parametrize("first, save, second", [
    ("1:6", 3, "2:8"),      # saved with every server alive, failed over after; resumed, then a failover
    ("1:2", 5, "0:8"),      # saved after a failover (server 2 writes server 1's part)
])
def test_a_checkpoint_before_or_after_a_failover_resumes_to_the_uninterrupted_weights(
        uninterrupted, tmp_path, first, save, second):
    """A replicated job saves a checkpoint after step ``save`` and a server dies
    (before or after the save); the job ends after step 7 and is resumed with
    --resume, where another server dies: the weights of the uninterrupted job. Each
    chunk is in exactly one server's file (the primary's, never a replica), and the
    resumed primaries rebuild their backups' replicas (values and optimizer state)
    before the second failover needs them."""
    folder = str(tmp_path / "ckpt")
    out = run(KVSTORE_REPLICAS="1", KVSTORE_CHECKPOINT_DIR=folder, KILL=first, SAVE=str(save), STOP="7")
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert f"killed server {first.split(':')[0]}" in out.stdout, log
    if first == "1:2":
        assert "server 2: server 1's part of checkpoint 1 (its share, served here) written" in log, log
    chunks = saved_chunks(folder)
    every = [c for part in chunks for c in part]
    assert len(every) == len(set(every)), chunks            # each chunk saved once
    assert {k for k, _ in every} == {"w", "b", "v"} and all(part for part in chunks), chunks
    resumed = run(KVSTORE_REPLICAS="1", KVSTORE_CHECKPOINT_DIR=folder, KVSTORE_RESUME="1", KILL=second)
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, log
    assert f"resumed=True start={save + 1}" in resumed.stdout, log
    assert f"killed server {second.split(':')[0]} at step 8" in resumed.stdout, log
    assert digests(resumed) == [uninterrupted, uninterrupted], log


@pytest.mark.parametrize("kill", ["1:4", "0:7", "2:3"])
def test_row_sparse_rounds_are_replicated_so_a_failover_keeps_the_uninterrupted_table(kill):
    """A row-sparse table (lazy Adam on the servers, an assign_rows after step 3)
    beside a dense key and a dense key pushed row-sparse gradients (lazy updates of
    the rows named); a server killed after the pushes of a step: the weights of the
    same job without replicas, bit for bit."""
    script = os.path.join(ROOT, "tests", "scripts", "replicated_rows.py")
    reference = run(sys.executable, script)
    assert reference.returncode == 0, reference.stdout + reference.stderr
    out = run(sys.executable, script, KVSTORE_REPLICAS="1", KILL=kill)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    for item in kill.split(","):
        server, step = item.split(":")
        assert f"killed server {server} at step {step}" in out.stdout, log
    assert digests(out) == digests(reference), log


@pytest.mark.parametrize("first, save, second", [("1:6", 4, "2:8"), ("1:2", 5, "0:8")])
def test_row_sparse_tables_checkpointed_before_or_after_a_failover_resume_to_the_uninterrupted_table(
        tmp_path, first, save, second):
    """tests/scripts/replicated_rows.py saved after step ``save`` with a server
    killed before or after, ended after step 7, resumed with another server killed:
    the weights of the job without replicas or fault (the resumed row tables'
    replicas rebuilt, values and lazy Adam state)."""
    script = os.path.join(ROOT, "tests", "scripts", "replicated_rows.py")
    reference = run(sys.executable, script)
    assert reference.returncode == 0, reference.stdout + reference.stderr
    folder = str(tmp_path / "ckpt")
    out = run(sys.executable, script, KVSTORE_REPLICAS="1", KVSTORE_CHECKPOINT_DIR=folder, KILL=first,
              SAVE=str(save), STOP="7")
    assert out.returncode == 0, out.stdout + out.stderr
    every = [c for part in saved_chunks(folder) for c in part]
    assert len(every) == len(set(every)) and {("emb", s) for s in range(3)} <= set(every), every
    resumed = run(sys.executable, script, KVSTORE_REPLICAS="1", KVSTORE_CHECKPOINT_DIR=folder,
                  KVSTORE_RESUME="1", KILL=second)
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, log
    assert f"resumed=True start={save + 1}" in resumed.stdout and "killed server" in resumed.stdout, log
    assert digests(resumed) == digests(reference), log


def test_a_stopped_server_is_failed_over_by_heartbeats_and_ended(uninterrupted):
    out = run(KVSTORE_REPLICAS="1", KILL="1:4", KILL_SIGNAL="SIGSTOP", KVSTORE_HEARTBEAT_TIMEOUT="2")
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert "server 1 (pid" in log and "sent no heartbeat" in log, log
    assert "served by their backups" in log
    assert digests(out) == [uninterrupted, uninterrupted], log


@pytest.mark.parametrize("kill", ["1:10", "0:25"])
def test_dist_async_applies_every_acknowledged_push_exactly_once_across_a_failover(kill):
    out = run(sys.executable, os.path.join(ROOT, "tests", "scripts", "replicated_async.py"),
              KVSTORE_REPLICAS="1", KVSTORE_DETERMINISTIC="0", KILL=kill)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert f"killed server {kill.split(':')[0]}" in out.stdout
    assert sorted(re.findall(r"\[worker:(\d)\] exact", out.stdout)) == ["0", "1"], log


@pytest.mark.parametrize("kill, signal, moment", [
    ("1", "SIGKILL", "before"), ("2", "SIGKILL", "during"), ("0", "SIGSTOP", "during")])
def test_dist_ssp_keeps_its_bound_and_applies_every_push_once_across_a_failover(tmp_path, kill, signal, moment):
    """tests/scripts/replicated_ssp.py, staleness 1: worker 1 held while worker 0 is as
    far ahead as the bound allows, a server stopped (SIGKILL, or SIGSTOP found by
    heartbeats) before or while worker 0's next read waits there; worker 1 released
    once worker 0 routes to the promoted backup. Every read holds the bound (a
    promoted backup whose clocks were not the primary's lets that read through at
    once: "bound broken") and every push is applied exactly once."""
    script = os.path.join(ROOT, "tests", "scripts", "replicated_ssp.py")
    env = {"KVSTORE_HEARTBEAT_TIMEOUT": "2"} if signal == "SIGSTOP" else {}
    out = run(sys.executable, script, KVSTORE_REPLICAS="1", KVSTORE_DETERMINISTIC="0", KVSTORE_STALENESS="1",
              EVENTS=str(tmp_path), KILL=kill, KILL_SIGNAL=signal, MOMENT=moment, **env)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert f"killed server {kill} before the read of step 5 ({moment})" in out.stdout, log
    assert "served by their backups" in log and f"serves server {kill}'s chunks now" in log, log
    if signal == "SIGSTOP":
        assert "sent no heartbeat" in log, log
    assert "bound broken" not in log
    assert sorted(re.findall(r"\[worker:(\d)\] exact", out.stdout)) == ["0", "1"], log


SETTLE = """
import numpy as np, kvstore
kv = kvstore.create("dist_sync")
kv.init("w", np.zeros(3000, np.float32))
out = np.empty(3000, np.float32)
for step in range(4):
    kv.pushpull("w", np.full(3000, kv.rank + 1.0, np.float32), out=out)
failover = kv._client.failover
held = failover.unsettled()
kv.barrier()
print("HELD", bool(held), "AFTER", failover.unsettled(), "SUM", float(out[0]), flush=True)
kv.close()
"""


def test_replies_leave_before_the_backup_and_a_worker_keeps_its_pushes_until_they_are_durable():
    """A round's replies name their replicate (``ticket``) and leave at once: after
    the last step each worker still holds pushes the backups may lack. A barrier
    (where the others may go on to read them; every call through the scheduler,
    set_optimizer's too, takes the same path: DistStore._collective) first sends
    the ``durable`` request (close does too), whose reply leaves only when the
    backups have them and says so: nothing is held after it. Without an optimizer the value is the
    last round's sum, 1 + 2."""
    out = run(sys.executable, "-c", SETTLE, timeout=60, KVSTORE_REPLICAS="1")
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert sorted(re.findall(r"HELD (\w+) AFTER (\[\]) SUM (\S+)", out.stdout)) == [("True", "[]", "3.0")] * 2, log


def test_two_failures_of_one_chain_end_the_job_naming_both_servers():
    out = run(KVSTORE_REPLICAS="1", KILL="1:2,2:6")
    log = out.stdout + out.stderr
    assert out.returncode != 0
    assert "Two failures of one replication chain (servers 1 and 2)" in log, log
    assert "job failed" in log


def test_without_replicas_a_killed_server_still_ends_the_job():
    out = run(KILL="1:2")
    assert out.returncode != 0
    assert "server 1 was killed by SIGKILL" in out.stdout + out.stderr


@pytest.mark.parametrize("case, env, servers, text", [
    ("one server", {}, 1, "KVSTORE_REPLICAS=1 needs at least 2 servers"),
    ("clipping on the servers", {"STORE": "clip"}, 2,
     "TorchAdamW with clip_grad_norm or grad_scale (kvstore.torch.Trainer's clip_grad_norm="),
])
def test_what_is_not_built_is_refused_at_start_naming_the_setting(tmp_path, case, env, servers, text):
    code = ("import os, numpy as np, kvstore\n"
            "kind = 'dist_ssp' if os.environ.get('STORE') == 'dist_ssp' else os.environ.get('KIND', 'dist_sync')\n"
            "kv = kvstore.create(kind)\n"
            "if os.environ.get('STORE') == 'clip':\n"
            "    kv.set_optimizer(kvstore.optimizer.create('torch_adamw', lr=0.1, clip_grad_norm=1.0))\n")
    env = {k: v.replace("{tmp}", str(tmp_path / "ckpt")) for k, v in env.items()}
    out = run(sys.executable, "-c", code, servers=servers, timeout=60, KVSTORE_REPLICAS="1", **env)
    assert out.returncode != 0
    assert text in out.stdout + out.stderr, (case, out.stdout + out.stderr)
