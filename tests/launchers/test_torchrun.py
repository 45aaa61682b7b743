"""Jobs started by torch's own launcher (real ``torchrun``): kvstore.create forms
the job from RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (tracker/torch_job.py),
on one node and on two, and a killed worker leaves nothing behind.

The job's secret comes from the environment (KVSTORE_SECRET, KVSTORE_SECRET_FILE)
and is used; it never enters torchrun's store, which any peer reads without
credentials (a test connects as one); no process listens on every interface; the
scheduler's port in that store is signed, and a forged one is refused."""

import ast
import hashlib
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
SECRET = "5e" * 32
sys.path.insert(0, os.path.join(ROOT, "tests", "scripts"))
from listening import on_every_interface  # noqa: E402   (tests/scripts/listening.py)

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


def secret_given(how, tmp_path) -> dict:
    """The variables that give the job SECRET ``how``: none, KVSTORE_SECRET, or a file
    only the user may read (KVSTORE_SECRET_FILE)."""
    if how == "file":
        path = tmp_path / "job-secret"
        path.write_text(SECRET + "\n")
        path.chmod(0o600)
        return {"KVSTORE_SECRET_FILE": str(path)}
    return {"KVSTORE_SECRET": SECRET} if how == "env" else {}


def assert_secret_used(text, how, ranks=(0, 1)):
    """Every worker authenticates with the secret given (or runs without one, saying so)."""
    want = hashlib.sha256(SECRET.encode()).hexdigest()[:16] if how != "none" else "none"
    for rank in ranks:
        assert re.search(rf"rank {rank} secret {want}$", text, re.MULTILINE), text
    assert ("not authenticated" in text) == (how == "none"), text


def assert_listens_on_no_wildcard(text, ranks=(0, 1)):
    for rank in ranks:
        line = re.search(rf"rank {rank} listens on (\[.*\])$", text, re.MULTILINE)
        assert line, text
        addresses = ast.literal_eval(line.group(1))
        assert not on_every_interface(addresses), f"worker {rank} listens on every interface: {addresses}"


@pytest.mark.parametrize("how", ["none", "env", "file"])
def test_standalone_two_workers_sum_every_push_and_torchruns_store_holds_no_secret(tmp_path, how):
    """Rank 0, as any peer of torchrun's store could, reads every key there: none is
    the job's secret or holds it (it used to be there, made by rank 0, for anyone
    to read and then push as a member). The secret given is what the workers use."""
    tag = uuid.uuid4().hex
    p = torchrun("--standalone", "--nproc-per-node", "2", env=env_for(tag, PEEK_STORE="1",
                                                                  **secret_given(how, tmp_path)), cwd=tmp_path)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    assert sorted(re.findall(r"rank (\d) of 2: pulled 3 3", out)) == ["0", "1"], out
    keys = ast.literal_eval(re.search(r"^store keys (\[.*\])$", out, re.MULTILINE).group(1))
    assert any(k.endswith("/scheduler_port") for k in keys), keys     # the peer did read the store
    assert not [k for k in keys if "secret" in k.lower()], keys
    assert "store values holding the secret: 0" in out, out
    assert_secret_used(out, how)
    assert_listens_on_no_wildcard(out)
    assert not eventually_empty(lambda: tagged(tag))


def loopback_host_name():
    """This machine's host name where it names a loopback address here (so that a job
    given it as MASTER_ADDR stays on loopback), else None."""
    import socket
    try:
        addr = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)[0][4][0]
    except (OSError, IndexError):
        return None
    return socket.gethostname() if addr.startswith("127.") else None


@pytest.mark.parametrize("master", ["127.0.0.1", "host-name"])
@pytest.mark.parametrize("how", ["none", "env", "file"])
def test_pytorchjob_style_one_process_per_pod(tmp_path, how, master):
    """What Kubernetes' PyTorchJob sets for `python script.py` in each pod: RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT only (no torchrun, no store); the secret
    from a Kubernetes Secret, as a variable or a mounted file. Each process is its
    host's local rank 0 and starts one server. MASTER_ADDR a host name (as a
    PyTorchJob's is): rank 0's scheduler listens on what it names, not on every
    interface (it did, for any MASTER_ADDR but a loopback address)."""
    if master == "host-name":
        master = loopback_host_name()
        if master is None:
            pytest.skip("this machine's host name does not name a loopback address here")
    # the scheduler takes MASTER_PORT + 1: once, in the full suite, it was taken
    tag, port = uuid.uuid4().hex, free_port_pair()
    extra = {"MASTER_ADDR": master, "MASTER_PORT": str(port), "WORLD_SIZE": "2", **secret_given(how, tmp_path)}
    pods = [subprocess.Popen([sys.executable, SCRIPT], env=env_for(tag, RANK=str(r), **extra), cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in pods]
    print(*(f"--- pod {r}:\n{o}" for r, o in enumerate(outs)), sep="\n")   # shown whole on a failure
    assert [p.returncode for p in pods] == [0, 0], outs
    text = "".join(outs)
    assert sorted(re.findall(r"rank (\d) of 2: pulled 3 3", text)) == ["0", "1"], text
    assert_secret_used(text, how)
    assert_listens_on_no_wildcard(text)
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


def test_the_scheduler_port_in_torchruns_store_is_signed_and_a_forged_one_is_refused():
    """Anyone who reaches torchrun's store may write it: a port rank 0 did not write
    would send the workers' credentials to whoever listens there. With a secret the
    port carries its HMAC (bound to the run, the restart and the port); a value
    without it, with another secret's, or one replayed from another restart is
    refused naming the key. (torch's in-process HashStore: the same Store API.)"""
    from torch.distributed import HashStore
    store = HashStore()
    run = torch_job._RunStore(store, "kvstore/run/0/")
    assert run.scheduler_port(41000, SECRET) == 41000              # rank 0 writes, reads back
    reader = torch_job._RunStore(store, "kvstore/run/0/")
    assert reader.scheduler_port(None, SECRET) == 41000            # the others
    assert SECRET not in store.get("kvstore/run/0/scheduler_port").decode()
    with pytest.raises(EnvError, match=r"key 'kvstore/run/0/scheduler_port'\) is not signed with this "
                                       r"process's secret: the job's processes were given different secrets"):
        reader.scheduler_port(None, "ff" * 32)
    signed = store.get("kvstore/run/0/scheduler_port")
    for forged in (b"41001", b"41001 " + signed.split()[1]):       # a port of the peer's, a copied tag
        store.set("kvstore/run/0/scheduler_port", forged)
        with pytest.raises(EnvError, match="another process wrote that key"):
            reader.scheduler_port(None, SECRET)
    store.set("kvstore/run/1/scheduler_port", signed)             # replayed into the next restart
    with pytest.raises(EnvError, match="is not signed"):
        torch_job._RunStore(store, "kvstore/run/1/").scheduler_port(None, SECRET)
    # without a secret (the job is not authenticated, as its log says) the port is plain
    assert torch_job._RunStore(store, "kvstore/open/0/").scheduler_port(41002, None) == 41002
    store.set("kvstore/open/0/scheduler_port", b"not a port")
    with pytest.raises(EnvError, match="is not a TCP port: 'not'"):
        torch_job._RunStore(store, "kvstore/open/0/").scheduler_port(None, None)
