"""Replicated servers (KVSTORE_REPLICAS=1) through `python -m tracker.ssh` against a
real sshd on 127.0.0.2-3 (two emulated hosts, CURVE on, as between machines): the
launcher's code path is tracker.local's (tracker/launcher.py), so a server killed
mid-training is reported and survived, each backup on the other host, and the
workers end with the weights of an uninterrupted run without replicas, bit for
bit; nothing is left on any host."""

import os
import re

import pytest

from services import SCRIPTS, eventually_empty, python_launcher, tagged

pytestmark = pytest.mark.slow

SETTINGS = {"KVSTORE_DETERMINISTIC": "1", "KVSTORE_CHUNK_BYTES": "4096", "KVSTORE_HEARTBEAT_INTERVAL": "0.2",
            "KVSTORE_HEARTBEAT_TIMEOUT": "3", "KVSTORE_TIMEOUT": "30"}


# the checkout under test: the remote workers import kvstore from it (not from wherever
# the package is installed), as the servers do (python -m from the remote directory)
CHECKOUT = os.path.dirname(os.path.dirname(SCRIPTS))


def digests(text: str) -> set[str]:
    return set(re.findall(r"\[worker:\d[^\]]*\] digest (\w+)", text))


@pytest.fixture(scope="module")
def want() -> str:
    """The digest of the same job run by tracker.local without replicas or faults."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    reference = python_launcher("tracker.local", "-n", "2", "-s", "3", "python",
                                os.path.join(SCRIPTS, "replicated.py"), env={**base, **SETTINGS})
    assert reference.wait(120) == 0, reference.text
    [digest] = digests(reference.text)
    return digest


def test_a_server_killed_over_ssh_is_survived_with_the_uninterrupted_weights(sshd, want):
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    hosts = sshd.hostfile("# two loopback hosts", "127.0.0.2:{port}", "", "127.0.0.3:{port}")
    p = python_launcher("tracker.ssh", "-F", sshd.client_config, "--env", "KVSTORE_TEST_TAG", "--env", "KILL",
                        "-n", "2", "-s", "3", "-H", hosts, "--kill-grace", "1",
                        "python", os.path.join(SCRIPTS, "replicated.py"),
                        env={**base, **SETTINGS, "KVSTORE_REPLICAS": "1", "KILL": "1:4"})
    assert p.wait(120) == 0, p.text
    assert re.search(r"server 1 \(pid \d+ on [^)]+\) was killed by SIGKILL: its chunks are served by their backups", p.text), \
        p.text
    assert re.search(r"server \d serves server 1's chunks now", p.text), p.text
    assert digests(p.text) == {want}, p.text
    assert eventually_empty(lambda: tagged(p.tag)) == [], f"processes left behind:\n{p.text}"
    assert eventually_empty(sshd.sessions) == [], f"ssh sessions left behind:\n{p.text}"


def test_over_ssh_a_replacement_starts_on_the_dead_servers_host_and_a_second_kill_is_survived(sshd, want):
    """--restart-servers 1: server 1 killed, server 3 started on server 1's host over
    ssh, the replicas rebuilt on it, then server 2 (which serves server 1's share)
    killed: the weights of the uninterrupted run."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    hosts = sshd.hostfile("# two loopback hosts", "127.0.0.2:{port}", "", "127.0.0.3:{port}")
    p = python_launcher("tracker.ssh", "-F", sshd.client_config, "--env", "KVSTORE_TEST_TAG", "--env", "KILL",
                        "--env", "REBUILT", "--env", f"PYTHONPATH={CHECKOUT}", "-n", "2", "-s", "3", "-H", hosts, "--kill-grace", "1",
                        "--restart-servers", "1", "python", os.path.join(SCRIPTS, "replicated.py"),
                        env={**base, **SETTINGS, "KVSTORE_REPLICAS": "1", "KILL": "1:2,2:6", "REBUILT": "6"})
    assert p.wait(120) == 0, p.text
    assert "started server 3 in place of server 1" in p.text, p.text
    dead = re.search(r"server 1 \(pid \d+ on ([\w.]+)\) was killed", p.text)
    joined = re.search(r"server 3 \(pid \d+ on ([\w.]+)\) joined as a replacement", p.text)
    assert dead and joined and dead.group(1) == joined.group(1), p.text
    assert "killed server 2 at step 6" in p.text and "server 3 serves server 1's chunks now" in p.text, p.text
    assert digests(p.text) == {want}, p.text
    assert eventually_empty(lambda: tagged(p.tag)) == [], f"processes left behind:\n{p.text}"
    assert eventually_empty(sshd.sessions) == [], f"ssh sessions left behind:\n{p.text}"
