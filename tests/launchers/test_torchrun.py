"""Jobs started by torch's own launcher (real ``torchrun``): kvstore.create forms
the job from RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (tracker/torch_job.py),
on one node and on two, and a killed worker leaves nothing behind."""

import os
import re
import shutil
import subprocess
import sys
import uuid

import pytest

from services import eventually_empty, free_port, free_port_pair, tagged
from tracker import torch_job
from tracker.control.env import EnvError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "torch_job.py")
TORCHRUN = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")

pytestmark = pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun is not installed")


def env_for(tag, **extra):
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    drop = {k for k in os.environ if k.startswith(("KVSTORE_", "DMLC_"))}
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "PYTHONPATH": path,
            "KVSTORE_TEST_TAG": tag, "KVSTORE_HEARTBEAT_INTERVAL": "0.2",
            "KVSTORE_HEARTBEAT_TIMEOUT": "3", "KVSTORE_TIMEOUT": "30", **extra}


def torchrun(*args, env, cwd):
    return subprocess.Popen([TORCHRUN, *args, SCRIPT], env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_standalone_two_workers_sum_every_push(tmp_path):
    tag = uuid.uuid4().hex
    p = torchrun("--standalone", "--nproc-per-node", "2", env=env_for(tag), cwd=tmp_path)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    assert sorted(re.findall(r"rank (\d) of 2: pulled 3 3", out)) == ["0", "1"], out
    assert "not authenticated" not in out     # the secret came through torchrun's store
    assert not eventually_empty(lambda: tagged(tag))


@pytest.mark.parametrize("secret", [None, "ab" * 32], ids=["no-secret", "KVSTORE_SECRET"])
def test_pytorchjob_style_one_process_per_pod(tmp_path, secret):
    """What Kubernetes' PyTorchJob sets for `python script.py` in each pod: RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT only (no torchrun, no store). Each process
    is its host's local rank 0 and starts one server."""
    # the scheduler takes MASTER_PORT + 1: once, in the full suite, it was taken
    tag, port = uuid.uuid4().hex, free_port_pair()
    extra = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
             **({"KVSTORE_SECRET": secret} if secret else {})}
    pods = [subprocess.Popen([sys.executable, SCRIPT], env=env_for(tag, RANK=str(r), **extra), cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in pods]
    print(*(f"--- pod {r}:\n{o}" for r, o in enumerate(outs)), sep="\n")   # shown whole on a failure
    assert [p.returncode for p in pods] == [0, 0], outs
    text = "".join(outs)
    assert sorted(re.findall(r"rank (\d) of 2: pulled 3 3", text)) == ["0", "1"], text
    assert ("not authenticated" in text) == (secret is None), text
    assert not eventually_empty(lambda: tagged(tag))


def test_a_pytorchjob_whose_scheduler_port_is_taken_fails_at_once_saying_so(tmp_path):
    """Rank 0 hosts the scheduler on MASTER_PORT + 1: taken, it ends in seconds naming
    the port and what to change (it was a ZMQError's traceback)."""
    import socket
    import time
    tag = uuid.uuid4().hex
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        env = env_for(tag, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(taken - 1))
        start = time.monotonic()
        p = subprocess.run([sys.executable, SCRIPT], env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=60)
    assert p.returncode != 0 and time.monotonic() - start < 20, p.stdout + p.stderr
    assert (f"rank 0 cannot host the job's scheduler on 127.0.0.1:{taken}" in p.stderr
            and f"that port is MASTER_PORT + 1 (MASTER_PORT={taken - 1})" in p.stderr), p.stderr
    assert not eventually_empty(lambda: tagged(tag))


def test_two_nodes_with_the_c10d_rendezvous_on_loopback(tmp_path):
    tag, port = uuid.uuid4().hex, free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", tag]
    nodes = [torchrun(*common, "--node-rank", str(n), env=env_for(tag, KVSTORE_SERVERS_PER_HOST="2"),
                      cwd=tmp_path) for n in range(2)]
    outs = [n.communicate(timeout=120)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs
    text = "".join(outs)
    assert sorted(re.findall(r"rank (\d) of 2: pulled 3 3", text)) == ["0", "1"], text
    # each node's local rank 0 started its two servers: four in all, ranks by node
    assert sorted(set(re.findall(r"\[server:(\d)\]", text))) == ["0", "1", "2", "3"], text
    assert not eventually_empty(lambda: tagged(tag))


def test_a_killed_worker_ends_the_job_and_leaves_nothing_behind(tmp_path):
    tag = uuid.uuid4().hex
    p = torchrun("--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
                 env=env_for(tag, KILL_RANK="0"), cwd=tmp_path)       # rank 0 hosts the scheduler
    out, _ = p.communicate(timeout=120)
    assert p.returncode != 0, out
    assert "Signal 9 (SIGKILL)" in out or "SIGKILL" in out, out
    assert not eventually_empty(lambda: tagged(tag)), "processes of the job outlived it"


@pytest.mark.parametrize("environ, match", [
    ({"RANK": "2", "WORLD_SIZE": "2"}, "disagree"),
    ({"RANK": "0", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "2"}, "every node must run"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x': must be an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "65535"}, "KVSTORE_SCHEDULER_PORT"),
    ({"RANK": "0", "WORLD_SIZE": "2", "GROUP_RANK": "2"}, "this job has 2 nodes"),
])
def test_malformed_torch_variables_are_named(environ, match):
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    with pytest.raises(EnvError, match=match):
        torch_job.detect({**base, **environ})


def test_our_launchers_variables_win_and_torch_variables_describe_the_job():
    base = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "3", "WORLD_SIZE": "4",
            "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "KVSTORE_SERVERS_PER_HOST": "3"}
    assert torch_job.detect({**base, "KVSTORE_ROLE": "worker"}) is None
    assert torch_job.detect({"RANK": "0"}) is None
    job = torch_job.detect(base)
    assert (job.node_rank, job.num_servers, list(job.server_ranks()), job.scheduler_port) == (1, 6, [3, 4, 5], 29501)
